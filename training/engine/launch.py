"""Start this node's workers under torch.distributed.elastic, watch for preemption,
explain failures.

Every node runs the same launcher (one agent per node, as torchrun does): the c10d
rendezvous on `runtime.rdzv_endpoint` gathers `runtime.nnodes` (N, or MIN:MAX) agents of
`runtime.procs_per_node` workers each. The elastic agents own starting, watching and
restarting workers: when a worker or a node dies, the surviving agents restart theirs (up
to runtime.max_restarts), with fewer nodes when MIN allows, and they resume from the latest
checkpoint. SIGTERM to a launcher (a preemption notice) is not forwarded as a kill: it
becomes a stop request in the control store that every rank sees at its next control
step, so they checkpoint together and exit; the job then ends with PREEMPTED_EXIT_CODE.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from training.config import Config, RuntimeConfig
from training.engine.consolidate import consolidate_model
from training.engine.control import Control
from training.engine.faults import ENV as FAULT_ENV
from training.engine.health import describe, latest_failures
from training.engine.job import TrainJob
from training.engine.jobdir import JobDir
from training.engine.worker import worker_main
from training.errors import (
    CRASH_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    GradlineError,
)

log = logging.getLogger("gradline.launch")


class TrainingFailed(GradlineError):
    """Workers failed past the restart budget; the message names the rank(s).
    Running the job again resumes it from its latest checkpoint."""

    exit_code = CRASH_EXIT_CODE
    retryable = True


class TrainingCannotContinue(TrainingFailed):
    """Workers failed for a reason no restart gets past (a full disk, bad input): the
    message names it; fix it, then run again to resume."""

    exit_code = USER_ERROR_EXIT_CODE
    retryable = False


class Preempted(GradlineError):
    exit_code = PREEMPTED_EXIT_CODE
    retryable = True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def open_control(runtime: RuntimeConfig) -> Control:
    """The job's control store on the rendezvous endpoint; a one-node job without an
    endpoint gets a private one on loopback."""
    endpoint = runtime.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    job_id = runtime.rdzv_id or f"gradline-{uuid.uuid4().hex[:8]}"
    return Control.open(endpoint, job_id, runtime.rdzv_join_timeout_s)


@contextlib.contextmanager
def _stop_requests_go_to_the_store(control: Control) -> Iterator[None]:
    def on_term(signum, _frame) -> None:
        try:
            control.request_stop()
        except (RuntimeError, OSError) as exc:  # the store's node is gone: so is the job
            log.warning("stop request not delivered to %s: %s", control.endpoint, exc)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _failure(exc: Exception, control: Control, attempts: int, ranks: int) -> TrainingFailed:
    """What failed, from the ranks' failure records and heartbeats; retryable unless the
    root cause is one no restart gets past."""
    lines = [f"training failed after {attempts} attempt(s):"]
    try:
        recorded, beats = latest_failures(control.failures()), control.beats(ranks)
    except (RuntimeError, OSError) as store_error:  # the store's host is gone with its node
        recorded, beats = [], []
        lines.append(f"  (the control store at {control.endpoint} is gone: {store_error})")
    for n, record in enumerate(recorded):
        cause = "root cause" if n == 0 else "then"
        lines.append(f"  {cause}: rank {record['rank']} raised {record['error']}")
    named = {r["rank"] for r in recorded}
    for rank, failure in sorted(getattr(exc, "failures", {}).items()):
        if rank not in named:
            lines.append(f"  rank {rank} exited with code {failure.exitcode}")
    if hang := describe(beats):
        lines.append(f"  progress: {hang}")
    if recorded and not recorded[0].get("retryable", True):
        lines.append("  a retry would fail the same way: fix the cause above, then run again")
        return TrainingCannotContinue("\n".join(lines))
    lines.append("  the latest checkpoint is kept; run again to resume from it")
    return TrainingFailed("\n".join(lines))


def _launch_config(runtime: RuntimeConfig, control: Control, max_restarts: int) -> LaunchConfig:
    min_nodes, max_nodes = runtime.node_range
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=runtime.procs_per_node,
        run_id=control.job_id,
        rdzv_backend="c10d",
        rdzv_endpoint=control.endpoint,
        rdzv_configs={
            # Whole seconds: the rendezvous parses its timeouts as integers.
            "join_timeout": round(runtime.rdzv_join_timeout_s),
            "last_call_timeout": round(runtime.rdzv_last_call_s),
        },
        max_restarts=max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
        # SIGTERM is ours (a graceful stop request), not the agent's (kill the workers).
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",
        local_addr=runtime.local_addr or None,
    )


def launch_workers(
    job: TrainJob, procs_per_node: int, max_restarts: int, control: Control | None = None
) -> dict[str, Any] | None:
    """Run `worker_main(job)` on this node's `procs_per_node` ranks. On the node that ran
    rank 0, consolidate the trained model into `job.model_dir` from the final checkpoint
    and return rank 0's result; on the other nodes return None. Faults for drills come
    with the job, or else from GRADLINE_FAULT (read here, once, for every worker)."""
    cfg = Config.model_validate(job.config)
    runtime = cfg.runtime.model_copy(update={"procs_per_node": procs_per_node})
    os.environ.setdefault("OMP_NUM_THREADS", str(runtime.threads_per_worker))
    # Each rendezvous round gets a fresh store for the workers, served by rank 0: with
    # the agents' shared store (torch's default), an agent that stays rank 0 when a node
    # joins later never publishes the new round's store address and the newcomer waits
    # for it until its timeout; a fresh store also keeps a restarted rank from reading
    # a dead peer's address left by the previous attempt.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    JobDir(Path(job.job_dir)).path.mkdir(parents=True, exist_ok=True)
    control = control or open_control(runtime)
    faults = job.faults if job.faults is not None else os.environ.get(FAULT_ENV, "")
    job = dataclasses.replace(
        job, rdzv_endpoint=control.endpoint, rdzv_id=control.job_id, faults=faults
    )
    ranks = runtime.max_world_size
    with _stop_requests_go_to_the_store(control):
        try:
            launch = elastic_launch(_launch_config(runtime, control, max_restarts), worker_main)
            results = launch(job)
        except ChildFailedError as exc:
            raise _failure(exc, control, max_restarts + 1, ranks) from exc
    stopped = [r for r in results.values() if r and r.get("preempted")]
    if stopped:
        raise Preempted(
            f"stopped on request at step {stopped[0]['step']}; checkpoint saved in "
            f"{job.job_dir}. Run the same job again to resume"
        )
    if 0 not in results:  # rank 0 ran on another node, which records the model
        return None
    result = results[0]
    job_dir, model_dir = Path(job.job_dir), Path(job.model_dir)
    consolidate_model(cfg, Path(job.shard_dir), job_dir, model_dir, result["step"])
    return result
