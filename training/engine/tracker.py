"""What the engine records through, without knowing where it goes.

Rank 0 gets a `Tracker` from the job's `TrackerFactory` (training.mlops.tracking gives
one that journals to MLflow); every other rank, and rank 0 of a job without tracking,
gets a `NullTracker`, so the loop never asks "am I rank 0?". The factory travels to the
workers inside the job (it pickles), so the engine itself never imports MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tracker(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_series(self, key: str, first_step: int, values: list[float]) -> None:
        """One value per step from `first_step` on."""

    def log_checkpoint(self, path: Path, step: int, metrics: dict[str, float]) -> None:
        """A complete checkpoint folder and the metrics of its step."""

    def set_tag(self, key: str, value: str) -> None: ...

    def log_text(self, text: str, artifact_file: str) -> None: ...

    def finish(self) -> None:
        """Nothing more will be recorded: what is left may start on its way now (without
        waiting for it), while the caller ends its other work."""

    def close(self) -> None:
        """Return once everything recorded is where it goes (finishing first if needed)."""


class TrackerFactory(Protocol):
    def open(self, journal: Path) -> Tracker:
        """Rank 0's tracker; `journal` is the job's file for records not yet shipped."""


class NullTracker:
    """What every rank but 0 gets (and rank 0 with tracking off): records nothing."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_series(self, key: str, first_step: int, values: list[float]) -> None:
        pass

    def log_checkpoint(self, path: Path, step: int, metrics: dict[str, float]) -> None:
        pass

    def set_tag(self, key: str, value: str) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_tracker(is_main: bool, factory: TrackerFactory | None, journal: Path) -> Tracker:
    if is_main and factory is not None:
        return factory.open(journal)
    return NullTracker()
