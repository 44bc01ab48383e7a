"""Batch scoring: the `gradline-score` flow and what `gradline score` runs.

score new rows (written aside, swapped in) -> dvc add + push the predictions -> record
an MLflow run linked to the model version. One writer per project: the steps hold the
project lock, as every command that writes the project does. The flow's deployment in
prefect.yaml (`score-daily`) ships with its schedule off.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from tasks.scoring import record_scores, score_new_rows, track_scores
from training.lock import project_lock
from training.project import Project, find_project_root

SUMMARY_KEY = "gradline-score-summary"
# The flow's parameters, as prefect.yaml's deployments give them ("" : the score section's).
PARAMETERS = ("model", "input", "output", "on_bad_rows")


def score_steps(root: Path, call: Callable, **chosen: str) -> str:
    """Score, track, record; `call(task, *args)` runs each step (a task in the flow, its
    plain function from the CLI). Returns the summary text."""
    from training.mlops.scoring import ScoreRequest, describe

    cfg = Project(root).config()
    request = ScoreRequest.from_config(cfg, **{k: v or None for k, v in chosen.items()})
    outcome = call(score_new_rows, str(root), request)
    tracked = call(track_scores, str(root), outcome)
    run_id = call(record_scores, str(root), outcome, tracked)
    return describe(outcome, run_id)


def plain(step, *args):
    """Run a step without Prefect (the CLI)."""
    return step.fn(*args)


@flow(name="gradline-score")
def score(
    model: str = "",
    input: str = "",  # shadows the builtin: the name deployments give
    output: str = "",
    on_bad_rows: str = "",
    root: str | None = None,
) -> str:
    """Predictions of a registered model version on new rows, DVC-tracked and recorded in
    MLflow. Empty parameters take the `score` section of params.yaml.

    model: NAME@ALIAS or NAME/VERSION (default: <registry.model_name>@champion).
    input: the folder (or file) of new rows. output: the predictions' Parquet file.
    on_bad_rows: fail | quarantine.
    """
    project = Path(root).resolve() if root else find_project_root()
    logger = get_run_logger()
    with project_lock(project, say=logger.info):
        summary = score_steps(
            project,
            lambda step, *args: step(*args),
            model=model,
            input=input,
            output=output,
            on_bad_rows=on_bad_rows,
        )
    create_markdown_artifact(
        key=SUMMARY_KEY, markdown=f"```\n{summary}\n```", description="gradline score summary"
    )
    logger.info(summary)
    return summary
