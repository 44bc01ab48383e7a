"""What a sweep reports: the trials table, three plots and the best trial, on the parent.

The table has one row per trial (number, state, the metric, steps run and planned, its
keys, its MLflow run); the totals say how many trial-steps pruning saved (steps run /
steps the same trials would have run to the end). The plots are Optuna's matplotlib
figures: the metric by trial, the parameter importances (from two complete trials on),
and parallel coordinates. Everything is rewritten after each run of the sweep, so the
parent always shows the whole study.
"""

from __future__ import annotations

import csv
import io
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from training import plots
from training.mlops.sweep.plan import SweepPlan
from training.mlops.sweep.study import BASELINE, best_trial, interrupted
from training.mlops.tracking import client

ARTIFACTS = "sweep"  # the parent's artifact folder
TABLE_CSV, TABLE_MD = "trials.csv", "trials.md"
PLOTS = {
    "history": "metric_by_trial.png",
    "importances": "param_importances.png",
    "parallel": "parallel_coordinates.png",
}
# Trial attributes the driver sets as each trial ends.
STEPS, PLANNED, RUN_ID, MESSAGE = "steps", "planned_steps", "run_id", "message"
STATES = {
    TrialState.COMPLETE: "complete",
    TrialState.PRUNED: "pruned",
    TrialState.FAIL: "failed",
    TrialState.RUNNING: "running",
}


def trial_rows(study: optuna.Study, plan: SweepPlan) -> list[dict[str, Any]]:
    stopped = interrupted(study)
    rows = []
    for trial in study.get_trials(deepcopy=False):
        if trial.state not in STATES:
            continue  # waiting: enqueued for the next run
        state = STATES[trial.state]
        if trial.state == TrialState.FAIL and trial.number in stopped:
            state = "interrupted"
        attrs = trial.user_attrs
        rows.append(
            {
                "trial": trial.number,
                "state": state,
                plan.metric: trial.value if trial.value is not None else math.nan,
                "steps": attrs.get(STEPS, 0),
                "planned_steps": attrs.get(PLANNED, 0),
                **{key: trial.params.get(key) for key in plan.space},
                "baseline": bool(attrs.get(BASELINE)),
                "run_id": attrs.get(RUN_ID) or "",
            }
        )
    return rows


@dataclass(frozen=True)
class Totals:
    trials: int
    complete: int
    pruned: int
    failed: int
    interrupted: int
    steps_run: int  # by trials that ended (an interrupted one's steps count in its resume)
    steps_planned: int

    @property
    def pruning_saved(self) -> float:
        """The share of the ended trials' planned steps that were not run."""
        return 1 - self.steps_run / self.steps_planned if self.steps_planned else 0.0


def totals(rows: list[dict[str, Any]]) -> Totals:
    ended = [r for r in rows if r["state"] in ("complete", "pruned", "failed")]
    count = {s: sum(r["state"] == s for r in rows) for s in STATES.values()}
    return Totals(
        trials=len(rows),
        complete=count["complete"],
        pruned=count["pruned"],
        failed=count["failed"],
        interrupted=sum(r["state"] == "interrupted" for r in rows),
        steps_run=sum(int(r["steps"]) for r in ended),
        steps_planned=sum(int(r["planned_steps"]) for r in ended),
    )


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return "" if value is None else str(value)


def table_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    if rows:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return out.getvalue()


def table_text(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """The table for a terminal (padded columns) or as markdown."""
    if not rows:
        return "(no trials yet)"
    columns = [c for c in rows[0] if c != "run_id" or markdown]
    cells = [columns] + [[_cell(r[c]) for c in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(line) + " |" for line in cells]
        return "\n".join([lines[0], "|" + "---|" * len(columns), *lines[1:]]) + "\n"
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(text.rjust(width) for text, width in zip(line, widths, strict=True))
        for line in cells
    )


def write_plots(study: optuna.Study, folder: Path, metric: str) -> list[Path]:
    """The figures the study has enough trials for (none before a trial completed)."""
    import matplotlib

    matplotlib.use("Agg")  # off-screen: Optuna draws through pyplot
    from optuna.visualization import matplotlib as figures

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    wanted = {"history": figures.plot_optimization_history}
    if len(complete) >= 2:
        wanted["importances"] = figures.plot_param_importances
        wanted["parallel"] = figures.plot_parallel_coordinate
    if not complete:
        return []
    paths = []
    with warnings.catch_warnings():  # Optuna marks its matplotlib figures experimental
        warnings.simplefilter("ignore")
        for kind, draw in wanted.items():
            axes = draw(study, target_name=metric)
            figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
            figure.set_size_inches(8, 5)
            path = folder / PLOTS[kind]
            plots.save(figure, path)
            paths.append(path)
    return paths


def log_to_parent(
    uri: str,
    parent_id: str,
    plan: SweepPlan,
    study: optuna.Study,
    rows: list[dict[str, Any]],
    files: list[Path],
) -> None:
    """The table and plots as artifacts; the best trial's value as a metric and its keys
    as tags (params could not change when a later run finds a better trial)."""
    from mlflow.entities import Metric, RunTag  # deferred: mlflow is optional in training/

    mlflow_client = client(uri)
    total = totals(rows)
    stamp, step = int(time.time() * 1000), total.trials
    values = {
        "trials_complete": total.complete,
        "trials_pruned": total.pruned,
        "trials_failed": total.failed,
        "trial_steps_run": total.steps_run,
        "trial_steps_planned": total.steps_planned,
        "pruning_saved_fraction": total.pruning_saved,
    }
    tags = {}
    if (best := best_trial(study)) is not None:
        values[f"best_{plan.metric}"] = best.value
        tags["gradline.sweep.best_trial"] = str(best.number)
        tags["gradline.sweep.best_run_id"] = best.user_attrs.get(RUN_ID, "")
        tags |= {f"gradline.sweep.best.{k}": str(v) for k, v in best.params.items()}
    metrics = [Metric(k, float(v), stamp, step) for k, v in values.items()]
    mlflow_client.log_batch(
        parent_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()]
    )
    for path in files:
        mlflow_client.log_artifact(parent_id, str(path), ARTIFACTS)


def write_report(
    uri: str, parent_id: str, plan: SweepPlan, study: optuna.Study
) -> list[dict[str, Any]]:
    """Table and plots into the sweep's folder and onto the parent run; the rows."""
    rows = trial_rows(study, plan)
    folder = plan.folder
    (folder / TABLE_CSV).write_text(table_csv(rows))
    (folder / TABLE_MD).write_text(table_text(rows, markdown=True))
    files = [folder / TABLE_CSV, folder / TABLE_MD, *write_plots(study, folder, plan.metric)]
    log_to_parent(uri, parent_id, plan, study, rows, files)
    return rows
