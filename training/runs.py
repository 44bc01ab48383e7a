"""The MLflow run of a training job: created (or resumed) before workers start.

A job is identified by its key: a hash of the train parameters and the data version. A
job that stopped before finishing (worker failure past the restart budget, preemption,
a retried task) has a checkpoint folder holding its run id; running it again continues
the same run from the latest checkpoint instead of starting a second one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from training.atomic import write_json
from training.config import Config
from training.tracking import (
    FLOW_RUN_ENV,
    TAG_DATA_VERSION,
    TAG_FLOW_RUN,
    TAG_GIT_COMMIT,
    TAG_GIT_DIRTY,
    TAG_JOB_KEY,
    client,
    default_artifact_location,
    ensure_experiment,
    git_commit,
)

RUN_FILE = "run.json"
COMPLETE_FILE = "COMPLETE"


def job_key(cfg: Config, data_version: str) -> str:
    identity = {"train": cfg.train.model_dump(), "data_version": data_version}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class JobRun:
    run_id: str
    checkpoint_dir: Path
    resumed: bool


def open_job_run(
    root: Path, cfg: Config, tracking_uri: str, data_version: str, checkpoints: Path
) -> JobRun:
    """Resume the unfinished run of this job, or start a fresh one."""
    key = job_key(cfg, data_version)
    job_dir = checkpoints / key
    run_file = job_dir / RUN_FILE
    mlflow_client = client(tracking_uri)
    if run_file.is_file() and not (job_dir / COMPLETE_FILE).exists():
        run_id = json.loads(run_file.read_text())["run_id"]
        mlflow_client.update_run(run_id, status="RUNNING")
        return JobRun(run_id, job_dir, resumed=True)
    if job_dir.exists():  # a finished job asked to run again starts from scratch
        shutil.rmtree(job_dir)
    job_dir.mkdir(parents=True)

    experiment_id = ensure_experiment(
        tracking_uri,
        cfg.registry.experiment,
        default_artifact_location(root, tracking_uri),
    )
    tags = {TAG_DATA_VERSION: data_version, TAG_JOB_KEY: key}
    if commit := git_commit(root):
        tags[TAG_GIT_COMMIT] = commit[0]
        tags[TAG_GIT_DIRTY] = str(commit[1]).lower()
    if flow_run := os.environ.get(FLOW_RUN_ENV):
        tags[TAG_FLOW_RUN] = flow_run
    run = mlflow_client.create_run(experiment_id, tags=tags)
    run_id = run.info.run_id
    from mlflow.entities import Param

    params = [Param(k, str(v)) for k, v in cfg.flat().items()]
    mlflow_client.log_batch(run_id, params=params)
    log_dataset(mlflow_client, run_id, cfg, root, data_version)
    write_json(run_file, {"run_id": run_id})
    return JobRun(run_id, job_dir, resumed=False)


def log_dataset(mlflow_client, run_id: str, cfg: Config, root: Path, data_version: str) -> None:
    """Record the training data as a dataset input: the UI shows which data trained the
    model, with the DVC md5 as its digest (`dvc checkout` of that version restores it)."""
    import warnings

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


def mark_complete(job: JobRun) -> None:
    (job.checkpoint_dir / COMPLETE_FILE).write_text("")


def set_status(tracking_uri: str, run_id: str, status: str) -> None:
    client(tracking_uri).set_terminated(run_id, status=status)


def log_final_model(tracking_uri: str, run_id: str, model, example) -> str:
    """Log the unwrapped model with the pytorch flavor and a signature; return its URI."""
    import torch
    from mlflow.models import infer_signature

    import mlflow

    with torch.no_grad():
        output = model(torch.from_numpy(example)).numpy()
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pytorch.log_model(
            model,
            name="model",
            signature=infer_signature(example, output),
            input_example=example,
            # Given explicitly: inferring requirements costs seconds and guesses wrong.
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
        )
    return info.model_uri
