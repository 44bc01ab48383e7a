"""Jobs trained as child runs of one parent run: what `compare-updates` and `sweep` share.

Both train several variants of params.yaml on the data as params.yaml makes it, each
through the train stage's own lifecycle (training.mlops.jobs.run_job) into a child run
(`mlflow.parentRunId`) of a parent run that receives what the comparison or search is
for. Children are measured, not registered: their files stay in a folder of their own
under checkpoints/ and the pipeline's model/, result.json and registry are left alone.
"""

from __future__ import annotations

from pathlib import Path

from training.config import Config, jobspec
from training.engine.launch import Preempted
from training.errors import ConfigError
from training.mlops.jobs import JobRequest
from training.mlops.runs import log_params, new_run, set_status
from training.mlops.tracking import client
from training.project import Project

TAG_PARENT = "mlflow.parentRunId"
TAG_RUN_NAME = "mlflow.runName"


def refuse_data_key(name: str, given: str, command: str) -> None:
    """A variant may not change the data: `name` (section.key) named by `given` (the
    flag or key the user wrote) is refused when it is a key of the ingest/shard stages."""
    if jobspec.use(name).decides_data:
        raise ConfigError(
            f"{given}: {name} decides the data (dvc.yaml's ingest/shard stages), and "
            f"{command} trains on the data as params.yaml makes it. Set it in params.yaml "
            f"(or run `gradline run --set {name}=...`) first"
        )


def open_parent(
    root: Path,
    cfg: Config,
    data_version: str,
    run_name: str,
    params: dict[str, str],
    tags: dict[str, str] | None = None,
) -> str:
    """The parent run, with gradline's lineage tags and `params` (what the children
    share and what the comparison adds)."""
    uri = Project(root).tracking_uri
    parent_id = new_run(root, cfg, uri, data_version, {TAG_RUN_NAME: run_name, **(tags or {})})
    log_params(client(uri), parent_id, params)
    return parent_id


def shared_params(cfg: Config, varied: set[str]) -> dict[str, str]:
    """The job's MLflow params that every child shares: all but the `varied` keys."""
    return {k: v for k, v in jobspec.mlflow_params(cfg).items() if k not in varied}


def child_request(
    root: Path,
    cfg: Config,
    folder: Path,
    parent_id: str,
    run_name: str,
    tags: dict[str, str] | None = None,
    faults: str | None = None,
) -> JobRequest:
    """A child's job: checkpoints (the job folder) and model under `folder`, its run a
    child of `parent_id`. No model is logged: children are measured, not registered."""
    project = Project(root)
    return JobRequest(
        cfg,
        project.shards,
        folder,
        folder / "model",
        root=root,
        tracking_uri=project.tracking_uri,
        tags={TAG_PARENT: parent_id, TAG_RUN_NAME: run_name, **(tags or {})},
        faults=faults,
        log_model=False,
    )


def end_parent(tracking_uri: str, parent_id: str, error: BaseException | None) -> None:
    """FINISHED, or KILLED when a stop request ended it (running again can go on), or
    FAILED."""
    stopped = isinstance(error, Preempted)
    status = "FINISHED" if error is None else "KILLED" if stopped else "FAILED"
    set_status(tracking_uri, parent_id, status)
