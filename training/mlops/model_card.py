"""A model card per registered version: gathered at registration, logged on the run.

The card (training.mlops.card_markdown renders it) is written once the gate has decided,
from what the version's MLflow run recorded (metrics, params, tags, the evaluate stage's
evaluation/details.json with the bootstrap intervals) and from the project's files that
belong to that run: the shard manifest (rows per split, features, label) and
data/ingest.json (the drift check's `drift` entry), both only when their data version
is the run's, and result.json (steps, the selected step) only when it names the run.
It is logged as `model_card.md` on the run; the version's description links to it and
`gradline lineage` prints it.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.errors import TrackingError
from training.mlops.lineage import artifact_url
from training.mlops.runs import DETAILS_ARTIFACT
from training.mlops.tracking import TAG_DATA_VERSION, client

CARD_ARTIFACT = "model_card.md"
TAG_MODEL_CARD = "gradline.model_card"  # on the version: the card's runs:/ URI


@dataclass(frozen=True)
class CardFacts:
    """Everything a card shows, read once; rendering it is a pure function."""

    model_name: str
    version: int
    aliases: list[str]
    verdict: str  # the gate's
    task: str
    gate_metric: str
    higher_is_better: bool
    run_id: str
    experiment_id: str
    start_ms: int
    end_ms: int | None
    metrics: dict[str, float]
    params: dict[str, str]
    tags: dict[str, str]
    details: dict[str, Any] = field(default_factory=dict)  # evaluation/details.json
    manifest: dict[str, Any] | None = None  # the shards' manifest of the run's data
    drift: Any = None  # data/ingest.json's `drift` entry, if the ingest recorded one
    final: dict[str, Any] | None = None  # result.json's `final` of this run


@dataclass(frozen=True)
class CardSources:
    """The project files a card may read (each only when it belongs to the run)."""

    manifest: Path  # data/shards/manifest.json
    ingest_report: Path  # data/ingest.json
    train_result: Path  # result.json


def card_uri(run_id: str) -> str:
    return f"runs:/{run_id}/{CARD_ARTIFACT}"


def card_link(experiment_id: str, run_id: str) -> str:
    """The card in the MLflow UI, relative to the UI's own page: a model version's
    description links there from whichever address the UI is served at."""
    return artifact_url("", experiment_id, run_id, CARD_ARTIFACT)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _run_text(mlflow_client, run_id: str, path: str) -> str | None:
    """The text of the run's artifact `path`, or None when the run has none there."""
    from mlflow.exceptions import MlflowException

    folder = str(Path(path).parent) if "/" in path else None
    if path not in {a.path for a in mlflow_client.list_artifacts(run_id, folder)}:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return Path(mlflow_client.download_artifacts(run_id, path, tmp)).read_text()
        except (MlflowException, OSError) as exc:
            raise TrackingError(f"cannot read {path} of MLflow run {run_id}: {exc}") from exc


def _run_details(mlflow_client, run_id: str) -> dict[str, Any]:
    """evaluation/details.json of the run ({} for a run evaluated before it existed)."""
    text = _run_text(mlflow_client, run_id, DETAILS_ARTIFACT)
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}


def gather(
    tracking_uri: str,
    model_name: str,
    version: int,
    verdict: str,
    task,  # training.objectives.TaskCard of the run's task
    sources: CardSources,
) -> CardFacts:
    """The facts of `model_name` version `version` (its run and the files of it)."""
    mlflow_client = client(tracking_uri)
    found = mlflow_client.get_model_version(model_name, str(version))
    run = mlflow_client.get_run(found.run_id)
    data_version = run.data.tags.get(TAG_DATA_VERSION)
    manifest = _read_json(sources.manifest)
    if not (isinstance(manifest, dict) and manifest.get("data_version") == data_version):
        manifest = None  # the shards here are of other data now
    report = _read_json(sources.ingest_report) if manifest is not None else None
    result = _read_json(sources.train_result)
    final = result.get("final") if isinstance(result, dict) else None
    if not (isinstance(result, dict) and result.get("run_id") == run.info.run_id):
        final = None
    return CardFacts(
        model_name=model_name,
        version=int(version),
        aliases=list(found.aliases),
        verdict=verdict,
        task=task.name,
        gate_metric=task.gate_metric,
        higher_is_better=task.higher_is_better,
        run_id=run.info.run_id,
        experiment_id=run.info.experiment_id,
        start_ms=run.info.start_time,
        end_ms=run.info.end_time,
        metrics=dict(run.data.metrics),
        params=dict(run.data.params),
        tags=dict(run.data.tags),
        details=_run_details(mlflow_client, run.info.run_id),
        manifest=manifest,
        drift=report.get("drift") if isinstance(report, dict) else None,
        final=final if isinstance(final, dict) else None,
    )


def publish(tracking_uri: str, run_id: str, markdown: str) -> str:
    """Log the card on the run (replacing an earlier one); its runs:/ URI."""
    client(tracking_uri).log_text(run_id, markdown, CARD_ARTIFACT)
    return card_uri(run_id)


def read_card(tracking_uri: str, run_id: str) -> str | None:
    """The run's model card, or None when it has none (registered before cards)."""
    return _run_text(client(tracking_uri), run_id, CARD_ARTIFACT)


def gate_verdict(text: str) -> str:
    """The gate's verdict alone: a registration made before reports the version's whole
    description, which opens with it ("Champion: ... . Trained in MLflow run ...")."""
    return text.split(" Trained in MLflow run ")[0].rstrip(".")


def write_card(
    tracking_uri: str,
    model_name: str,
    version: int,
    verdict: str,
    task,
    sources: CardSources,
) -> str:
    """Gather, render and log the card of `model_name` version `version`; its runs:/ URI."""
    from training.mlops.card_markdown import render

    facts = gather(tracking_uri, model_name, version, gate_verdict(verdict), task, sources)
    return publish(tracking_uri, facts.run_id, render(facts))
