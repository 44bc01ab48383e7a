"""What every task shares: additive scoring, the baseline's scoring, serving rows.

A task module subclasses `Objective` and fills in its loss, its batch statistics and
the metrics they make, its baseline, the output the model must produce, and what a run
shows. Everything else here is shared:

Metrics are computed from additive statistics: each batch yields a vector of sums
(a confusion matrix, a sum of squared errors, a count of tokens, ...), vectors are added
across batches and across ranks (one all-reduce), and only then turned into ratios. So
the metrics of a split do not depend on how it was cut into batches or ranks. The
loop's validation, the evaluate stage and the champion's re-scoring all go through
`score`, and the baselines through the same accumulation, so `baseline_test_<metric>`
is comparable with `test_<metric>`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from torch import nn

from training import plots
from training.data.spec import DataSpec
from training.objectives import TASKS, Generation, TaskCard
from training.objectives.bootstrap import Bootstrap

# Rows per forward pass when the registered model predicts: bounds memory on big inputs.
PREDICT_BATCH_ROWS = 1024
BASELINE_BATCH_ROWS = 4096
_BASELINE_SEED = 0


class Reader(Protocol):
    """What objectives need from a split reader (training.data.loader)."""

    @property
    def num_rows(self) -> int: ...

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


Reduce = Callable[[torch.Tensor], torch.Tensor]
Forward = Callable[[torch.Tensor], torch.Tensor | None]


def _identity(stats: torch.Tensor) -> torch.Tensor:
    return stats


@dataclass(frozen=True)
class Predictions:
    """Labels and predictions of a split, in row order, for the evaluate stage's plots."""

    y_true: np.ndarray
    y_pred: np.ndarray


@dataclass(frozen=True)
class Scored:
    metrics: dict[str, float]
    predictions: Predictions | None  # None for tasks with nothing to plot per row


class Objective(ABC):
    """One task: see the module docstring. Built for the data it learns (`for_data`)."""

    name: ClassVar[str]  # the task's name, its key in training.objectives.TASKS
    metric_names: ClassVar[tuple[str, ...]]  # metric keys without "val_"/"test_"
    num_stats: int  # length of the vector `batch_stats` returns
    prediction_dtype: ClassVar[type | None] = None  # per-row predictions, if any

    def __init__(self, data: DataSpec) -> None:
        self.data = data

    @classmethod
    @abstractmethod
    def for_data(cls, data: DataSpec, tokenizer: Any = None) -> Objective:
        """The objective for this data; DataError naming the fix when it cannot learn it."""

    # --- the task's declaration (training.objectives.TASKS) ------------------------------

    @property
    def card(self) -> TaskCard:
        return TASKS[self.name]

    @property
    def gate_metric(self) -> str:
        return self.card.gate_metric

    @property
    def higher_is_better(self) -> bool:
        return self.card.higher_is_better

    @property
    def curve_metric(self) -> str:
        """The validation twin of the gate metric, plotted beside the loss curves."""
        return "val_" + self.gate_metric.removeprefix("test_")

    def beats(self, a: float, b: float) -> bool:
        """Whether metric value `a` is strictly better than `b` in this task's direction."""
        return a > b if self.higher_is_better else a < b

    # --- what the model must produce ----------------------------------------------------

    @property
    @abstractmethod
    def output_size(self) -> int:
        """Outputs per example (per token for token streams) the model must produce."""

    def output_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The output the model must produce for a batch of this shape."""
        return (input_shape[0], self.output_size)

    def label_scaling(self) -> tuple[float, float] | None:
        """(mean, std) the model's output is mapped back through into the label's units,
        or None (training.models.standardize)."""
        return None

    # --- training and scoring -----------------------------------------------------------

    @abstractmethod
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The scalar training loss of one batch (a mean, for backward)."""

    @abstractmethod
    def batch_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A 1-D float64 vector of sums over the batch; vectors of batches add up."""

    def row_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """`batch_stats` of each row on its own, (rows, num_stats), dense or sparse COO:
        what the bootstrap resamples (objectives/bootstrap.py). Summed over rows it is
        `batch_stats`. This one scores row by row; tasks override it with one pass."""
        rows = [self.batch_stats(output[i : i + 1], target[i : i + 1]) for i in range(len(target))]
        return torch.stack(rows) if rows else torch.zeros(0, self.num_stats, dtype=torch.float64)

    @abstractmethod
    def metrics(self, stats: torch.Tensor, prefix: str) -> dict[str, float]:
        """`{prefix}_<name>` for every name in `metric_names`, from summed statistics."""

    @abstractmethod
    def baseline(
        self,
        train_reader: Reader,
        test_reader: Reader,
        max_rows: int,
        bootstrap: Bootstrap | None = None,
    ) -> dict:
        """`baseline_test_<name>` for every metric name: a simple model fitted on at most
        `max_rows` train rows, scored on the whole test split (with `bootstrap`, its
        intervals recorded there too: see `score_baseline`)."""

    def predict(self, output: torch.Tensor) -> torch.Tensor | None:
        """What one row's output predicts (a class, a value); None if nothing per row."""
        return None

    def score(
        self,
        model: nn.Module | Forward,
        reader: Reader,
        rows: np.ndarray,
        batch_size: int,
        device: torch.device | str,
        reduce: Reduce = _identity,
        prefix: str = "test",
        keep_predictions: bool = False,
        bootstrap: Bootstrap | None = None,
    ) -> Scored:
        """The model's metrics over `rows` of `reader` (the training loop passes an
        all-reduce as `reduce`, so each rank scores its own rows), and with
        `keep_predictions` the per-row predictions the evaluate stage plots (this
        process's rows only; they are not reduced). With `bootstrap` (one process, all
        rows: the evaluate stage), the metrics' intervals are recorded in it.

        `model` is a module, or a callable that runs one (a pipeline's ranks other than the
        last stage's get None back and contribute no statistics)."""
        is_module = isinstance(model, nn.Module)
        was_training = model.training if is_module else False
        if is_module:
            model.eval()

        def forward(x: torch.Tensor) -> torch.Tensor | None:
            out = model(x)
            return out.float() if out is not None else None

        try:
            with torch.no_grad():
                return self._accumulate(
                    forward,
                    reader,
                    rows,
                    batch_size,
                    device,
                    reduce,
                    prefix,
                    keep_predictions,
                    bootstrap,
                )
        finally:
            if is_module:
                model.train(was_training)

    def _accumulate(
        self,
        forward: Forward,
        reader: Reader,
        rows: np.ndarray,
        batch_size: int,
        device: torch.device | str,
        reduce: Reduce,
        prefix: str,
        keep_predictions: bool,
        bootstrap: Bootstrap | None = None,
        rename: str = "",
    ) -> Scored:
        # The one evaluation path: the model and the baselines both go through it.
        # Statistics stay on the device (no sync per batch; NCCL reduces device tensors).
        stats = torch.zeros(self.num_stats, dtype=torch.float64, device=device)
        resamples = bootstrap.start(self.num_stats) if bootstrap is not None else None
        truths: list[np.ndarray] = []
        preds: list[np.ndarray] = []
        for start in range(0, len(rows), batch_size):
            x, y = reader.gather(rows[start : start + batch_size])
            target = torch.from_numpy(y).to(device)
            output = forward(torch.from_numpy(x).to(device))
            if output is None:
                continue
            stats += self.batch_stats(output, target)
            if resamples is not None:
                resamples.add(self.row_stats(output, target).cpu())
            predicted = self.predict(output) if keep_predictions else None
            if predicted is not None:
                truths.append(y)
                preds.append(predicted.cpu().numpy())
        stats = reduce(stats)
        if bootstrap is not None:
            bootstrap.record(resamples, self.metrics, prefix, rename)
        predictions = None
        if keep_predictions and preds:
            predictions = Predictions(np.concatenate(truths), np.concatenate(preds))
        return Scored(self.metrics(stats.cpu(), prefix), predictions)

    def score_baseline(
        self,
        forward: Forward,
        test_reader: Reader,
        batch_size: int = BASELINE_BATCH_ROWS,
        bootstrap: Bootstrap | None = None,
    ) -> dict[str, float]:
        """`baseline_test_<metric>` of a baseline's forward over the whole test split; with
        `bootstrap`, their intervals under the same keys (the same seed as the model's:
        the same resamples of the same rows)."""
        rows = np.arange(test_reader.num_rows)
        scored = self._accumulate(
            forward,
            test_reader,
            rows,
            batch_size,
            "cpu",
            _identity,
            "test",
            False,
            bootstrap,
            rename="baseline_",
        )
        return {f"baseline_{key}": value for key, value in scored.metrics.items()}

    # --- what a run shows ---------------------------------------------------------------

    def per_class(self, predictions: Predictions | None) -> dict[str, list[float]]:
        """Per-class figures of the test split for the model card ({} for tasks without
        classes): classification gives each class's recall and support."""
        return {}

    # The task's plot of its per-row predictions under the evaluate stage's plots/.
    plot_file: ClassVar[str | None] = None

    def artifacts(
        self,
        model: nn.Module,
        scored: Scored,
        plots_dir: Path,
        generation: Generation,
        context: int | None,
    ) -> list[Path]:
        """The evaluate stage's files under `plots_dir` (plots, predictions, samples);
        returns the ones to log with the run. `context`: a token model's window, for
        sampling. Tasks with a prediction per row write predictions.json (what DVC plots
        read) and their plot of it."""
        if scored.predictions is None or self.plot_file is None:
            return []
        predictions = scored.predictions
        plots.write_predictions(
            predictions.y_true, predictions.y_pred, plots_dir / "predictions.json"
        )
        image = plots_dir / self.plot_file
        self.plot(predictions, image)
        return [image]

    def plot(self, predictions: Predictions, out: Path) -> None:
        """Draw the task's plot of the test split's predictions (see `plot_file`)."""
        raise NotImplementedError(f"{type(self).__name__} names a plot_file but draws none")

    def sampler(
        self, generation: Generation, context: int | None
    ) -> Callable[[nn.Module], str] | None:
        """For generative tasks, what each validation logs beside its metrics: samples
        of what the model writes as it learns. None for the others."""
        return None

    # --- the registered model -----------------------------------------------------------

    def serve(self, model: nn.Module, model_input: Any, params: dict | None = None) -> Any:
        """Predictions on raw inputs (what the pyfunc model returns): rows -> one
        prediction each, in batches."""
        rows = self.features(model_input)
        outputs = [np.zeros(0, dtype=self.prediction_dtype)]
        with torch.no_grad():
            for start in range(0, len(rows), PREDICT_BATCH_ROWS):
                out = model(torch.from_numpy(rows[start : start + PREDICT_BATCH_ROWS]))
                outputs.append(self.predicted(out))
        return np.concatenate(outputs)

    def check_scores_rows(self) -> None:
        """Raise ConfigError naming what to do instead when the registered model does not
        predict row by row (what `gradline score` does); tasks that do pass."""
        return None

    def predicted(self, output: torch.Tensor) -> np.ndarray:
        """A batch of model outputs as the registered model returns them, one per row."""
        return self.predict(output.float()).numpy().astype(self.prediction_dtype)

    def prediction_columns(self, output: torch.Tensor) -> dict[str, np.ndarray]:
        """A batch of model outputs as the columns `gradline score` writes: `prediction`
        (what `serve` returns for the row) and what else the task knows per row."""
        return {"prediction": self.predicted(output)}

    def features(self, model_input: Any) -> np.ndarray:
        """Rows as float32 (N, *feature_shape): a DataFrame (columns by name where they
        carry the feature names, else in order) or an array, flattened or not."""
        import pandas as pd  # deferred: pandas is needed only where a model serves

        shape = tuple(self.data.feature_shape)
        if isinstance(model_input, pd.DataFrame):
            names = self.data.column_names
            if set(names) <= set(model_input.columns):
                model_input = model_input[names]
            model_input = model_input.to_numpy()
        rows = np.asarray(model_input, dtype=np.float32)
        if rows.ndim < 2 or math.prod(rows.shape[1:]) != math.prod(shape):
            raise ValueError(
                f"expected rows of {math.prod(shape)} features (shape {list(shape)}), got "
                f"an input of shape {list(rows.shape)}"
            )
        return rows.reshape(len(rows), *shape)

    def signature(self, generation: Generation):
        """The registered model's MLflow signature and input example: a table's named
        columns or an image array in, one prediction per row out."""
        # Deferred: mlflow is an optional dependency of a training machine.
        import pandas as pd
        from mlflow.models import ModelSignature
        from mlflow.types import ColSpec, Schema, TensorSpec

        data, rows = self.data, self.data.example()
        output = TensorSpec(np.dtype(self.prediction_dtype), (-1,))
        if data.kind == "table":
            names = data.column_names
            inputs = Schema([ColSpec("double", name) for name in names])
            example = pd.DataFrame(rows.reshape(len(rows), -1).astype(np.float64), columns=names)
        else:
            inputs = Schema([TensorSpec(np.dtype(np.float32), (-1, *data.feature_shape))])
            example = rows
        return ModelSignature(inputs=inputs, outputs=Schema([output])), example


def ratio(numerator: float, denominator: float) -> float:
    # An empty split gives NaN metrics rather than a ZeroDivisionError mid-run; NaN never
    # beats anything at the gate.
    return numerator / denominator if denominator else math.nan


def sample_rows(num_rows: int, max_rows: int) -> np.ndarray:
    """At most `max_rows` row indices, the same ones on every run (sorted: cheap reads)."""
    if num_rows <= max_rows:
        return np.arange(num_rows)
    rng = np.random.default_rng(_BASELINE_SEED)
    return np.sort(rng.choice(num_rows, size=max_rows, replace=False))


def flat_features(reader: Reader, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, y = reader.gather(rows)
    return x.reshape(len(x), -1), y
