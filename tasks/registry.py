"""Tasks that record results: the model version, whether a run is needed, the summary."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.dvc_stages import stale_stages
from training.config import Config
from training.data.manifest import MANIFEST, read_manifest, split_digest
from training.mlops.drift import record_drift
from training.mlops.lineage import model_version_url, run_url, ui_base, version_tags
from training.mlops.model_card import TAG_MODEL_CARD, CardSources, card_link, card_uri, write_card
from training.mlops.registry import gate_score, is_gated, register_and_gate, version_of_run
from training.mlops.sync import run_model_uri, ship_when_back
from training.mlops.tracking import TAG_DATA_VERSION, client, redact_uri
from training.project import Project, default_tracking_uri

SUMMARY_KEY = "gradline-run-summary"


@dataclass(frozen=True)
class RunSummary:
    status: str  # "completed" or "skipped"
    data_version: str
    run_id: str
    run_url: str
    experiment: str
    tracking_uri: str
    model_name: str
    version: int
    version_url: str
    alias: str
    metrics: dict[str, float] = field(default_factory=dict)
    verdict: str = ""

    @property
    def headline(self) -> str:
        if self.status == "skipped":
            return f"up to date with run {self.run_id}"
        return f"trained run {self.run_id}"

    def describe(self) -> str:
        metrics = "  ".join(
            f"{k}={v:.4f}"
            + (
                f" (baseline {b:.4f}"
                # A task with a second baseline (forecasting's last value) shows it too.
                + (
                    f", last value {last:.4f}"
                    if (last := self.metrics.get(f"baseline_last_value_{k}")) is not None
                    else ""
                )
                + ")"
                if (b := self.metrics.get(f"baseline_{k}")) is not None
                else ""
            )
            for k, v in sorted(self.metrics.items())
            if not k.startswith("baseline_")
        )
        first = (
            f"gradline: nothing changed, {self.headline} (pass --force to retrain)"
            if self.status == "skipped"
            else "gradline run complete"
        )
        return (
            f"{first}\n"
            f"  data version   {self.data_version}\n"
            f"  MLflow run     {self.run_id} (experiment {self.experiment!r})\n"
            f"                 {self.run_url}\n"
            f"  model version  {self.model_name} v{self.version} -> alias {self.alias!r}\n"
            f"                 {self.version_url}\n"
            f"  metrics        {metrics}\n"
            f"  gate           {self.verdict.split('. ')[0]}\n"
            f"  tracking store {self.tracking_uri}\n"
            f"  see them with  gradline ui  (MLflow UI and Prefect UI on 127.0.0.1)"
        )


def _summarize(cfg: Config, root: Path, run_id: str, status: str, verdict: str = "") -> RunSummary:
    """Build the summary from what MLflow recorded for `run_id`."""
    tracking_uri = default_tracking_uri(root)
    mlflow_client = client(tracking_uri)
    run = mlflow_client.get_run(run_id)
    name = cfg.registry.model_name
    version = version_of_run(mlflow_client, name, run_id)
    base = ui_base(tracking_uri, cfg.orchestrate.mlflow_ui_url)
    return RunSummary(
        status=status,
        data_version=run.data.tags.get(TAG_DATA_VERSION, ""),
        run_id=run_id,
        run_url=run_url(base, run.info.experiment_id, run_id),
        experiment=cfg.registry.experiment,
        tracking_uri=redact_uri(tracking_uri),  # printed and published
        model_name=name,
        version=int(version.version),
        version_url=model_version_url(base, name, int(version.version)),
        alias=",".join(version.aliases) or "(none)",
        metrics={
            k: v
            for k, v in run.data.metrics.items()
            if k.startswith(("test_", "baseline_test_", "baseline_last_value_test_"))
        },
        verdict=verdict or version.description or "",
    )


@task(name="check-up-to-date", task_run_name="check-up-to-date")
def find_up_to_date_run(root: str, cfg: Config) -> RunSummary | None:
    """The last run's summary when data, params and code are all as it left them.

    DVC decides what changed (`dvc status`: stage deps are the data source, the params
    and the stages' code); the run itself must have finished and been registered.
    """
    from mlflow.exceptions import MlflowException  # deferred: importing mlflow costs ~1.6 s

    logger = get_run_logger()
    paths = Project(Path(root))
    if not paths.train_result.is_file():
        logger.info("no previous run in this project")
        return None
    changed = stale_stages(paths.root)
    if changed:
        logger.info("changed since the last run: %s", ", ".join(sorted(changed)))
        return None
    run_id = paths.read_train_result()["run_id"]
    mlflow_client = client(default_tracking_uri(paths.root))
    try:
        finished = mlflow_client.get_run(run_id).info.status == "FINISHED"
    except MlflowException:
        finished = False
    registered = is_gated(mlflow_client, cfg.registry.model_name, run_id)
    if not (finished and registered):
        logger.info("run %s is not finished and registered; completing it", run_id)
        return None
    return _summarize(cfg, paths.root, run_id, "skipped")


@task(name="register-model", task_run_name="register-model")
def register_model(root: str, cfg: Config) -> RunSummary:
    """Register the trained model and gate it on the task's metric against its baseline
    and the champion, both on the current test split; first ship what the job left in
    its journal, waiting up to orchestrate.tracking_wait_s for a server that is down."""
    logger = get_run_logger()
    return register_trained(Path(root), cfg, cfg.orchestrate.tracking_wait_s, logger.info)


def register_trained(root: Path, cfg: Config, wait_s: float, say) -> RunSummary:
    """The register step, for the flow and for `gradline sync`: ship every pending
    journal of the project (waiting up to `wait_s`, saying so through `say`), then
    register the trained run's model once and gate it."""
    # Deferred: re-scoring a champion needs torch (~2 s); the rest of the flow runs in
    # this process without it.
    from training.mlops.serving import rescore_champion

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
        lambda uri: rescore_champion(cfg, project.shards, uri, score.metric, tracking_uri),
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
    return _summarize(cfg, project.root, trained["run_id"], "completed", registration.verdict)


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
