"""Where each attempt of a job began: proof that a resumed job did not restart at step 0.

Training is deterministic and tracking keeps one value per metric and step, so neither
the final weights nor the MLflow run tell a resumed attempt from one that silently
started over. Rank 0 therefore writes, in the job's health folder, when an attempt's
first step ends (the step it actually ran, not the one it meant to run):

- `attempts.jsonl`: one line per attempt, fresh or resumed: its first step, its layout,
  and the checkpoint it continued from (null on a fresh start);
- `resumes.jsonl`: one line per resume of the job (a job preempted three times has
  three), with the checkpoint's step and the layout and world size that wrote it;
- `resumed.json`: the latest resume, with `step` (steps done when its first step
  ended) and `time` (when), which recovery-time benchmarks read;

and tags the job's MLflow run with `gradline.resumed_from` (the checkpoint's step) and
`gradline.resumes` (how many times the job resumed).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.engine.topology import Topology
from training.engine.tracker import Tracker

ATTEMPTS = "attempts.jsonl"
RESUMES = "resumes.jsonl"
LATEST_RESUME = "resumed.json"
RESUMED_FROM_TAG = "gradline.resumed_from"
RESUME_COUNT_TAG = "gradline.resumes"


@dataclass(frozen=True)
class Origin:
    """The checkpoint an attempt continues from, and how the job that wrote it was laid out."""

    path: Path
    step: int
    world_size: int | None  # None for checkpoints older than these fields
    mesh: dict[str, int] | None

    @classmethod
    def of(cls, path: Path, train_state: dict[str, Any]) -> Origin:
        return cls(
            path=path,
            step=int(train_state["step"]),
            world_size=train_state.get("world_size"),
            mesh=train_state.get("mesh"),
        )

    def as_dict(self) -> dict[str, Any]:
        # The folder's name, not its path: the job's folder may move or be mounted elsewhere.
        return {
            "checkpoint": self.path.name,
            "checkpoint_step": self.step,
            "written_by": {"world_size": self.world_size, "mesh": self.mesh},
        }


class AttemptRecord:
    """Rank 0's record of this attempt's start; `first_step_done` is the one call the loop
    makes, once. Off rank 0 it records nothing, as the tracker does."""

    def __init__(self, health: Path, topo: Topology, tracker: Tracker, origin: Origin | None):
        self.health, self.tracker, self.origin = health, tracker, origin
        self.enabled = topo.is_main
        self.now = {"world_size": topo.world_size, "mesh": topo.shape.as_dict()}
        self.attempt = topo.attempt

    def first_step_done(self, step: int) -> None:
        """The attempt's first step, `step`, has just ended."""
        if not self.enabled:
            return
        now = time.time()
        entry = {
            "attempt": self.attempt,
            "first_step": step,
            **self.now,
            "resumed_from": self.origin.as_dict() if self.origin else None,
            "time": now,
        }
        _append(self.health / ATTEMPTS, entry)
        if self.origin is None:
            return
        resume = {
            **self.origin.as_dict(),
            "resumed_by": self.now,
            "attempt": self.attempt,
            "first_step": step,
            "step": step + 1,  # steps done when the first step ended (benchmarks' field)
            "time": now,
        }
        _append(self.health / RESUMES, resume)
        (self.health / LATEST_RESUME).write_text(json.dumps(resume))
        self.tracker.set_tag(RESUMED_FROM_TAG, str(self.origin.step))
        self.tracker.set_tag(RESUME_COUNT_TAG, str(len(read_resumes(self.health))))


def read_attempts(health: Path) -> list[dict[str, Any]]:
    """Every recorded attempt of the job, oldest first (empty when none ran a step)."""
    return _read(health / ATTEMPTS)


def read_resumes(health: Path) -> list[dict[str, Any]]:
    """Every resume of the job, oldest first."""
    return _read(health / RESUMES)


def _append(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
