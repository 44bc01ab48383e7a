"""One training job from start to finish: `run_job`, the one lifecycle every caller uses.

The train stage, `gradline compare-updates` and the benchmarks all train through it:
check the model can be built for the data (bad input fails before anything exists),
open or resume the job's MLflow run (one run per job, across nodes: the first launcher
to claim it in the control store), start this node's workers, then record the outcome:
KILLED on a preemption (the next run resumes), FAILED on a crash, and on the node that
ran rank 0 the consolidated model logged as a pyfunc model, the run FINISHED and the
job folder marked complete. A job without tracking (no tracking URI) runs the same way
with no MLflow at all: the engine needs only torch and pyarrow.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.config import Config
from training.data.loader import check_batch_fits
from training.data.manifest import read_manifest
from training.data.spec import DataSpec
from training.engine.control import Control
from training.engine.embedding_sharding import check_tables_fit
from training.engine.job import TrainJob
from training.engine.launch import Preempted, launch_workers, open_control
from training.engine.tracker import TrackerFactory
from training.errors import TrackingError
from training.mlops.runs import (
    JobRun,
    check_checkpoint_location,
    mark_complete,
    open_job_run,
    open_shared_job_run,
    open_untracked_job,
    set_status,
)
from training.mlops.serving import log_pyfunc_model
from training.mlops.sync import defer_job_end, ship_if_answering
from training.mlops.tracking import (
    MlflowSink,
    helper_niceness,
    pending_records,
    redact_uri,
    tracking_reachable,
)
from training.models.registry import build_model, check_buildable

log = logging.getLogger("gradline")


@dataclass(frozen=True)
class JobRequest:
    cfg: Config
    shards: Path
    checkpoints: Path  # the checkpoint location: the job's folder is <checkpoints>/<job key>
    model_dir: Path  # where the trained model is consolidated
    root: Path | None = None  # the project (git commit, dataset source, artifacts)
    tracking_uri: str | None = None  # None: no MLflow run, nothing logged
    tags: dict[str, str] = field(default_factory=dict)  # on a fresh run, beside gradline's
    faults: str | None = None  # GRADLINE_FAULT for the workers (None: the environment's)
    log_model: bool = True  # log the trained model with the run (the registry needs it)


@dataclass(frozen=True)
class JobOutcome:
    job: JobRun
    final: dict[str, Any] | None  # rank 0's result; None on a node that did not run rank 0
    model_uri: str | None  # the logged pyfunc model
    wall_seconds: float  # from the workers' start to their end (start-up included)

    @property
    def run_id(self) -> str | None:
        return self.job.run_id


def run_job(request: JobRequest, control: Control | None = None) -> JobOutcome:
    """Train the job on this node (see the module docstring); raise TrainingFailed or
    Preempted (retryable: running it again resumes) or a ConfigError (bad input)."""
    cfg = request.cfg
    check_checkpoint_location(request.checkpoints)
    manifest = read_manifest(request.shards)
    # A model that cannot be built for this data fails here, as bad input (exit 2),
    # before a run is created or a worker starts.
    data = DataSpec.from_manifest(manifest)
    check_buildable(cfg.model, cfg.task.type, data, cfg.layout())
    if cfg.parallel.embedding_budget_mb:  # embedding tables over a rank's budget: here too
        check_tables_fit(build_model(cfg.model, cfg.task.type, data), cfg, cfg.layout())
    check_batch_fits(manifest["splits"]["train"]["rows"], cfg.train.batch_size)
    if request.tracking_uri is not None:
        helper_niceness()  # a bad GRADLINE_TRACKER_NICE: here, not in rank 0 at each restart
    control = control or open_control(cfg.runtime)
    job = _open(request, control, manifest["data_version"])
    log.info(
        "train: MLflow run %s (%s), %d workers on this node",
        job.run_id or "(tracking off)",
        "resumed" if job.resumed else "new",
        cfg.runtime.procs_per_node,
    )
    tracking: TrackerFactory | None = None
    if job.run_id is not None:
        tracking = MlflowSink(request.tracking_uri, job.run_id)
    train_job = TrainJob(
        config=cfg.model_dump(),
        shard_dir=str(request.shards),
        job_dir=str(job.job_dir.path),
        model_dir=str(request.model_dir),
        tracking=tracking,
        faults=request.faults,
    )
    started = time.perf_counter()
    try:
        final = launch_workers(
            train_job, cfg.runtime.procs_per_node, cfg.runtime.max_restarts, control
        )
    except BaseException as exc:
        # A preemption leaves the run resumable: the next run of the job continues it.
        _set_status(request, job, "KILLED" if isinstance(exc, Preempted) else "FAILED")
        raise
    wall = time.perf_counter() - started
    if final is None:  # rank 0 ran on another node, which records the model
        return JobOutcome(job, None, None, wall)
    model_uri = None
    if job.run_id is not None and _tracking_down(request, job):
        # The model and checkpoints are on disk: the job is done. What MLflow should hold
        # waits in the journal for registration (orchestrate.tracking_wait_s) or sync.
        model_dir = request.model_dir if request.log_model else None
        defer_job_end(job.job_dir, model_dir, cfg.generation())
        mark_complete(job)
        return JobOutcome(job, final, None, wall)
    if request.log_model and job.run_id is not None:
        model_uri = log_pyfunc_model(
            request.tracking_uri, job.run_id, request.model_dir, cfg.generation()
        )
    _set_status(request, job, "FINISHED")
    mark_complete(job)
    return JobOutcome(job, final, model_uri, wall)


def _tracking_down(request: JobRequest, job: JobRun) -> bool:
    """Whether the job's end must wait for the tracking server: its helper left records
    behind that cannot ship now, or the server does not answer now (an MLflow call would
    retry for minutes)."""
    if pending_records(job.job_dir.journal):
        # Left by a helper that met an outage, or that a busy host kept behind: shipped
        # here, at the job's own priority, if the server answers. Training is done: a
        # failure to ship leaves them to registration or `gradline sync`, as an outage.
        from mlflow.exceptions import MlflowException

        try:
            return not ship_if_answering(request.tracking_uri, job.job_dir)
        except (MlflowException, TrackingError, OSError) as exc:
            log.warning(
                "train: shipping the journal's records to %s failed (%s: %s); they wait in "
                "%s for registration or `gradline sync`",
                redact_uri(request.tracking_uri),
                type(exc).__name__,
                exc,
                job.job_dir.journal,
            )
            return True
    if not tracking_reachable(request.tracking_uri):
        log.warning(
            "train: the MLflow tracking server at %s does not answer; the model, result and "
            "checkpoints are written, and run %s's model and status wait in %s until it is "
            "back",
            redact_uri(request.tracking_uri),
            job.run_id,
            job.job_dir.journal,
        )
        return True
    return False


def _open(request: JobRequest, control: Control, data_version: str) -> JobRun:
    cfg, checkpoints = request.cfg, request.checkpoints
    if request.tracking_uri is None:
        return open_untracked_job(cfg, data_version, checkpoints)

    def open_run() -> JobRun:
        root = request.root or Path.cwd()
        uri, tags = request.tracking_uri, request.tags
        return open_job_run(root, cfg, uri, data_version, checkpoints, tags=tags)

    return open_shared_job_run(control, checkpoints, request.tracking_uri, open_run)


def _set_status(request: JobRequest, job: JobRun, status: str) -> None:
    if job.run_id is not None:
        set_status(request.tracking_uri, job.run_id, status)
