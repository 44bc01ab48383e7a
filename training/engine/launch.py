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
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from training.config import Config, RuntimeConfig
from training.engine.consolidate import consolidate_model
from training.engine.control import Control, split_endpoint
from training.engine.faults import ENV as FAULT_ENV
from training.engine.health import describe, latest_failures
from training.engine.job import TrainJob
from training.engine.jobdir import JobDir
from training.engine.rendezvous_costs import skew_first_round, use_frame_names
from training.engine.signing import job_secret
from training.engine.worker import worker_main
from training.engine.worker_start import LaunchContext, start_method
from training.errors import (
    CRASH_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    GradlineError,
)
from training.tempdirs import owned_temporary_directory

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
    endpoint gets a private one on loopback. A job of several nodes without
    GRADLINE_JOB_SECRET fails here, before anything starts."""
    secret = job_secret(multi_node=runtime.node_range[1] > 1)
    endpoint = runtime.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    job_id = runtime.rdzv_id or f"gradline-{uuid.uuid4().hex[:8]}"
    return Control.open(endpoint, job_id, runtime.rdzv_join_timeout_s, secret)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def keep_workers_on_loopback(endpoint: str) -> bool:
    """A job whose rendezvous is on loopback runs on this machine alone: its workers'
    store and gloo/NCCL sockets listen on loopback too. gloo otherwise listens on the
    address the host name resolves to, reachable from the network."""
    if not is_loopback(split_endpoint(endpoint)[0]):
        return False
    if sys.platform == "linux":  # "lo" is the loopback interface's name on Linux only
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return True


@contextlib.contextmanager
def _stop_requests_go_to_the_store(control: Control) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        # Signals reach the main thread only: a caller that runs jobs on threads
        # (`gradline sweep`) owns them and asks each job's control store to stop.
        yield
        return

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


def _report_refused_records(control: Control, ranks: int) -> None:
    """Once, as the job ends: how many records in the store failed the signature check,
    by key (each worker also warned as it met them)."""
    try:
        refused = control.audit(ranks)
    except (RuntimeError, OSError) as exc:  # the store's host is gone with its node
        log.info("control records not audited: the store at %s is gone (%s)", control.endpoint, exc)
        return
    if refused:
        log.warning(
            "control plane: %d record(s) without this job's signature were ignored (%s); "
            "something that does not hold GRADLINE_JOB_SECRET wrote to the store at %s",
            sum(refused.values()),
            ", ".join(f"{key}: {count}" for key, count in sorted(refused.items())),
            control.endpoint,
        )


def _launch_config(
    runtime: RuntimeConfig, control: Control, max_restarts: int, agent_dir: str
) -> LaunchConfig:
    min_nodes, max_nodes = runtime.node_range
    # The workers' store (MASTER_ADDR) is served at the node's local_addr: the host name
    # unless given; a loopback job keeps it on loopback.
    local_addr = runtime.local_addr or None
    if local_addr is None and keep_workers_on_loopback(control.endpoint):
        local_addr = split_endpoint(control.endpoint)[0]
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
        # How soon the agent sees its workers end: a poll of each worker, cheap at 50 a second,
        # and a job's end waited 0.05 s for it on average at 0.1 s.
        monitor_interval=0.02,
        start_method=start_method(),
        # SIGTERM is ours (a graceful stop request), not the agent's (kill the workers).
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",
        local_addr=local_addr,
        # The agent's folder (each worker's error file, by attempt): torch's default is a
        # new /tmp/torchelastic_* per launch that nothing removes.
        logs_specs=DefaultLogsSpecs(log_dir=agent_dir),
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
    use_frame_names()  # the rendezvous' event names, without a source-reading stack walk
    skew_first_round(runtime.node_range[1] > 1)  # one node alone: nothing to skew against
    JobDir(Path(job.job_dir)).path.mkdir(parents=True, exist_ok=True)
    control = control or open_control(runtime)
    faults = job.faults if job.faults is not None else os.environ.get(FAULT_ENV, "")
    job = dataclasses.replace(
        job,
        rdzv_endpoint=control.endpoint,
        rdzv_id=control.job_id,
        faults=faults,
        launch=LaunchContext(),  # after every variable above is set
    )
    ranks = runtime.max_world_size
    with (
        _stop_requests_go_to_the_store(control),
        # Removed once the launch is over: a failure's error files are read by then. A
        # removal that fails must not take the place of the launch's own outcome.
        owned_temporary_directory("gradline-agent-") as agent_dir,
    ):
        try:
            config = _launch_config(runtime, control, max_restarts, agent_dir)
            results = elastic_launch(config, worker_main)(job)
        except ChildFailedError as exc:
            raise _failure(exc, control, max_restarts + 1, ranks) from exc
        finally:
            _report_refused_records(control, ranks)
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
    selected = int(result.get("selected_step", result["step"]))
    consolidate_model(cfg, Path(job.shard_dir), job_dir, model_dir, result["step"], selected)
    return result
