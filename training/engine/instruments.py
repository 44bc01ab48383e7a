"""Instrumentation around the phases of a step: heartbeat, timing and fault injection.

The loop wraps each phase in `with instruments.phase(name, step):` instead of threading
heartbeat, timer and fault calls through the step. A phase records where the rank is
(so a hang names it), adds its seconds to the interval's time breakdown, and, on entry
to the data phase, gives injected faults (tests and drills) their chance to fire.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from training.engine.control import Control
from training.engine.faults import FaultPlan, burn, parse
from training.engine.health import SYNC, Heartbeat
from training.engine.jobdir import JobDir
from training.engine.timing import StepTimes
from training.engine.topology import Topology

# The heartbeat's names for the timed phases; a rank seen in "sync" is waiting for peers.
_BEAT = {"data_wait": "data", "sync_wait": SYNC, "checkpoint_stall": "checkpoint"}


class Instruments:
    def __init__(
        self, job_dir: JobDir, topo: Topology, control: Control, faults: str | None
    ) -> None:
        self.heartbeat = Heartbeat(control, topo.rank)
        self.faults = FaultPlan(parse(faults or ""), topo.rank, topo.attempt, job_dir.health)
        self.times = StepTimes()
        # This attempt's time in steps (validation excluded) and the job's steps taken:
        # what benchmarks compare (the loop adds them up, see training.engine.loop).
        self.loop_seconds, self.loop_steps = 0.0, 0
        self.last: dict[str, float] = {}  # the latest seconds of each phase

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        self.heartbeat.beat(step, _BEAT.get(name, name))
        if name == "data_wait":
            self.faults.at_step(step)
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        self.last[name] = seconds
        self.times.add(name, seconds)

    def stretch(self, step: int, own_seconds: float, phase: str = "compute") -> None:
        """Injected slowness (faults `slow` with a factor, `hiccup`): the rank's own work
        in `phase` of the step, waiting excluded, stretched as a slower device would and
        counted in that phase. The loop stretches every phase of a rank's own work (data,
        compute, optimizer), so a rank made twice as slow is twice as slow in all of it."""
        if not self.faults.active:
            return
        extra = self.faults.stretch(step, own_seconds)
        burn(extra)  # the rank's own core, busy: not handed to the other ranks' threads
        self.times.add(phase, extra)

    def move(self, seconds: float, source: str, target: str) -> None:
        """Re-attribute time measured inside one phase to another (sync wait measured
        within backward belongs to sync_wait, not compute)."""
        self.times.add(source, -seconds)
        self.times.add(target, seconds)

    def collective(self, step: int) -> None:
        """About to wait in a collective: a hang from here on is not this rank's fault."""
        self.heartbeat.beat(step, SYNC)

    def step_done(self) -> None:
        """This rank's gradient is done (its time breakdown is per gradient)."""
        self.times.steps += 1

    def close(self) -> None:
        self.heartbeat.close()
