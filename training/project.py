"""The fixed layout of a gradline project, relative to its root: its paths, its config,
its tracking store.

dvc.yaml names the same paths in its stages' commands; tests check the two agree.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config import Config, load_config
from training.engine.jobdir import JobDir
from training.errors import ProjectError
from training.roots import project_root_at_or_above


def default_tracking_uri(root: Path) -> str:
    """MLFLOW_TRACKING_URI if set, else the project's SQLite store (always absolute)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(root / 'mlflow' / 'mlflow.db').resolve()}"


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
    def profile(self) -> Path:
        """The data version's profile (training.data.profile), for drift checks."""
        return self.root / "data" / "profile.json"

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
        return default_tracking_uri(self.root)

    def config(self, overrides: list[str] | tuple[str, ...] = ()) -> Config:
        """params.yaml plus overrides, validated (training.config.load_config)."""
        return load_config(self.params, overrides)

    def read_train_result(self) -> dict[str, Any]:
        return read_train_result(self.train_result)

    def job(self, key: str) -> JobDir:
        return JobDir(self.checkpoints / key)


def read_train_result(result: Path) -> dict[str, Any]:
    """What the train stage recorded in result.json: the run, the model, the data."""
    if not result.is_file():
        raise ProjectError(f"{result} not found; run the train stage first (dvc repro train)")
    return json.loads(result.read_text())


def find_project_root(start: Path | None = None) -> Path:
    """The nearest folder at or above `start` that holds both params.yaml and dvc.yaml."""
    here = (start or Path.cwd()).resolve()
    root = project_root_at_or_above(here)
    if root is not None:
        return root
    raise ProjectError(
        f"no gradline project at or above {here}: expected params.yaml and dvc.yaml. "
        "Run gradline from the root of a gradline checkout."
    )
