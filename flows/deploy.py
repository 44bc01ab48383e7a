"""`gradline serve`: register the deployments in prefect.yaml and run what they schedule.

prefect.yaml is the one place deployments and their cron schedules are written down.
Two flows can be deployed: the pipeline (`flows/pipeline.py:pipeline`, the default),
whose parameters are `overrides` (validated exactly like `gradline run --set`, before
anything is registered) and `force`; and batch scoring (`flows/score.py:score`), whose
parameters are `model`, `input`, `output` and `on_bad_rows` (empty: the score section).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.schedules import CronSchedule
from prefect.exceptions import ObjectNotFound
from prefect.schedules import Cron
from prefect.settings import get_current_settings
from prefect.utilities.callables import parameter_schema

from flows import score, train_pool
from flows.pipeline import pipeline
from flows.served_runs import serve_until_stopped
from flows.train_pool import deployment_name, train_stage
from tasks.watchdog import ensure_stale_alert, ensure_watchdogs
from training.config import load_config, read_yaml_mapping
from training.errors import ConfigError
from training.project import Project

ENTRYPOINT = "flows/pipeline.py:pipeline"
FLOW_PARAMETERS = {"overrides", "force"}
SCORE_ENTRYPOINT = "flows/score.py:score"
FLOWS = {ENTRYPOINT: pipeline, SCORE_ENTRYPOINT: score.score}


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    parameters: dict[str, Any]
    schedules: list[dict[str, Any]]
    description: str = ""
    tags: list[str] = field(default_factory=list)
    entrypoint: str = ENTRYPOINT


def _fail(source: Path, where: str, problem: str) -> ConfigError:
    return ConfigError(f"{source}: {where}: {problem}")


def _schedule(source: Path, where: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict) or not isinstance(raw.get("cron"), str):
        raise _fail(source, where, 'each schedule needs a cron string, e.g. cron: "0 2 * * *"')
    unknown = set(raw) - {"cron", "timezone", "active"}
    if unknown:
        raise _fail(source, where, f"unknown keys {sorted(unknown)}; use cron, timezone, active")
    if not isinstance(raw.get("active", True), bool):
        raise _fail(source, where, "active must be true or false")
    try:  # the same check the server makes, so a typo fails here and not at 2 am
        CronSchedule(cron=raw["cron"], timezone=raw.get("timezone"))
    except ValueError as exc:
        raise _fail(source, where, f"invalid schedule {raw}: {exc}") from exc
    return raw


def read_deployments(root: Path) -> list[DeploymentSpec]:
    """prefect.yaml's deployments, every parameter validated against the config schema."""
    source = root / "prefect.yaml"
    shape = "a mapping with a list under `deployments:`"
    document = read_yaml_mapping(source, "deployments are defined there", shape)
    if not isinstance(document.get("deployments", []), list):
        raise ConfigError(f"{source} must be {shape}")
    specs = []
    for i, raw in enumerate(document.get("deployments") or []):
        where = f"deployments[{i}]"
        if not isinstance(raw, dict):
            raise _fail(source, where, "each deployment is a mapping with name, parameters, ...")
        name = raw.get("name")
        if not name:
            raise _fail(source, where, "a deployment needs a name")
        where = f"deployment {name!r}"
        entrypoint = raw.get("entrypoint", ENTRYPOINT)
        if entrypoint not in FLOWS:
            raise _fail(source, where, f"entrypoint must be {' or '.join(FLOWS)}")
        parameters = dict(raw.get("parameters") or {})
        if entrypoint == SCORE_ENTRYPOINT:
            _check_score_parameters(source, where, parameters)
        else:
            _check_pipeline_parameters(root, source, where, parameters)
        schedules = [
            _schedule(source, f"{where} schedule {j}", s)
            for j, s in enumerate(raw.get("schedules") or [])
        ]
        tags = raw.get("tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise _fail(source, where, "tags must be a list of strings")
        description = raw.get("description", "")
        specs.append(DeploymentSpec(name, parameters, schedules, description, tags, entrypoint))
    if not specs:
        raise ConfigError(f"{source} defines no deployments")
    return specs


def _check_score_parameters(source: Path, where: str, parameters: dict[str, Any]) -> None:
    unknown = set(parameters) - set(score.PARAMETERS)
    if unknown:
        raise _fail(
            source,
            where,
            f"unknown parameters {sorted(unknown)}; the score flow takes "
            f"{', '.join(score.PARAMETERS)} (text; empty: the score section of params.yaml)",
        )
    for key, value in parameters.items():
        if not isinstance(value, str):
            raise _fail(source, where, f'{key} must be text, e.g. {key}: ""')
    if parameters.get("on_bad_rows", "") not in ("", "fail", "quarantine"):
        raise _fail(source, where, "on_bad_rows must be fail or quarantine")


def _check_pipeline_parameters(
    root: Path, source: Path, where: str, parameters: dict[str, Any]
) -> None:
    unknown = set(parameters) - FLOW_PARAMETERS
    if unknown:
        raise _fail(
            source,
            where,
            f"unknown parameters {sorted(unknown)}; the flow takes "
            "overrides (a list of section.key=value) and force (true/false)",
        )
    overrides = parameters.get("overrides") or []
    if not isinstance(overrides, list):
        raise _fail(source, where, 'overrides must be a list, e.g. ["train.epochs=20"]')
    try:
        load_config(Project(root).params, [str(o) for o in overrides])
    except ConfigError as exc:
        raise _fail(source, where, str(exc)) from exc
    if not isinstance(parameters.get("force", False), bool):
        raise _fail(source, where, "force must be true or false")


def serve_deployments(root: Path, names: list[str]) -> None:
    """Register the chosen deployments and execute their runs until interrupted.

    Flow runs of one project go one at a time (`limit=1`): they share its DVC workspace.
    """
    if not get_current_settings().api.url:
        raise ConfigError(
            "PREFECT_API_URL is not set: schedules need a running Prefect server. Start "
            "one (`gradline ui` or `prefect server start`) and set "
            "PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    specs = read_deployments(root)
    if names:
        unknown = set(names) - {s.name for s in specs}
        if unknown:
            known = ", ".join(s.name for s in specs)
            raise ConfigError(f"no deployment named {sorted(unknown)} in prefect.yaml ({known})")
        specs = [s for s in specs if s.name in names]
    os.chdir(root)  # the entrypoint is a path relative to the project root
    deployments = [
        FLOWS[spec.entrypoint].to_deployment(
            name=spec.name,
            parameters=spec.parameters,
            schedules=[
                Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True))
                for s in spec.schedules
            ],
            description=spec.description or None,
            tags=spec.tags or None,
        )
        for spec in specs
    ]
    _register_watchdogs(root, deployments)
    serve_until_stopped(*deployments, limit=1)


def _register_watchdogs(root: Path, deployments: list) -> None:
    """Zombie runs marked Crashed; with alerts on, crashes and stale schedules sent."""
    orchestrate = Project(root).config().orchestrate
    ensure_watchdogs(orchestrate.notify)
    if not orchestrate.notify:
        return
    for deployment in deployments:
        # A schedule that is off (score-daily ships so) cannot go stale.
        if any(s.active for s in deployment.schedules):  # apply() now, for the id
            ensure_stale_alert(
                f"{deployment.flow_name}/{deployment.name}",
                deployment.apply(),
                orchestrate.notify,
                orchestrate.stale_after_h,
            )


def deploy_train(pool: str, project_dir: str, image: str | None = None) -> str:
    """Register the train-only deployment `gradline-train/<pool>` on work pool `pool`.

    Its flow runs start in `project_dir`, the gradline checkout on the pool's machines
    (in `image`, for a Kubernetes pool: a job variable of the deployment).

    Registered through the client rather than `flow.deploy()`: that asks the server for
    workers first, which Prefect 3.8.8's server refuses (422); and
    `to_deployment().apply()` cannot say where the code already is (a pull step).
    """
    if not get_current_settings().api.url:
        raise ConfigError(
            "PREFECT_API_URL is not set: the deployment goes to the Prefect server that the "
            "flows and the pool's workers share, e.g. PREFECT_API_URL=http://HOST:4200/api"
        )
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            raise ConfigError(
                f"no work pool {pool!r} on the Prefect server: create it first, e.g. "
                f"`prefect work-pool create {pool} --type process`, or with "
                "deploy/prefect/gpu-work-pool.json for Kubernetes (deploy/README.md)"
            ) from None
        ensure_watchdogs()  # the pool's runs, too, are marked Crashed when they go silent
        client.create_deployment(
            flow_id=client.create_flow(train_stage),
            name=pool,
            entrypoint=train_pool.ENTRYPOINT,
            work_pool_name=pool,
            pull_steps=[
                {"prefect.deployments.steps.set_working_directory": {"directory": project_dir}}
            ],
            parameter_openapi_schema=parameter_schema(train_stage).model_dump_for_openapi(),
            description="the train stage of gradline flows with orchestrate.train_pool="
            f"{pool} (flows/train_pool.py)",
            tags=["gradline"],
            job_variables={"image": image} if image else None,
        )
    return deployment_name(pool)
