"""Tasks that record results: the model version, whether a run is needed, the summary."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.dvc_stages import run_hosted_stage, stale_stages
from tasks.warm_imports import import_in_background, wait_for_background_imports
from training.config import Config
from training.host_client import STAGE_HOST_ENV, HostRefused
from training.mlops.registration import register_trained
from training.mlops.summary import RunSummary, up_to_date_run
from training.tempdirs import owned_temporary_directory

SUMMARY_KEY = "gradline-run-summary"


@task(name="check-up-to-date", task_run_name="check-up-to-date")
def find_up_to_date_run(root: str, cfg: Config) -> RunSummary | None:
    """The last run's summary when nothing changed since (training.mlops.summary). DVC
    is asked first: a run that changed something never imports MLflow in this process
    (its registration runs in the stage host)."""
    say = get_run_logger().info
    return up_to_date_run(Path(root), cfg, stale_stages, say, changes_first=True)


def prepare_registration() -> None:
    """Without a stage host (registration then runs in this process), import MLflow's
    client and stores (~1 s) in the background now, while the flow's stages run, instead
    of when the flow registers (the first MLflow call of a run that does not skip)."""
    if os.environ.get(STAGE_HOST_ENV):
        return
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
    return register_in_host(Path(root), cfg, get_run_logger().info)


def register_in_host(root: Path, cfg: Config, say: Callable[[str], None]) -> RunSummary:
    """The register step as `gradline stage register`, a fork of the flow's stage host,
    which has MLflow and torch (to re-score a champion) imported: the flow's process,
    which needs neither for anything else, never imports them (~2 s of CPU a run). Its
    output goes to `say`. Without a host, in this process."""
    with owned_temporary_directory("gradline-register-") as tmp:
        summary = Path(tmp) / "summary.json"
        try:
            run_hosted_stage(root, "register", "--summary", str(summary), echo=say)
        except HostRefused:
            wait_for_background_imports()  # MLflow's, queued by prepare_registration
            return register_trained(root, cfg, cfg.orchestrate.tracking_wait_s, say)
        return RunSummary(**json.loads(summary.read_text()))


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
