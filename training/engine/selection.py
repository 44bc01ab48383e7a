"""Which step's weights become the model, and when validation says to stop.

Every validation is seen by every rank with the same numbers (its metrics are summed
over the data-parallel shares with one all-reduce), so each rank reaches the same verdict
on its own: no collective of its own. The watched metric is the task's gate metric on
validation unless train.early_stopping_metric names another.

The best step's checkpoint is kept on disk whatever runtime.keep_checkpoints says (the
Checkpointer's `pinned` step), and the state here travels in every checkpoint's train
state, so a resumed job still knows the best step and how long it has waited.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from training.config import Config
from training.engine.tracker import Tracker


@dataclass
class Selection:
    metric: str  # e.g. val_accuracy
    higher_is_better: bool
    patience: int | None  # validations without improvement before stopping; None: never
    min_delta: float
    keep_best: bool  # train.select == "best"
    best_value: float | None = None
    best_step: int | None = None
    waited: int = 0  # validations since the best one

    @classmethod
    def for_config(cls, cfg: Config) -> Selection:
        train = cfg.train
        metric, higher = cfg.task.card.validation_metric(train.early_stopping_metric)
        return cls(
            metric,
            higher,
            train.early_stopping_patience,
            train.early_stopping_min_delta,
            keep_best=train.select == "best",
        )

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Continue from a checkpoint's state (none in checkpoints older than selection)."""
        if saved and saved.get("metric") == self.metric:
            self.best_value = saved.get("best_value")
            self.best_step = saved.get("best_step")
            self.waited = int(saved.get("waited", 0))

    def observe(self, metrics: dict[str, float], step: int) -> bool:
        """Count the validation at `step`; True when it is the best so far."""
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(value):
            self.waited += 1  # a validation that cannot be compared is no improvement
            return False
        if self.best_value is None or self._beats(value, self.best_value):
            self.best_value, self.best_step, self.waited = float(value), step, 0
            return True
        self.waited += 1
        return False

    def _beats(self, value: float, best: float) -> bool:
        gain = value - best if self.higher_is_better else best - value
        return gain > self.min_delta

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.waited >= self.patience

    def selected_step(self, last_step: int) -> int:
        """The step whose weights become the model."""
        if self.keep_best and self.best_step is not None:
            return self.best_step
        return last_step

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k in _SAVED}

    def summary(self, last_step: int, stopped_early: bool) -> dict[str, Any]:
        """What the job's result and its MLflow run record about the choice."""
        return {
            "selected_step": self.selected_step(last_step),
            "select": "best" if self.keep_best else "last",
            "watched_metric": self.metric,
            "best_value": self.best_value,
            "best_step": self.best_step,
            "stopped_early": stopped_early,
        }


def record_selection(tracker: Tracker, summary: dict[str, Any], last_step: int) -> None:
    """Tags and metrics on the job's run saying which step became the model (rank 0's
    tracker; the others' are null)."""
    tracker.set_tag("gradline.selected_step", str(summary["selected_step"]))
    tracker.set_tag("gradline.select", summary["select"])
    tracker.set_tag("gradline.watched_metric", summary["watched_metric"])
    tracker.set_tag("gradline.stopped_early", str(summary["stopped_early"]).lower())
    metrics = {"selected_step": float(summary["selected_step"])}
    if summary["best_value"] is not None:
        metrics[f"best_{summary['watched_metric']}"] = float(summary["best_value"])
    tracker.log_metrics(metrics, last_step)


_SAVED = ("metric", "best_value", "best_step", "waited")
