"""The MLflow run of a training job: created (or resumed) before workers start.

A job is identified by its key (training.config.jobspec): a hash of what computes the
model and the data version; how it runs (runtime, parallel) is not part of it. A job
that stopped before finishing (worker failure past the restart budget, preemption, a
retried task) has a job folder holding its run id; running it again, on any world
size, continues the same run from the latest checkpoint instead of starting a second
one.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.atomic import write_json
from training.config import Config, jobspec
from training.engine.jobdir import JobDir
from training.errors import ConfigError, GradlineError
from training.mlops.hardware import TAG_HARDWARE, describe_hardware
from training.mlops.sync import ship_job
from training.mlops.tracking import (
    FLOW_RUN_ENV,
    TAG_DATA_VERSION,
    TAG_FLOW_RUN,
    TAG_GIT_COMMIT,
    TAG_GIT_DIRTY,
    TAG_JOB_KEY,
    TAG_TEST_DIGEST,
    client,
    default_artifact_location,
    ensure_experiment,
    git_commit,
    pending_records,
    ship_records,
)


@dataclass(frozen=True)
class JobRun:
    run_id: str | None  # None: a job without tracking
    job_dir: JobDir
    resumed: bool


def open_job_run(
    root: Path,
    cfg: Config,
    tracking_uri: str,
    data_version: str,
    checkpoints: Path,
    tags: dict[str, str] | None = None,
) -> JobRun:
    """Resume the unfinished run of this job, or start a fresh one; `tags` go on a fresh
    run beside gradline's own (e.g. `mlflow.parentRunId` for a comparison's child)."""
    key = jobspec.job_key(cfg, data_version)
    job_dir = JobDir(checkpoints / key)
    mlflow_client = client(tracking_uri)
    if job_dir.run_file.is_file() and not job_dir.complete_marker.exists():
        run_id = json.loads(job_dir.run_file.read_text())["run_id"]
        mlflow_client.update_run(run_id, status="RUNNING")
        log_runtime(mlflow_client, run_id, cfg)
        return JobRun(run_id, job_dir, resumed=True)
    if job_dir.run_file.is_file() and pending_records(job_dir.journal):
        # A finished job whose records waited for the server: ship them before its
        # folder (and journal) is cleared for the new run.
        ship_job(tracking_uri, job_dir, deadline=time.monotonic())
    _start_afresh(job_dir)
    tags = {**(tags or {}), TAG_JOB_KEY: key}
    run_id = new_run(root, cfg, tracking_uri, data_version, tags)
    log_params(mlflow_client, run_id, jobspec.mlflow_params(cfg))
    write_json(job_dir.run_file, {"run_id": run_id})
    return JobRun(run_id, job_dir, resumed=False)


def new_run(
    root: Path, cfg: Config, tracking_uri: str, data_version: str, tags: dict[str, str]
) -> str:
    """A new run in the config's experiment with gradline's lineage tags (data version,
    git commit, flow run, user) beside `tags`, what describes the run, and the training
    data as its dataset input. Params are the caller's."""
    experiment_id = ensure_experiment(
        tracking_uri, cfg.registry.experiment, default_artifact_location(root, tracking_uri)
    )
    tags = {**tags, TAG_DATA_VERSION: data_version}
    if commit := git_commit(root):
        tags[TAG_GIT_COMMIT] = commit[0]
        tags[TAG_GIT_DIRTY] = str(commit[1]).lower()
    if flow_run := os.environ.get(FLOW_RUN_ENV):
        tags[TAG_FLOW_RUN] = flow_run
    # Who started it (the MLflow UI's "User"): the tracking server's user, else the login.
    tags["mlflow.user"] = os.environ.get("MLFLOW_TRACKING_USERNAME") or getpass.getuser()
    mlflow_client = client(tracking_uri)
    run_id = mlflow_client.create_run(experiment_id, tags=tags).info.run_id
    log_runtime(mlflow_client, run_id, cfg)
    log_dataset(mlflow_client, run_id, cfg, root, data_version)
    return run_id


def open_untracked_job(cfg: Config, data_version: str, checkpoints: Path) -> JobRun:
    """The job's folder without an MLflow run (benchmarks, a machine without mlflow):
    an unfinished job resumes from its checkpoints, a finished one starts again."""
    job_dir = JobDir(checkpoints / jobspec.job_key(cfg, data_version))
    if job_dir.path.is_dir() and not job_dir.complete_marker.exists():
        return JobRun(None, job_dir, resumed=True)
    _start_afresh(job_dir)
    return JobRun(None, job_dir, resumed=False)


def _start_afresh(job_dir: JobDir) -> None:
    if job_dir.path.exists():  # a finished job asked to run again starts from scratch
        shutil.rmtree(job_dir.path)
    job_dir.path.mkdir(parents=True)


def log_params(mlflow_client, run_id: str, params: dict[str, str]) -> None:
    """The params that define the run (MLflow takes at most 100 a call)."""
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), 100):
        mlflow_client.log_batch(run_id, params=items[start : start + 100])


def log_runtime(mlflow_client, run_id: str, cfg: Config, stage: str | None = None) -> None:
    """What describes this attempt (how it runs, where it records, how it is evaluated)
    as `gradline.<key>` tags: they may change between attempts of one job, so each
    attempt (or, with `stage`, each evaluation) sets them again (training.config.jobspec)."""
    from mlflow.entities import RunTag

    tags = [RunTag(k, v) for k, v in jobspec.run_tags(cfg, stage).items()]
    if stage is None:  # a training attempt: where it runs (the model card's hardware)
        tags.append(RunTag(TAG_HARDWARE, describe_hardware()))
    mlflow_client.log_batch(run_id, tags=tags)


def log_dataset(mlflow_client, run_id: str, cfg: Config, root: Path, data_version: str) -> None:
    """Record the training data as a dataset input: the UI shows which data trained the
    model, with the DVC md5 as its digest (`dvc checkout` of that version restores it)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    with warnings.catch_warnings():  # two registered classes claim local paths; either fits
        warnings.simplefilter("ignore", UserWarning)
        source = resolve_dataset_source((root / "data" / "raw").resolve().as_uri())
    dataset = MetaDataset(source=source, name=f"{cfg.data.source}-raw", digest=data_version)
    mlflow_client.log_inputs(
        run_id,
        datasets=[
            DatasetInput(
                dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", "training")]
            )
        ],
    )


# The evaluation's details beside its metrics (intervals, per-class figures, model size):
# what the model card reads back from the run (training.mlops.model_card).
DETAILS_ARTIFACT = "evaluation/details.json"


def evaluation_records(
    cfg: Config,
    step: int,
    metrics: dict[str, float],
    test_digest: str,
    details: dict | None = None,
) -> list[dict]:
    """The evaluate stage's results on the job's run, as journal records: the test
    metrics at the final step (a new evaluation replaces them), the test split's digest
    (the gate compares on equal digests), the evaluation's own settings as tags, and its
    `details` as DETAILS_ARTIFACT."""
    stamp = int(time.time() * 1000)
    values = {"kind": "metrics", "step": step, "time": stamp, "values": metrics, "replace": True}
    tags = {TAG_TEST_DIGEST: test_digest, **jobspec.run_tags(cfg, "evaluate")}
    records = [values, *({"kind": "tag", "key": k, "value": v} for k, v in tags.items())]
    if details is not None:
        # Strict JSON: a recall of a class absent from the test split is NaN, written null.
        text = json.dumps(_nan_as_null(details), indent=2, sort_keys=True, allow_nan=False)
        records.append({"kind": "text", "path": DETAILS_ARTIFACT, "text": text})
    return records


def _nan_as_null(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_as_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_as_null(v) for v in value]
    return value


def record_evaluation(
    tracking_uri: str, run_id: str, records: list[dict], figures: list[Path]
) -> None:
    """Ship `evaluation_records` straight to the run, with what the task drew under
    `evaluation/` (a job whose folder is elsewhere: no journal here to keep them)."""
    ship_records(tracking_uri, run_id, records)
    mlflow_client = client(tracking_uri)
    for figure in figures:
        mlflow_client.log_artifact(run_id, str(figure), "evaluation")


class CheckpointsNotShared(GradlineError):
    """A node does not see the job folder another node created: the checkpoint location
    is not shared."""

    exit_code = 2


def check_checkpoint_location(checkpoints: Path) -> None:
    """The job folder needs a filesystem: checkpoints are committed by renaming their
    folder and the tracking journal is appended to, which object stores cannot do."""
    scheme = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]+):/", str(checkpoints))
    if scheme:
        raise ConfigError(
            f"--checkpoints is a {scheme.group(1)}:// URL, not a checkpoint location gradline "
            "can use (checkpoints are committed by renaming their folder): give a filesystem "
            "path every node mounts (NFS, Lustre, a ReadWriteMany volume, or the bucket "
            "mounted with a FUSE driver)"
        )


def open_shared_job_run(control, checkpoints: Path, tracking_uri: str, open_run) -> JobRun:
    """One MLflow run per job across all nodes: the first launcher to claim the job in the
    control store opens (or resumes) it with `open_run()` and publishes its id; the
    others read it, then check that they see the same job folder and the same run."""
    if control.claim("run/owner"):
        job = open_run()
        relative = job.job_dir.path.relative_to(checkpoints)
        shared = {"run_id": job.run_id, "job": str(relative), "resumed": job.resumed}
        control.put_json("run", shared)
        return job
    shared = control.get_json("run")
    job = JobRun(shared["run_id"], JobDir(checkpoints / shared["job"]), shared["resumed"])
    run_file = job.job_dir.run_file
    seen = json.loads(run_file.read_text())["run_id"] if run_file.is_file() else None
    if seen != job.run_id:
        raise CheckpointsNotShared(
            f"this node does not see the job folder the first node created ({run_file} "
            f"{'holds another run' if seen else 'is missing'}): every node must see the same "
            f"checkpoint location; pass a path on a filesystem mounted on every node as "
            f"--checkpoints (here {checkpoints})"
        )
    from mlflow.exceptions import MlflowException

    try:
        client(tracking_uri).get_run(job.run_id)
    except MlflowException as exc:
        raise CheckpointsNotShared(
            f"MLflow run {job.run_id}, opened by the first node, is not found at this node's "
            f"tracking URI: point every node at the same tracking server "
            f"(MLFLOW_TRACKING_URI) ({type(exc).__name__})"
        ) from exc
    return job


def mark_complete(job: JobRun) -> None:
    job.job_dir.complete_marker.write_text("")


def set_status(tracking_uri: str, run_id: str, status: str) -> None:
    client(tracking_uri).set_terminated(run_id, status=status)
