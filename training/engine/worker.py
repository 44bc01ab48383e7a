"""The entry point of each worker process that torch.distributed.elastic starts.

It builds the worker's place in the job (Topology) from elastic's environment, joins the
process group, and runs the loop (training.engine.loop). Everything a process needs
beyond that is here: dying with its agent, determinism, a bounded teardown after a
failure, and the failure record that names the root cause.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from training.atomic import pid_alive
from training.config import Config
from training.engine.control import Control
from training.engine.health import record_failure
from training.engine.job import TrainJob
from training.engine.jobdir import JobDir
from training.engine.loop import train
from training.engine.signing import secret_from_environment
from training.engine.topology import Topology, process_group
from training.engine.tracker import make_tracker
from training.engine.worker_start import adopt, launcher_pid
from training.errors import GradlineError


def worker_main(job: TrainJob) -> dict[str, Any] | None:
    """What torch elastic starts in each worker. A failure ends the process with exit
    code 1 once `@record` has written it for the agent: raised on, it would also reach
    torch's process wrapper, which pickles the traceback into a /tmp file that nothing
    removes (one per failed worker)."""
    try:
        return _recorded_worker(job)
    except Exception:
        raise SystemExit(1) from None


@record  # a worker's exception reaches the launcher's error report
def _recorded_worker(job: TrainJob) -> dict[str, Any] | None:
    adopt(job.launch)  # the launcher's environment and output (a forked worker has not)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = Config.model_validate(job.config)
    topo = Topology.from_env(cfg.runtime.backend)
    # The mesh for the ranks actually started (the launcher's world size is the truth).
    topo = topo.with_shape(cfg.parallel.degrees(topo.world_size))
    job_dir = JobDir(Path(job.job_dir))
    # Rank 0's tracking helper first, while this process has one thread and no
    # communication or CUDA state: then it can be a fork of this one (tracking.py).
    tracker = make_tracker(topo.is_main, job.tracking, job_dir.journal)
    _die_with_the_agent()
    # N workers share the machine's cores: cap each so they don't oversubscribe.
    torch.set_num_threads(cfg.runtime.threads_per_worker)
    if cfg.runtime.pin_cpu_cores:  # before any thread starts: threads inherit the mask
        _pin_to_cores(topo.local_rank, cfg.runtime.threads_per_worker)
    _set_determinism(cfg, topo)
    control = Control.connect(
        job.rdzv_endpoint, job.rdzv_id, cfg.runtime.collective_timeout_s, secret_from_environment()
    )
    try:
        _refuse_after_a_lasting_failure(control)
        with process_group(topo, cfg.runtime.collective_timeout_s):
            if not topo.shape.plain_data_parallel:  # shards and stages live on a mesh
                topo = topo.with_device_mesh()
            result = train(cfg, topo, job, tracker, control)
        # Rank 0's helper has been shipping the last records since training finished,
        # while the groups ended (gloo's drain): what is left to wait for, if anything.
        tracker.close()
        return result
    except BaseException as exc:
        # Name the root cause for the launcher: the first rank to fail takes its peers
        # down with it, and elastic may report a peer's error instead.
        record_failure(control, topo.rank, topo.attempt, exc)
        _exit_soon(10.0)
        raise


def _refuse_after_a_lasting_failure(control: Control) -> None:
    """An elastic restart after a failure no restart gets past (a full disk, bad input)
    ends at once, naming it, instead of training up to the same failure again."""
    lasting = [r for r in control.failures() if not r.get("retryable", True)]
    if lasting:
        raise GradlineError(
            f"not restarting: rank {lasting[0]['rank']} failed with {lasting[0]['error']}"
        )


def _die_with_the_agent() -> None:
    """Linux: end this worker when its agent dies. A node whose agent was killed must
    leave the job, not keep a rank training that no agent watches or restarts."""
    if sys.platform != "linux":
        return
    agent, parent = launcher_pid(), os.getppid()  # the agent may be PID 1 (containers)
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)  # when the parent dies
    if parent != agent:
        # Forked by the forkserver (training.engine.worker_start), which outlives the
        # agent: every worker it forked holds its liveness pipe open. Watch the agent.
        _kill_this_worker_when_gone(agent)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _kill_this_worker_when_gone(pid: int) -> None:
    """A daemon thread that SIGKILLs this process once process `pid` has exited (as
    PR_SET_PDEATHSIG would for a parent): a pidfd where Linux has one, else polling."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)  # gone already
    except (AttributeError, OSError):  # an old kernel or Python: poll instead
        pidfd = None

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the process has exited
        else:
            while pid_alive(pid):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="agent-watch", daemon=True).start()


def _exit_soon(seconds: float) -> None:
    """Bound the teardown of a failed worker: tearing down communication can block on a
    peer that is itself waiting in a collective, and a worker that never exits would
    keep the agent from restarting the job."""
    timer = threading.Timer(seconds, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


def _pin_to_cores(local_rank: int, threads: int) -> None:
    """Local rank r on cores r * threads .. (r + 1) * threads - 1 of those this process
    may use (wrapping around when ranks outnumber them); Linux only, else nothing."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    mine = {cores[(local_rank * threads + i) % len(cores)] for i in range(threads)}
    os.sched_setaffinity(0, mine)


def _set_determinism(cfg: Config, topo: Topology) -> None:
    if not cfg.train.deterministic:
        return
    if topo.device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
