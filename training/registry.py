"""Model registry: a new version per training run, and a gate that moves `champion`.

The new version becomes `champion` when there is none, or when it beats the champion's
test accuracy on the same test data. When the test split changed since the champion was
evaluated, the champion is evaluated again on the current split, so the comparison is
always like for like. Otherwise the new version is the `challenger`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from training.tracking import TAG_TEST_DIGEST, client

CHAMPION = "champion"
CHALLENGER = "challenger"
GATE_TAG = "gradline.gate"  # the alias the gate gave this version; set last


@dataclass(frozen=True)
class Registration:
    model_name: str
    version: int
    alias: str
    test_accuracy: float
    champion_accuracy: float | None  # the previous champion's, on the same test data


def _champion_accuracy(
    mlflow_client, model_name: str, test_digest: str, reevaluate: Callable[[str], float]
) -> float | None:
    from mlflow.exceptions import MlflowException

    try:
        champion = mlflow_client.get_model_version_by_alias(model_name, CHAMPION)
    except MlflowException:
        return None
    run = mlflow_client.get_run(champion.run_id)
    same_test_data = run.data.tags.get(TAG_TEST_DIGEST) == test_digest
    if same_test_data and "test_accuracy" in run.data.metrics:
        return run.data.metrics["test_accuracy"]
    return reevaluate(f"models:/{model_name}/{champion.version}")


def register_and_gate(
    tracking_uri: str,
    model_name: str,
    model_uri: str,
    run_id: str,
    test_accuracy: float,
    test_digest: str,
    reevaluate: Callable[[str], float],
    tags: dict[str, str] | None = None,
) -> Registration:
    import mlflow

    # Set first: `reevaluate` loads the champion through these URIs.
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    mlflow_client = client(tracking_uri)
    # Registering is idempotent per run: a pipeline re-run that trained nothing new
    # reports the version it already made instead of adding a duplicate. The gate's
    # verdict is tagged last, so a registration cut short is gated on the next run.
    version = version_of_run(mlflow_client, model_name, run_id)
    if version is not None:
        if GATE_TAG in version.tags:
            alias = ",".join(version.aliases) or "(no alias)"
            return Registration(model_name, int(version.version), alias, test_accuracy, None)
        if CHAMPION in version.aliases:  # cut short after the alias moved: it won
            mlflow_client.set_model_version_tag(model_name, version.version, GATE_TAG, CHAMPION)
            return Registration(model_name, int(version.version), CHAMPION, test_accuracy, None)
    champion_accuracy = _champion_accuracy(mlflow_client, model_name, test_digest, reevaluate)
    tags = {"gradline.run_id": run_id, **(tags or {})}
    if version is None:
        version = mlflow.register_model(model_uri, model_name, tags=tags)
    wins = champion_accuracy is None or test_accuracy > champion_accuracy
    alias = CHAMPION if wins else CHALLENGER
    mlflow_client.update_model_version(
        model_name,
        version.version,
        description=_describe(tags, test_accuracy, champion_accuracy, alias),
    )
    mlflow_client.set_registered_model_alias(model_name, alias, version.version)
    mlflow_client.set_model_version_tag(model_name, version.version, GATE_TAG, alias)
    return Registration(model_name, int(version.version), alias, test_accuracy, champion_accuracy)


def version_of_run(mlflow_client, model_name: str, run_id: str):
    """The model version registered from `run_id`, with its aliases and tags, or None.
    (Search results leave aliases and tags out; the version itself has them.)"""
    found = mlflow_client.search_model_versions(f"name='{model_name}' and run_id='{run_id}'")
    return mlflow_client.get_model_version(model_name, found[0].version) if found else None


def is_gated(mlflow_client, model_name: str, run_id: str) -> bool:
    """Whether the run's model version exists and the gate has decided its alias."""
    version = version_of_run(mlflow_client, model_name, run_id)
    return version is not None and GATE_TAG in version.tags


def _describe(
    tags: dict[str, str], test_accuracy: float, champion_accuracy: float | None, alias: str
) -> str:
    """The version's description in the registry: what it scored and where it came from."""
    versus = (
        "first champion"
        if champion_accuracy is None
        else f"champion before it: {champion_accuracy:.4f} on the same test data"
    )
    lines = [
        f"test_accuracy {test_accuracy:.4f} ({versus}); registered as {alias}.",
        f"Trained in MLflow run {tags['gradline.run_id']}.",
    ]
    if "gradline.data_version" in tags:
        lines.append(f"Data version (DVC md5 of data/raw): {tags['gradline.data_version']}.")
    if "gradline.git_commit" in tags:
        dirty = " with uncommitted changes" if tags.get("gradline.git_dirty") == "true" else ""
        lines.append(f"Code: git commit {tags['gradline.git_commit']}{dirty}.")
    if "gradline.prefect_flow_run_id" in tags:
        lines.append(f"Prefect flow run {tags['gradline.prefect_flow_run_id']}.")
    lines.append("`gradline lineage NAME/VERSION` prints the whole lineage.")
    return " ".join(lines)
