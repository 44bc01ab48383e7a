"""The train stage on a Prefect work pool (a GPU machine) while the flow runs elsewhere.

Both sides of one hand-over, so the protocol reads in one place. The calling flow
(`gradline run`, or a deployment on a CPU pool) pushes the shards to the DVC remote and
runs the `gradline-train/<pool>` deployment. That flow run, in the GPU machine's own
checkout, writes the caller's params.yaml and shard entry of dvc.lock, pulls the shards,
runs the train stage through `dvc repro` under that machine's device quota, pushes the
model and publishes the train stage's dvc.lock entry and result.json as an artifact. The
calling flow writes both, pulls the model and checks that `dvc status train` is clean:
the stage is recorded here exactly as if it had run here. The two machines share only
the DVC remote, the MLflow tracking server and the Prefect server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run

from tasks.dvc_stages import (
    lock_entry,
    pull_outputs,
    push_outputs,
    run_stage,
    stale_stages,
    write_lock_entry,
)
from tasks.quota import device_slots
from training.atomic import atomic_file
from training.config import Config, load_config
from training.errors import ConfigError, GradlineError
from training.lock import project_lock
from training.project import Project, find_project_root

FLOW_NAME = "gradline-train"
ENTRYPOINT = "flows/train_pool.py:train_stage"
RESULT_KEY = "gradline-train-result"  # the artifact carrying what the caller records
_FENCE = "```"


class TrainPoolFailed(GradlineError):
    """The train stage on the work pool failed, or what it produced does not fit here."""


def deployment_name(pool: str) -> str:
    """The train-only deployment of a pool: one per pool, named after it."""
    return f"{FLOW_NAME}/{pool}"


# --- on the pool's machine --------------------------------------------------------------


@flow(name=FLOW_NAME)
def train_stage(
    params: str, shard_lock: dict, pool: str, record_as: str = "", force: bool = False
) -> dict:
    """Run the train stage in this checkout for a flow run elsewhere.

    params: the caller's params.yaml text. shard_lock: its dvc.lock entry of the shard
    stage (which shards to pull). record_as: the calling flow run, tagged on the MLflow run.
    """
    root = find_project_root()
    project = Project(root)
    with project_lock(root, say=get_run_logger().info):  # this checkout's one writer
        with atomic_file(project.params, "w") as handle:
            handle.write(params)
        write_lock_entry(root, "shard", shard_lock)
        pull_outputs(str(root), "shard")
        # This machine's devices are the pool's: a quota of their own, named after the pool.
        limit = f"{load_config(project.params).orchestrate.device_limit}-{pool}"
        cfg = load_config(project.params, [f"orchestrate.device_limit={limit}"])
        with device_slots(cfg):
            run_stage(cfg, str(root), "train", force, record_as)
        push_outputs(str(root), "train")
        produced = {
            "lock": lock_entry(root, "train"),
            "result_json": project.train_result.read_text(),
        }
    _publish(produced)
    return produced


def _publish(produced: dict[str, Any]) -> None:
    """An artifact of this flow run: the caller's server holds it, whatever machine reads
    it (a flow run's return value stays in the result storage of the machine it ran on)."""
    body = json.dumps(produced, indent=1)
    create_markdown_artifact(
        key=RESULT_KEY,
        markdown=f"train stage: dvc.lock entry and result.json\n\n{_FENCE}json\n{body}\n{_FENCE}\n",
        description="what the calling flow records as its train stage",
    )


# --- in the calling flow ----------------------------------------------------------------


def train_on_pool(cfg: Config, root: str, force: bool) -> None:
    """Train on the work pool `orchestrate.train_pool`; record the stage here."""
    pool = cfg.orchestrate.train_pool
    push_outputs(root, "shard")
    run = _run_remote(pool, cfg, root, force)
    record_train(root, _read_produced(run))
    pull_outputs(root, "train")
    _check_recorded(root, pool, run)


def _run_remote(pool: str, cfg: Config, root: str, force: bool):
    logger = get_run_logger()
    name = deployment_name(pool)
    variables = _job_variables(pool, cfg)
    logger.info("training on work pool %r (deployment %s)", pool, name)
    run = run_deployment(
        name=name,
        parameters={
            "params": Project(Path(root)).params.read_text(),
            "shard_lock": lock_entry(Path(root), "shard"),
            "pool": pool,
            "record_as": str(flow_run.id or ""),
            "force": force,
        },
        job_variables=variables,
        timeout=None,
    )
    if not (run.state and run.state.is_completed()):
        state = f"{run.state.name}: {run.state.message}" if run.state else "no state"
        raise TrainPoolFailed(
            f"the train stage on work pool {pool!r} failed: flow run {run.name!r} ({run.id}) "
            f"ended {state}. Its logs are on the Prefect server."
        )
    return run


def check_train_pool(pool: str) -> dict[str, Any]:
    """Fail at once, naming the fix, when the pool has no train-only deployment; return
    the pool's job variables schema."""
    name = deployment_name(pool)
    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise ConfigError(
                f"orchestrate.train_pool={pool!r}: the Prefect server has no deployment {name}. "
                f"Create it where the pool's workers run: `gradline deploy-train --pool {pool}`"
            ) from None
        if deployment.work_pool_name != pool:
            raise ConfigError(
                f"deployment {name} runs on work pool {deployment.work_pool_name!r}, not "
                f"{pool!r}: run `gradline deploy-train --pool {pool}` again"
            )
        template = client.read_work_pool(pool).base_job_template
    return template.get("variables", {}).get("properties", {})


def _job_variables(pool: str, cfg: Config) -> dict[str, Any]:
    """`gpus` = runtime.procs_per_node where the pool's template has that variable (the GPU
    template does; a process pool does not)."""
    return {"gpus": cfg.runtime.procs_per_node} if "gpus" in check_train_pool(pool) else {}


def _read_produced(run) -> dict[str, Any]:
    # Only the fields given: Prefect 3.8.8's read_artifacts sends explicit nulls for the
    # others, which its own server refuses (422).
    query = {"key": {"any_": [RESULT_KEY]}, "flow_run_id": {"any_": [str(run.id)]}}
    with get_client(sync_client=True) as client:
        response = client.request("POST", "/artifacts/filter", json={"artifacts": query})
        response.raise_for_status()
    artifacts = response.json()
    if not artifacts:
        raise TrainPoolFailed(
            f"flow run {run.name!r} ({run.id}) completed without its {RESULT_KEY} artifact: "
            f"is the deployment {FLOW_NAME}'s train_stage flow?"
        )
    markdown = str(artifacts[0]["data"])
    body = markdown.split(f"{_FENCE}json\n", 1)[1].rsplit(f"\n{_FENCE}", 1)[0]
    return json.loads(body)


@task(name="record-train", task_run_name="record-train")
def record_train(root: str, produced: dict[str, Any]) -> None:
    """Write the remote run's dvc.lock entry and result.json here, as `dvc repro` would."""
    project = Project(Path(root))
    write_lock_entry(project.root, "train", produced["lock"])
    with atomic_file(project.train_result, "w") as handle:
        handle.write(produced["result_json"])


def _check_recorded(root: str, pool: str, run) -> None:
    """The recorded stage must be this checkout's: same code, params and shards."""
    changed = stale_stages(Path(root), "train")
    if changed:
        raise TrainPoolFailed(
            f"the train stage run on work pool {pool!r} (flow run {run.name!r}) does not match "
            f"this checkout: `dvc status train` reports {changed}. The pool's checkout must "
            "hold the same commit as this one (update it, then run again)."
        )
