"""Start N workers under torch.distributed.elastic, watch for preemption, explain failures.

The elastic agent owns starting, watching and restarting workers: when one dies, it
restarts all of them (up to train.max_restarts) and they resume from the latest
checkpoint. SIGTERM to this process (a preemption) is not forwarded as a kill: it
becomes a stop request that every rank sees at its next control step, so they
checkpoint together and exit; the job then ends with PREEMPTED_EXIT_CODE.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from training.config import Config
from training.engine.consolidate import consolidate_model
from training.engine.health import clear, describe, read_beats, read_failures
from training.engine.loop import TrainJob, worker_main
from training.errors import CRASH_EXIT_CODE, PREEMPTED_EXIT_CODE, GradlineError
from training.project import JobDir


class TrainingFailed(GradlineError):
    """Workers failed past the restart budget; the message names the rank(s).
    Running the job again resumes it from its latest checkpoint."""

    exit_code = CRASH_EXIT_CODE
    retryable = True


class Preempted(GradlineError):
    exit_code = PREEMPTED_EXIT_CODE
    retryable = True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _stop_requests_become_files(job_dir: JobDir) -> Iterator[None]:
    request = job_dir.preempt_request
    request.unlink(missing_ok=True)

    def on_term(signum, _frame) -> None:
        request.touch()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        request.unlink(missing_ok=True)


def _explain(exc: Exception, health_dir: Path, attempts: int) -> str:
    lines = [f"training failed after {attempts} attempt(s):"]
    recorded = read_failures(health_dir)
    for n, record in enumerate(recorded):
        cause = "root cause" if n == 0 else "then"
        lines.append(f"  {cause}: rank {record['rank']} raised {record['error']}")
    named = {r["rank"] for r in recorded}
    for rank, failure in sorted(getattr(exc, "failures", {}).items()):
        if rank not in named:
            lines.append(f"  rank {rank} exited with code {failure.exitcode}")
    if hang := describe(read_beats(health_dir)):
        lines.append(f"  progress: {hang}")
    lines.append("  the latest checkpoint is kept; run again to resume from it")
    return "\n".join(lines)


def launch_workers(job: TrainJob, world_size: int, max_restarts: int) -> dict[str, Any]:
    """Run `worker_main(job)` on `world_size` local ranks, then consolidate the trained
    model into `job.model_dir` from the final checkpoint; return rank 0's result."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    threads = str(job.config["runtime"]["threads_per_worker"])
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    job_dir = JobDir(Path(job.job_dir))
    job_dir.path.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"gradline-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
        # SIGTERM is ours (a graceful stop request), not the agent's (kill the workers).
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",
    )
    health_dir = job_dir.health
    clear(health_dir)
    with _stop_requests_become_files(job_dir):
        try:
            results = elastic_launch(config, worker_main)(job)
        except ChildFailedError as exc:
            raise TrainingFailed(_explain(exc, health_dir, max_restarts + 1)) from exc
    result = results[0]
    if result.get("preempted"):
        raise Preempted(
            f"stopped on request at step {result['step']}; checkpoint saved in "
            f"{job_dir.path}. Run the same job again to resume"
        )
    cfg = Config.model_validate(job.config)
    consolidate_model(cfg, Path(job.shard_dir), job_dir.path, Path(job.model_dir), result["step"])
    return result
