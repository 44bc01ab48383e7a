"""What `gradline compare-updates` reports: one row per update rule and three plots.

Each rule's training (`ChildRun`: its MLflow run, the worker result and metric
histories) becomes a row (samples/s and bytes per step against the reference rule,
final validation loss and its difference, training and wall seconds) and a curve of
validation loss against training seconds, samples and bytes sent.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from training import plots

PLOTS = {
    "seconds": ("val_loss_vs_seconds.png", "training seconds (validation excluded)"),
    "samples": ("val_loss_vs_samples.png", "samples (steps x global batch)"),
    "bytes": ("val_loss_vs_bytes.png", "bytes sent per rank (cumulative)"),
}
COLUMNS = (
    "rule",
    "steps",
    "samples_per_s",
    "throughput_ratio",
    "val_loss",
    "val_loss_delta",
    "comm_bytes_per_step",
    "bytes_ratio",
    "train_seconds",
    "wall_seconds",
    "run_id",
)


@dataclass
class ChildRun:
    """One rule's training: its run, the worker result and the curves from MLflow."""

    rule: str
    run_id: str
    batch_size: int
    result: dict[str, Any]
    wall_seconds: float
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def value(self, key: str) -> float:
        value = self.result.get(key)
        return float(value) if isinstance(value, int | float) else math.nan

    @property
    def steps(self) -> int:
        return int(self.result.get("step", 0))

    @property
    def train_seconds(self) -> float:
        seconds = self.value("train_seconds")
        return seconds if math.isfinite(seconds) else self.value("loop_seconds")

    @property
    def samples_per_s(self) -> float:
        """Samples per second of training (validation and start-up excluded)."""
        seconds, steps = self.value("loop_seconds"), self.value("loop_steps")
        return steps * self.batch_size / seconds if seconds > 0 else math.nan


HISTORY_KEYS = ("val_loss", "train_seconds", "comm_bytes_total", "samples_per_s")


# --- the table ------------------------------------------------------------------------


def _ratio(value: float, reference: float) -> float:
    return value / reference if reference and math.isfinite(reference) else math.nan


def table_rows(children: list[ChildRun], reference: str) -> list[dict[str, Any]]:
    ref = next(c for c in children if c.rule == reference)
    rows = []
    for child in children:
        val, ref_val = child.value("val_loss"), ref.value("val_loss")
        sent, ref_sent = child.value("comm_bytes_per_step"), ref.value("comm_bytes_per_step")
        rows.append(
            {
                "rule": child.rule,
                "steps": child.steps,
                "samples_per_s": child.samples_per_s,
                "throughput_ratio": _ratio(child.samples_per_s, ref.samples_per_s),
                "val_loss": val,
                "val_loss_delta": val - ref_val,
                "comm_bytes_per_step": sent,
                "bytes_ratio": _ratio(sent, ref_sent),
                "train_seconds": child.train_seconds,
                "wall_seconds": child.wall_seconds,
                "run_id": child.run_id,
            }
        )
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.3e}"
    return str(value)


def table_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _headers(reference: str) -> dict[str, str]:
    return {
        "rule": "rule",
        "steps": "steps",
        "samples_per_s": "samples/s",
        "throughput_ratio": f"vs {reference}",
        "val_loss": "val_loss",
        "val_loss_delta": f"Δ vs {reference}",
        "comm_bytes_per_step": "bytes/step",
        "bytes_ratio": f"vs {reference}",
        "train_seconds": "train s",
        "wall_seconds": "wall s",
        "run_id": "MLflow run",
    }


def table_markdown(rows: list[dict[str, Any]], reference: str) -> str:
    headers = _headers(reference)
    lines = [
        "| " + " | ".join(headers[c] for c in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(_cell(row[c]) for c in COLUMNS) + " |" for row in rows),
    ]
    return "\n".join(lines) + "\n"


def table_text(rows: list[dict[str, Any]], reference: str) -> str:
    """The table for a terminal: columns padded to their widest cell."""
    headers = _headers(reference)
    columns = [c for c in COLUMNS if c != "run_id"]
    cells = [[headers[c] for c in columns]] + [[_cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(
            text.ljust(width) if i == 0 else text.rjust(width)
            for i, (text, width) in enumerate(zip(line, widths, strict=True))
        )
        for line in cells
    )


# --- the plots ------------------------------------------------------------------------


def _at_steps(points: list[tuple[int, float]], steps: list[int]) -> list[float]:
    """A cumulative quantity logged at some steps, read at `steps` (linear between
    logged points, starting from 0 at step 0)."""

    xs = [0] + [s for s, _ in points]
    ys = [0.0] + [v for _, v in points]
    return np.interp(steps, xs, ys).tolist()


def _seconds_axis(child: ChildRun) -> list[tuple[int, float]]:
    """Cumulative training seconds by step: the logged `train_seconds`, or, from an
    engine that does not log it, the intervals' step time (batch / samples_per_s)."""
    if child.history.get("train_seconds"):
        return child.history["train_seconds"]
    points, total, previous = [], 0.0, 0
    for step, rate in child.history.get("samples_per_s", []):
        if rate > 0:
            total += (step - previous) * child.batch_size / rate
        points.append((step, total))
        previous = step
    return points


def curves(child: ChildRun) -> dict[str, tuple[list[float], list[float]]]:
    """x-axis name -> (x, validation loss) at the child's validation steps; an axis
    whose quantity the run did not log is left out."""
    val = child.history.get("val_loss", [])
    steps, losses = [s for s, _ in val], [v for _, v in val]
    out = {"samples": ([float(s * child.batch_size) for s in steps], losses)}
    if seconds := _seconds_axis(child):
        out["seconds"] = (_at_steps(seconds, steps), losses)
    if sent := child.history.get("comm_bytes_total"):
        out["bytes"] = (_at_steps(sent, steps), losses)
    return out


def write_plots(children: list[ChildRun], folder: Path, fault: str) -> list[Path]:
    """One PNG per x-axis, a line per rule."""
    drawn = {child.rule: curves(child) for child in children}
    paths = []
    for axis, (name, label) in PLOTS.items():
        fig, axes = plots.figure(6, 4)
        ax, missing = axes[0][0], []
        for rule, lines in drawn.items():
            if axis in lines and lines[axis][0]:
                ax.plot(*lines[axis], "o-", markersize=3, label=rule)
            else:
                missing.append(rule)
        title = f"Validation loss by {label.split(' (')[0]}"
        ax.set(xlabel=label, ylabel="val_loss", title=title + (f"\n{fault}" if fault else ""))
        if missing:
            ax.text(
                0.02,
                0.02,
                f"not logged by: {', '.join(missing)}",
                transform=ax.transAxes,
                fontsize=8,
                color="gray",
            )
        if len(missing) < len(drawn):
            ax.legend()
        path = folder / name
        plots.save(fig, path)
        paths.append(path)
    return paths
