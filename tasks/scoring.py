"""Tasks of `gradline score`: score new rows, track the outputs with DVC, record the run.

The CLI calls the same functions without Prefect (`.fn`), the `gradline-score` flow as
tasks. training.mlops.scoring (which loads torch and mlflow) is imported inside them, so
importing this module for a deployment costs nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from prefect import get_run_logger, task
from prefect.exceptions import MissingContextError
from prefect.runtime import flow_run

from tasks.dvc_stages import PUSH_RETRIES, push_to_remote, run_dvc
from training.config.loading import safe_load
from training.project import Project


def _say() -> Callable[[str], None]:
    """The task's log inside a flow run; stderr for the CLI (stdout is its summary)."""
    try:
        return get_run_logger().info
    except MissingContextError:
        return lambda line: print(line, file=sys.stderr, flush=True)


@task(name="score-new-rows", task_run_name="score-new-rows")
def score_new_rows(root: str, request):
    """Predictions of the requested version on the new rows (training.mlops.scoring)."""
    from training.mlops.scoring import score_new_rows as score

    project = Project(Path(root))
    outcome = score(project.root, project.config(), request, project.tracking_uri)
    _say()(
        f"scored {outcome.rows_scored} rows with {outcome.model} into {outcome.output} "
        f"({outcome.rows_quarantined} quarantined)"
    )
    return outcome


@task(name="dvc-track-scores", task_run_name="dvc-track-scores", **PUSH_RETRIES)
def track_scores(root: str, outcome) -> dict[str, str]:
    """`dvc add` the predictions and their quarantine file (each gets a .dvc file to
    commit), push them to the default remote, and return their DVC md5s by path."""
    say, project = _say(), Path(root)
    paths = [outcome.output, outcome.quarantine]
    run_dvc(project, "add", *paths, echo=say)
    push_to_remote(project, *(f"{path}.dvc" for path in paths), echo=say)
    return {path: dvc_md5(project / f"{path}.dvc") for path in paths}


def dvc_md5(dvc_file: Path) -> str:
    """The md5 a .dvc file records for its output."""
    document = safe_load(dvc_file.read_text()) or {}
    return str(document["outs"][0]["md5"])


@task(name="record-score-run", task_run_name="record-score-run")
def record_scores(root: str, outcome, tracked: dict[str, str]) -> str:
    """The MLflow run that links the predictions to the model version; its id."""
    from training.mlops.scoring import record_score_run

    project = Project(Path(root))
    run_id = record_score_run(project.root, project.tracking_uri, outcome, tracked, flow_run.id)
    _say()(f"recorded MLflow run {run_id}")
    return run_id
