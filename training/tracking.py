"""Experiment tracking. One MLflow run per job; rank 0 writes to it through a Tracker.

mlflow is imported inside functions only, so the engine runs where mlflow is absent
(tracking off). Non-zero ranks get a NullTracker, so the loop never asks "am I rank 0?".
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

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

    def log_checkpoint(self, path: Path, step: int, metrics: dict[str, float]) -> None:
        pass

    def set_tag(self, key: str, value: str) -> None:
        pass

    def close(self) -> None:
        pass


class MlflowTracker:
    """Rank 0's writer into an existing run, off the training thread.

    The loop only puts items on a queue; a daemon thread sends them in batches, so a
    slow tracking store never stalls a step. After a restart, steps the run already
    holds are recomputed identically and not sent again: one value per metric and step.
    """

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        import queue
        import threading

        self._client = client(tracking_uri)
        self.run_id = run_id
        self._queue: queue.Queue = queue.Queue()
        self._logged_until: dict[str, int] = {}
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._drain, name="mlflow-tracker", daemon=True)
        self._thread.start()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._queue.put(("metrics", dict(metrics), step, _now_ms()))

    def set_tag(self, key: str, value: str) -> None:
        self._queue.put(("tag", key, value))

    def log_checkpoint(self, path: Path, step: int, metrics: dict[str, float]) -> None:
        """Called from the checkpoint writer's thread once the file is on disk: record the
        checkpoint and the metrics of its step under checkpoints/step-NNNNNNNN/."""
        folder = f"checkpoints/step-{step:08d}"
        self._client.log_artifact(self.run_id, str(path), folder)
        self._client.log_dict(self.run_id, {"step": step, **metrics}, f"{folder}/metrics.json")

    def close(self) -> None:
        self._queue.put(("stop",))
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _last_logged_step(self, key: str) -> int:
        if key not in self._logged_until:
            history = self._client.get_metric_history(self.run_id, key)
            self._logged_until[key] = max((m.step for m in history), default=-1)
        return self._logged_until[key]

    def _drain(self) -> None:
        from mlflow.entities import Metric, RunTag

        stopping = False
        while not stopping:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            metrics, tags = [], []
            for item in items:
                if item[0] == "stop":
                    stopping = True
                elif item[0] == "tag":
                    tags.append(RunTag(item[1], item[2]))
                else:
                    _, values, step, stamp = item
                    for key, value in values.items():
                        if step > self._last_logged_step(key):
                            metrics.append(Metric(key, float(value), stamp, step))
                            self._logged_until[key] = step
            try:
                for start in range(0, max(len(metrics), 1), 1000):  # MLflow's batch limit
                    chunk = metrics[start : start + 1000]
                    if chunk or (tags and start == 0):
                        self._client.log_batch(
                            self.run_id, metrics=chunk, tags=tags if start == 0 else []
                        )
            except Exception as exc:  # keep training; report at close
                log.error("MLflow logging failed: %s", exc)
                self._error = self._error or exc


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


def make_tracker(is_main: bool, tracking_uri: str | None, run_id: str | None):
    if is_main and tracking_uri and run_id:
        return MlflowTracker(tracking_uri, run_id)
    return NullTracker()


def system_metrics() -> dict[str, float]:
    """CPU and memory of this machine and process; GPU memory when CUDA is in use."""
    import psutil
    import torch

    process = psutil.Process()
    metrics = {
        "system_cpu_percent": psutil.cpu_percent(interval=None),
        "system_memory_percent": psutil.virtual_memory().percent,
        "process_rss_gb": process.memory_info().rss / 2**30,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        metrics["gpu_memory_allocated_gb"] = torch.cuda.memory_allocated() / 2**30
        metrics["gpu_max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return metrics
