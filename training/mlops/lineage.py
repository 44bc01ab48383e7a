"""Where a model version came from: its run, data version, code, params, flow run, metrics.

Everything here is read back from the MLflow registry and run; nothing is kept aside.
A model is named as `NAME@ALIAS`, `NAME/VERSION`, `models:/NAME@ALIAS`, or `NAME` alone
(the `champion`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from urllib.parse import quote

from training.errors import TrackingError
from training.mlops.filters import equals
from training.mlops.tracking import (
    TAG_DATA_VERSION,
    TAG_FLOW_RUN,
    TAG_GIT_COMMIT,
    TAG_GIT_DIRTY,
    TAG_JOB_KEY,
    client,
    redact_uri,
)

# Copied onto each model version, so the registry alone answers "where from?".
LINEAGE_TAGS = {
    TAG_DATA_VERSION: "gradline.data_version",
    TAG_GIT_COMMIT: "gradline.git_commit",
    TAG_GIT_DIRTY: "gradline.git_dirty",
    TAG_FLOW_RUN: "gradline.prefect_flow_run_id",
    TAG_JOB_KEY: "gradline.job_key",
}
REF_PATTERN = re.compile(
    r"^(?:models:/)?(?P<name>[^@/]+)(?:@(?P<alias>[^@/]+)|/(?P<version>\d+))?$"
)


@dataclass(frozen=True)
class ModelRef:
    name: str
    alias: str | None = None
    version: int | None = None

    def __str__(self) -> str:
        if self.version is not None:
            return f"{self.name}/{self.version}"
        return f"{self.name}@{self.alias}"


def parse_model_ref(text: str, default_alias: str = "champion") -> ModelRef:
    match = REF_PATTERN.match(text.strip())
    if not match:
        raise TrackingError(
            f"{text!r} does not name a model version: use NAME@ALIAS (gradline-digits@champion)"
            " or NAME/VERSION (gradline-digits/3)"
        )
    version = match["version"]
    alias = match["alias"] or (None if version else default_alias)
    return ModelRef(match["name"], alias, int(version) if version else None)


def ui_base(tracking_uri: str, local_ui_url: str) -> str:
    """The MLflow UI that shows this store: the server itself, or `gradline ui`'s."""
    if tracking_uri.startswith(("http://", "https://")):
        return redact_uri(tracking_uri).rstrip("/")  # links are shown: no credentials
    return local_ui_url.rstrip("/")


# MLflow 3's UI shows an experiment as a GenAI app (traces, evaluation runs, prompts)
# or as model training (runs, metrics, models) by one switch of the browser's, the
# `workflowType` of the page's address, else the one saved in the browser, GenAI by
# default. (The experiment's `mlflow.experimentKind` tag decides it only in the 3.x
# versions without that switch; gradline sets it too: tracking.ensure_experiment.) So
# every link gradline prints asks for the model-training view.
MODEL_TRAINING_VIEW = "workflowType=machine_learning"


def ui_route(base: str, route: str) -> str:
    """`base` + `#/route` in the MLflow UI's model-training view (`base` "" gives a
    link relative to the UI's own page, as a model version's description holds)."""
    joiner = "&" if "?" in route else "?"
    return f"{base}/#/{route.lstrip('/')}{joiner}{MODEL_TRAINING_VIEW}".removeprefix("/")


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    return ui_route(base, f"experiments/{experiment_id}/runs/{run_id}")


def model_version_url(base: str, name: str, version: int) -> str:
    return ui_route(base, f"models/{name}/versions/{version}")


def compare_url(base: str, experiment_id: str, run_ids: list[str]) -> str:
    """The UI's side-by-side view of `run_ids` (a parent and its children)."""
    ids = quote(json.dumps(list(run_ids), separators=(",", ":")))
    experiments = quote(json.dumps([experiment_id]))
    return ui_route(base, f"compare-runs?runs={ids}&experiments={experiments}")


def artifact_url(base: str, experiment_id: str, run_id: str, path: str) -> str:
    """The run page's artifact view opened on `path` (markdown is rendered there)."""
    return ui_route(base, f"experiments/{experiment_id}/runs/{run_id}/artifacts/{path}")


@dataclass(frozen=True)
class Lineage:
    model_name: str
    version: int
    aliases: list[str]
    description: str
    run_id: str
    experiment_id: str
    run_status: str
    data_version: str
    dataset: str
    git_commit: str
    git_dirty: bool
    flow_run_id: str
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def aliases_by_version(mlflow_client, name: str) -> dict[str, list[str]]:
    """version -> its aliases, from one call (version searches leave aliases out)."""
    aliases: dict[str, list[str]] = {}
    for alias, version in mlflow_client.get_registered_model(name).aliases.items():
        aliases.setdefault(str(version), []).append(alias)
    return aliases


def resolve_version(mlflow_client, ref: ModelRef):
    from mlflow.exceptions import MlflowException

    try:
        if ref.version is not None:
            return mlflow_client.get_model_version(ref.name, str(ref.version))
        return mlflow_client.get_model_version_by_alias(ref.name, ref.alias)
    except MlflowException as exc:
        known = mlflow_client.search_model_versions(equals(name=ref.name))
        if not known:
            raise TrackingError(
                f"no registered model {ref.name!r} in this tracking store; `gradline runs` "
                "lists the runs, and `gradline run` registers a model"
            ) from exc
        aliases = aliases_by_version(mlflow_client, ref.name)
        choices = ", ".join(
            f"{ref.name}/{v}" + "".join(f" ({ref.name}@{a})" for a in aliases.get(str(v), []))
            for v in sorted((v.version for v in known), key=int)
        )
        raise TrackingError(f"{ref} not found; registered: {choices}") from exc


def read_lineage(tracking_uri: str, ref: ModelRef) -> Lineage:
    mlflow_client = client(tracking_uri)
    version = resolve_version(mlflow_client, ref)
    run = mlflow_client.get_run(version.run_id)
    tags = run.data.tags
    datasets = [d.dataset.name for d in run.inputs.dataset_inputs]
    return Lineage(
        model_name=ref.name,
        version=int(version.version),
        aliases=list(version.aliases),
        description=version.description or "",
        run_id=run.info.run_id,
        experiment_id=run.info.experiment_id,
        run_status=run.info.status,
        data_version=tags.get(TAG_DATA_VERSION, ""),
        dataset=", ".join(datasets),
        git_commit=tags.get(TAG_GIT_COMMIT, ""),
        git_dirty=tags.get(TAG_GIT_DIRTY) == "true",
        flow_run_id=tags.get(TAG_FLOW_RUN, ""),
        params=dict(run.data.params),
        metrics=dict(run.data.metrics),
    )


def version_tags(run_tags: dict[str, str]) -> dict[str, str]:
    """The lineage tags a model version carries, taken from its training run's tags."""
    return {dst: run_tags[src] for src, dst in LINEAGE_TAGS.items() if src in run_tags}
