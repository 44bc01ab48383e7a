"""What the launcher hands every worker: one plain value, so it pickles across spawn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training.engine.tracker import TrackerFactory
from training.engine.worker_start import LaunchContext


@dataclass(frozen=True)
class TrainJob:
    config: dict[str, Any]  # Config.model_dump(): validated again in the worker
    shard_dir: str
    job_dir: str  # JobDir: checkpoints, journal, drill records
    model_dir: str  # where the launcher consolidates the trained model
    tracking: TrackerFactory | None = None  # rank 0's tracker; None: tracking off
    # GRADLINE_FAULT items for drills and tests (training.engine.faults); None: the
    # launcher reads them from the environment.
    faults: str | None = None
    # The control store (training.engine.control): set by the launcher.
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    # The launcher's environment and output, for workers forked from a server that
    # started earlier (training.engine.worker_start): set by the launcher.
    launch: LaunchContext | None = None
