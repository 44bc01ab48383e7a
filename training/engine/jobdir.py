"""Every file of one training job, in the checkpoint location that every node sees."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class JobDir:
    """The job's checkpoints, rank 0's tracking journal, the run id, drill records
    (health/). Stop requests and heartbeats do not go through files
    (training.engine.control)."""

    path: Path

    @property
    def journal(self) -> Path:
        return self.path / "tracking.jsonl"

    @property
    def health(self) -> Path:
        return self.path / "health"

    @property
    def run_file(self) -> Path:
        return self.path / "run.json"

    @property
    def complete_marker(self) -> Path:
        return self.path / "COMPLETE"
