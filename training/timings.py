"""Where a pipeline run's wall time goes, for `benchmarks/pipeline.py`.

With `GRADLINE_TIMINGS` set to a file, the flow and the stage processes it starts append
one JSON line per measured span: the flow's wall per stage, each stage's own work, when
the flow began. Unset (always, outside the benchmark), nothing is written or imported.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

TIMINGS_ENV = "GRADLINE_TIMINGS"


def record_timing(**fields: object) -> None:
    """Append `fields` (and the wall clock) as one line, when timings are wanted."""
    path = os.environ.get(TIMINGS_ENV)
    if not path:
        return
    line = json.dumps({**fields, "at": time.time()}) + "\n"
    # One write of a short line with O_APPEND: lines of concurrent writers never mix.
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line.encode())
    finally:
        os.close(descriptor)


@contextmanager
def timed_span(what: str, **fields: object) -> Iterator[None]:
    """Record how long the block took as `{what, seconds, ...fields}`."""
    started = time.perf_counter()
    try:
        yield
    finally:
        record_timing(what=what, seconds=time.perf_counter() - started, **fields)


class StepClock:
    """Which step a run is at (named when it fails) and, when timings are wanted, each
    step's wall as `{what: "flow_step", step, seconds}`, recorded as the next one begins."""

    def __init__(self, first: str) -> None:
        self.current, self._began = first, time.perf_counter()

    def at(self, step: str) -> None:
        """The run moves on to `step`."""
        now = time.perf_counter()
        record_timing(what="flow_step", step=self.current, seconds=now - self._began)
        self.current, self._began = step, now
