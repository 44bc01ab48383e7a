"""Progress of a long step: a rich bar on a terminal, a plain log line per 10 % otherwise
(every 10 s when the total is not known in advance).

`GRADLINE_PROGRESS=plain` forces log lines (and `bars` forces bars). rich is optional:
without it the plain form is used.
"""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger("gradline")
MODE_ENV = "GRADLINE_PROGRESS"
UNKNOWN_TOTAL_LOG_SECONDS = 10.0


def _bars_wanted() -> bool:
    mode = os.environ.get(MODE_ENV, "auto")
    if mode in ("plain", "bars"):
        return mode == "bars"
    return sys.stderr.isatty()


class Progress:
    def __init__(self, description: str, total: int | None, unit: str, done: int = 0) -> None:
        self.description, self.total, self.unit, self.done = description, total, unit, done
        self._bar = None
        self._log_every = max(1, total // 10) if total else None
        self._next_log = done + self._log_every if self._log_every else None
        self._last_log_time = time.monotonic()
        if _bars_wanted():
            try:  # deferred: rich is optional, and costs ~0.25 s where no bar is drawn
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
                from rich.progress import Progress as RichProgress
            except ImportError:
                return
            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(unit),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._bar.start()
            self._task = self._bar.add_task(description, total=total, completed=done)

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
        elif self._next_log is not None:
            if self.done >= self._next_log:
                self._next_log += self._log_every
                share = 100 * self.done / self.total
                done = f"{self.done}/{self.total} {self.unit}"
                log.info("%s: %s (%.0f%%)", self.description, done, share)
        elif time.monotonic() - self._last_log_time >= UNKNOWN_TOTAL_LOG_SECONDS:
            self._last_log_time = time.monotonic()
            log.info("%s: %d %s so far", self.description, self.done, self.unit)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
