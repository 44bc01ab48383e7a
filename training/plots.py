"""Figures and tables a run shows, drawn the same way for every task.

Task modules (training.objectives) draw their own plots with these helpers; the
training curves of any task are here. matplotlib renders off-screen (no display on
training machines).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from training.atomic import write_json


def figure(width: float, height: float, columns: int = 1):
    """A figure and its row of axes. Drawn off-screen with matplotlib's Agg renderer,
    without pyplot: pyplot's figure manager and backends (~0.2 s more to import) serve
    windows, which no training machine shows. Imported on first use (~0.3 s): every
    training worker imports the task modules that draw with it, though only evaluation
    draws."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, columns, squeeze=False)


def save(fig, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:  # a figure pyplot made (Optuna's) is held there until closed
        pyplot.close(fig)


def write_predictions(y_true: np.ndarray, y_pred: np.ndarray, out: Path) -> None:
    """Rows of {actual, predicted}, the data behind a task's plot (DVC plots read it)."""
    pairs = zip(y_true.reshape(-1).tolist(), y_pred.reshape(-1).tolist(), strict=True)
    write_json(out, [{"actual": actual, "predicted": predicted} for actual, predicted in pairs])


def plot_loss_curves(
    history: dict[str, list[tuple[int, float]]], out: Path, metric: str | None = "val_accuracy"
) -> None:
    """Training and validation loss by step, and beside them the task's validation
    `metric` (e.g. the objective's `curve_metric`) unless it is the loss itself."""
    second = metric is not None and metric != "val_loss"
    fig, axes = figure(10 if second else 5, 4, 2 if second else 1)
    loss_ax = axes[0][0]
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        if history.get(key):
            steps, values = zip(*history[key], strict=True)
            loss_ax.plot(steps, values, style, label=key, markersize=3)
    loss_ax.set(xlabel="step", ylabel="loss", title="Loss", yscale="log")
    loss_ax.legend()
    if second:
        metric_ax = axes[0][1]
        if history.get(metric):
            steps, values = zip(*history[metric], strict=True)
            metric_ax.plot(steps, values, "o-", label=metric, markersize=3)
            metric_ax.legend()
        name = metric.removeprefix("val_")
        metric_ax.set(xlabel="step", ylabel=name, title=f"Validation {name}")
    save(fig, out)
