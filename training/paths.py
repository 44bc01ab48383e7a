"""The fixed layout of a gradline project, relative to its root.

dvc.yaml names the same paths in its stages' commands; tests check the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from training.errors import ProjectError


@dataclass(frozen=True)
class ProjectPaths:
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
