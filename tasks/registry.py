"""Tasks that record results: the model version, whether a run is needed, the summary."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.dvc_stages import stale_stages
from tasks.warm_imports import import_in_background, wait_for_background_imports
from training.config import Config
from training.data.manifest import MANIFEST, read_manifest, split_digest
from training.mlops.drift import record_drift
from training.mlops.lineage import version_tags
from training.mlops.model_card import TAG_MODEL_CARD, CardSources, card_link, card_uri, write_card
from training.mlops.registry import gate_score, register_and_gate
from training.mlops.summary import RunSummary, summarize, up_to_date_run
from training.mlops.sync import run_model_uri, ship_when_back
from training.mlops.tracking import client
from training.project import Project

SUMMARY_KEY = "gradline-run-summary"


@task(name="check-up-to-date", task_run_name="check-up-to-date")
def find_up_to_date_run(root: str, cfg: Config) -> RunSummary | None:
    """The last run's summary when nothing changed since (training.mlops.summary)."""
    return up_to_date_run(Path(root), cfg, stale_stages, get_run_logger().info)


def prepare_registration() -> None:
    """Import MLflow's client and stores (~1 s) in the background now, while the flow's
    stages run, instead of when the flow registers (the first MLflow call of a run that
    does not skip)."""
    import_in_background(
        "mlflow",
        "mlflow.tracking",
        "mlflow.store.tracking.sqlalchemy_store",
        "mlflow.store.model_registry.sqlalchemy_store",
    )


@task(name="register-model", task_run_name="register-model")
def register_model(root: str, cfg: Config) -> RunSummary:
    """Register the trained model and gate it on the task's metric against its baseline
    and the champion, both on the current test split; first ship what the job left in
    its journal, waiting up to orchestrate.tracking_wait_s for a server that is down."""
    logger = get_run_logger()
    wait_for_background_imports()  # MLflow's, queued by prepare_registration
    return register_trained(Path(root), cfg, cfg.orchestrate.tracking_wait_s, logger.info)


def _rescore_champion(cfg: Config, shards: Path, model_uri: str, metric: str, uri: str) -> float:
    # Imported only when there is a champion to re-score: it needs torch (~2 s to import),
    # which the rest of the flow, in this process, does without.
    from training.mlops.serving import rescore_champion

    return rescore_champion(cfg, shards, model_uri, metric, uri)


def register_trained(root: Path, cfg: Config, wait_s: float, say) -> RunSummary:
    """The register step, for the flow and for `gradline sync`: ship every pending
    journal of the project (waiting up to `wait_s`, saying so through `say`), then
    register the trained run's model once and gate it."""
    project = Project(root)
    trained = project.read_train_result()
    metrics = json.loads(project.metrics.read_text())
    manifest = read_manifest(project.shards)
    tracking_uri = project.tracking_uri
    ship_when_back(tracking_uri, project.checkpoints, wait_s, say, "register the model")
    # A job that ended while the server was down logged its model when it shipped.
    model_uri = trained["model_uri"] or run_model_uri(tracking_uri, trained["run_id"])
    run = client(tracking_uri).get_run(trained["run_id"])
    score = gate_score(cfg, metrics)
    # The champion's reference for the next drift check, and this data's drift.
    drift_note = record_drift(project, cfg, trained["run_id"])
    registration = register_and_gate(
        tracking_uri,
        cfg.registry.model_name,
        model_uri,
        trained["run_id"],
        score,
        split_digest(manifest, "test"),
        lambda uri: _rescore_champion(cfg, project.shards, uri, score.metric, tracking_uri),
        tags={**version_tags(run.data.tags), TAG_MODEL_CARD: card_uri(run.info.run_id)},
        card_link=card_link(run.info.experiment_id, run.info.run_id),
        note=drift_note,
    )
    # Once the gate has decided (its verdict is in the card); written again by every
    # registration of the run, so a card cut short is completed by the next run.
    sources = CardSources(project.shards / MANIFEST, project.ingest_report, project.train_result)
    write_card(
        tracking_uri,
        registration.model_name,
        registration.version,
        registration.verdict,
        cfg.task.card,
        sources,
    )
    return summarize(cfg, project.root, trained["run_id"], "completed", registration.verdict)


def _markdown(summary: RunSummary) -> str:
    rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in sorted(summary.metrics.items()))
    skipped = summary.status == "skipped"
    state = "skipped: " if skipped else ""
    # A skipped run gated nothing now: the verdict shown is the one it got then.
    gate_row = f"| gate verdict | {summary.verdict.split('. ')[0]} |\n"
    return f"""# gradline run: {state}{summary.headline}

| | |
|---|---|
| data version (DVC md5) | `{summary.data_version}` |
| MLflow run | [{summary.run_id}]({summary.run_url}) (experiment `{summary.experiment}`) |
| model version | [{summary.model_name} v{summary.version}]({summary.version_url}) |
| alias | **{summary.alias}** |
{gate_row}
| metric | value |
|---|---|
{rows}
"""


@task(name="publish-summary", task_run_name="publish-summary")
def publish_summary(summary: RunSummary) -> None:
    create_markdown_artifact(
        key=SUMMARY_KEY, markdown=_markdown(summary), description="gradline run summary"
    )
    print(json.dumps(asdict(summary), indent=2))


def publish_failure(step: str, exc: BaseException) -> None:
    """The failure as an artifact of the flow run: which step, and the cause."""
    retry = "no (fix the input and run again)"
    if getattr(exc, "retryable", True):
        retry = "yes (a retry resumes from the latest checkpoint)"
    markdown = f"""# gradline run failed in `{step}`

| | |
|---|---|
| step | `{step}` |
| error | `{type(exc).__name__}` |
| worth retrying | {retry} |

```
{str(exc)[-6000:]}
```
"""
    create_markdown_artifact(key=SUMMARY_KEY, markdown=markdown, description="gradline failure")
