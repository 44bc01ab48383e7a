"""Experiment tracking. One MLflow run per job; rank 0 writes to it through a Tracker.

mlflow is imported inside functions only, so the engine runs where mlflow is absent
(tracking off). Non-zero ranks get a NullTracker, so the loop never asks "am I rank 0?".
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TAG_DATA_VERSION = "gradline.data_version"
TAG_FLOW_RUN = "gradline.prefect_flow_run_id"
TAG_JOB_KEY = "gradline.job_key"
TAG_TEST_DIGEST = "gradline.test_digest"
TAG_GIT_COMMIT = "mlflow.source.git.commit"
FLOW_RUN_ENV = "GRADLINE_PREFECT_FLOW_RUN_ID"


def default_tracking_uri(root: Path) -> str:
    """MLFLOW_TRACKING_URI if set, else the project's SQLite store (always absolute)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{(root / 'mlflow' / 'mlflow.db').resolve()}"


def default_artifact_location(root: Path, tracking_uri: str) -> str | None:
    """Artifacts beside the local store; a remote server picks its own location."""
    if tracking_uri.startswith("sqlite:///") and "MLFLOW_TRACKING_URI" not in os.environ:
        return (root / "mlflow" / "artifacts").resolve().as_uri()
    return None


def git_commit(root: Path) -> tuple[str, bool] | None:
    """(commit, dirty) of the project checkout, or None outside git."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit, bool(status.strip())


def client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def ensure_experiment(tracking_uri: str, name: str, artifact_location: str | None) -> str:
    mlflow_client = client(tracking_uri)
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    return mlflow_client.create_experiment(name, artifact_location=artifact_location)


class NullTracker:
    """What every rank but 0 gets: accepts everything, records nothing."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        pass

    def flush(self) -> None:
        pass


class MlflowTracker:
    """Rank 0's writer into an existing run. Metrics are buffered and sent in batches.

    After a restart, steps the run already holds are recomputed identically; they are
    not sent again, so each metric has one value per step.
    """

    def __init__(self, tracking_uri: str, run_id: str, flush_every: int = 200) -> None:
        self._client = client(tracking_uri)
        self.run_id = run_id
        self._flush_every = flush_every
        self._pending: list[Any] = []
        self._logged_until: dict[str, int] = {}

    def _last_logged_step(self, key: str) -> int:
        if key not in self._logged_until:
            history = self._client.get_metric_history(self.run_id, key)
            self._logged_until[key] = max((m.step for m in history), default=-1)
        return self._logged_until[key]

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = _now_ms()
        for key, value in metrics.items():
            if step <= self._last_logged_step(key):
                continue
            self._pending.append(Metric(key, float(value), now, step))
            self._logged_until[key] = step
        if len(self._pending) >= self._flush_every:
            self.flush()

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, str(path), artifact_path)

    def flush(self) -> None:
        # MLflow accepts at most 1000 metrics per batch.
        while self._pending:
            chunk, self._pending = self._pending[:1000], self._pending[1000:]
            self._client.log_batch(self.run_id, metrics=chunk)


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


def make_tracker(is_main: bool, tracking_uri: str | None, run_id: str | None):
    if is_main and tracking_uri and run_id:
        return MlflowTracker(tracking_uri, run_id)
    return NullTracker()
