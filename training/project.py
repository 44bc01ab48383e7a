"""The fixed layout of a gradline project, relative to its root.

dvc.yaml names the same paths in its stages' commands; tests check the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from training.errors import ProjectError


@dataclass(frozen=True)
class Project:
    root: Path

    @property
    def params(self) -> Path:
        return self.root / "params.yaml"

    @property
    def dvc_yaml(self) -> Path:
        return self.root / "dvc.yaml"

    @property
    def dvc_lock(self) -> Path:
        return self.root / "dvc.lock"

    @property
    def raw(self) -> Path:
        return self.root / "data" / "raw"

    @property
    def quarantine(self) -> Path:
        return self.root / "data" / "quarantine"

    @property
    def ingest_report(self) -> Path:
        return self.root / "data" / "ingest.json"

    @property
    def shards(self) -> Path:
        return self.root / "data" / "shards"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def train_result(self) -> Path:
        return self.root / "result.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def mlflow_dir(self) -> Path:
        return self.root / "mlflow"

    @property
    def tracking_uri(self) -> str:
        from training.tracking import default_tracking_uri

        return default_tracking_uri(self.root)

    def config(self, overrides: list[str] | tuple[str, ...] = ()):
        """params.yaml plus overrides, validated (training.config.load_config)."""
        from training.config import load_config

        return load_config(self.params, overrides)

    def job(self, key: str) -> JobDir:
        return JobDir(self.checkpoints / key)


@dataclass(frozen=True)
class JobDir:
    """Every file of one training job, in the checkpoint location that every node sees:
    its checkpoints, rank 0's tracking journal, the run id, drill records (health/).
    Stop requests and heartbeats do not go through files (training.engine.control)."""

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


def find_project_root(start: Path | None = None) -> Path:
    """The nearest folder at or above `start` that holds both params.yaml and dvc.yaml."""
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "params.yaml").is_file() and (candidate / "dvc.yaml").is_file():
            return candidate
    raise ProjectError(
        f"no gradline project at or above {here}: expected params.yaml and dvc.yaml. "
        "Run gradline from the root of a gradline checkout."
    )
