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
    """What every rank but 0 gets (and rank 0 with tracking off): records nothing."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_checkpoint(self, path: Path, step: int, metrics: dict[str, float]) -> None:
        pass

    def set_tag(self, key: str, value: str) -> None:
        pass

    def close(self) -> None:
        pass


class MlflowTracker:
    """Rank 0's writer into an existing run, in a helper process.

    MLflow's SQLite store costs about 0.3 ms of Python per metric. In a thread that work
    would hold the GIL for milliseconds at a time and stall the training loop; in a
    low-priority process it only uses spare CPU. The loop puts items on a queue and
    never waits. After a restart, steps the run already holds are recomputed identically
    and not sent again: one value per metric and step.
    """

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.run_id = run_id
        self._queue = context.Queue()
        self._process = context.Process(
            target=_tracking_process,
            args=(tracking_uri, run_id, self._queue, os.getpid()),
            name="gradline-tracker",
            daemon=True,
        )
        self._process.start()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._queue.put(("metrics", dict(metrics), step, _now_ms()))

    def set_tag(self, key: str, value: str) -> None:
        self._queue.put(("tag", key, value))

    def log_checkpoint(self, path: Path, step: int, metrics: dict[str, float]) -> None:
        """Record a checkpoint and the metrics of its step under checkpoints/step-N/.

        Called from the checkpoint writer once the file is on disk. A hard link keeps the
        file for the helper even if a later save prunes it first.
        """
        pending = path.with_name(f".mlflow-{path.name}")
        pending.unlink(missing_ok=True)
        os.link(path, pending)
        self._queue.put(("checkpoint", str(pending), path.name, step, dict(metrics)))

    def close(self, timeout_s: float = 600.0) -> None:
        """Wait until everything queued is in the tracking store."""
        from training.errors import TrackingError

        self._queue.put(("stop",))
        self._process.join(timeout_s)
        if self._process.exitcode != 0:
            raise TrackingError(
                f"the MLflow tracking helper failed (exit code {self._process.exitcode}); "
                "see its error above. Training results are on disk; the run may lack metrics"
            )


def _tracking_process(tracking_uri: str, run_id: str, queue, parent_pid: int) -> None:
    import queue as queues
    import shutil
    import tempfile

    from mlflow.entities import Metric, RunTag

    os.nice(10)  # training first: this process uses what the ranks leave
    mlflow_client = client(tracking_uri)
    logged_until: dict[str, int] = {}

    def last_logged(key: str) -> int:
        if key not in logged_until:
            history = mlflow_client.get_metric_history(run_id, key)
            logged_until[key] = max((m.step for m in history), default=-1)
        return logged_until[key]

    stopping = False
    while not stopping:
        try:
            items = [queue.get(timeout=1.0)]
        except queues.Empty:
            if os.getppid() != parent_pid:  # rank 0 is gone (killed): so are we
                return
            continue
        while True:
            try:
                items.append(queue.get_nowait())
            except queues.Empty:
                break
        metrics, tags = [], []
        for item in items:
            kind = item[0]
            if kind == "stop":
                stopping = True
            elif kind == "tag":
                tags.append(RunTag(item[1], item[2]))
            elif kind == "metrics":
                _, values, step, stamp = item
                for key, value in values.items():
                    if step > last_logged(key):
                        metrics.append(Metric(key, float(value), stamp, step))
                        logged_until[key] = step
            elif kind == "checkpoint":
                _, pending, name, step, values = item
                folder = f"checkpoints/step-{step:08d}"
                with tempfile.TemporaryDirectory() as tmp:
                    shutil.move(pending, Path(tmp) / name)
                    mlflow_client.log_artifact(run_id, str(Path(tmp) / name), folder)
                mlflow_client.log_dict(run_id, {"step": step, **values}, f"{folder}/metrics.json")
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit
            mlflow_client.log_batch(run_id, metrics=metrics[start : start + 1000])
        if tags:
            mlflow_client.log_batch(run_id, tags=tags)


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
