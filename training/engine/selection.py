"""Which step's weights become the model, and when validation says to stop.

Every validation is seen by every rank with the same numbers (its metrics are summed
over the data-parallel shares with one all-reduce), so each rank reaches the same verdict
on its own: no collective of its own. The watched metric is the task's gate metric on
validation unless train.early_stopping_metric names another.

The selected step is the best value of the metric seen; min_delta only decides when to
stop (a gain of more than min_delta resets patience). A coarse metric ties often
(accuracy on a few hundred validation rows moves in steps of a fraction of a percent and
saturates early) and the first step to reach a tie is usually the least trained, so a
tie with a lower validation loss takes the selection over.

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
    best_loss: float | None = None  # the tie-breaker: val_loss at best_step
    improved_value: float | None = None  # the metric when it last improved by > min_delta
    waited: int = 0  # validations since the metric last improved by more than min_delta

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
            self.best_loss = saved.get("best_loss")
            self.improved_value = saved.get("improved_value", self.best_value)
            self.waited = int(saved.get("waited", 0))

    def observe(self, metrics: dict[str, float], step: int) -> bool:
        """Count the validation at `step`; True when it becomes the selected step."""
        value, loss = metrics.get(self.metric), metrics.get(TIE_BREAKER)
        if value is None or not math.isfinite(value):
            self.waited += 1  # a validation that cannot be compared is no improvement
            return False
        loss = loss if loss is not None and math.isfinite(loss) else None
        if self.improved_value is None or self._gain(value, self.improved_value) > self.min_delta:
            self.improved_value, self.waited = float(value), 0
        else:
            self.waited += 1
        if self.best_value is None or self._better_than_best(value, loss):
            self._select(value, loss, step)
            return True
        return False

    def _better_than_best(self, value: float, loss: float | None) -> bool:
        assert self.best_value is not None
        gain = self._gain(value, self.best_value)
        return gain > 0 or (gain == 0 and self._lower_loss(loss))

    def _select(self, value: float, loss: float | None, step: int) -> None:
        self.best_value, self.best_loss, self.best_step = float(value), loss, step

    def _gain(self, value: float, over: float) -> float:
        return value - over if self.higher_is_better else over - value

    def _lower_loss(self, loss: float | None) -> bool:
        if self.metric == TIE_BREAKER or loss is None:
            return False
        return self.best_loss is None or loss < self.best_loss

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


TIE_BREAKER = "val_loss"  # every task reports it on validation
_SAVED = ("metric", "best_value", "best_step", "best_loss", "improved_value", "waited")
