"""Per task: the training loss, the metrics, the baseline and the registry gate's metric.

One object per task type, used by the training loop (loss, validation), the evaluate
stage (test metrics, predictions for plots, baseline) and the registry gate (which metric,
which direction), so what "better" means is decided here and nowhere else.

Metrics are computed from additive statistics: each batch yields a vector of sums
(a confusion matrix, a sum of squared errors, a count of tokens, ...), vectors are added
across batches and across ranks (one all-reduce), and only then turned into ratios. So
the metrics of a split do not depend on how it was cut into batches or ranks.

The baseline is fitted on the train split and scored on the test split through the same
statistics, so `baseline_test_<metric>` is comparable with `test_<metric>`.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from training.data.spec import DataSpec
from training.errors import ConfigError, DataError

TASK_TYPES = ("classification", "regression", "language_modeling")
# Baseline forward passes over token windows materialise (rows, context, vocab) log-probs;
# this bounds one batch of them (float32 elements) to keep memory small.
_LM_BASELINE_ELEMENTS = 1 << 22
_BASELINE_BATCH_ROWS = 4096
_BASELINE_SEED = 0


class Reader(Protocol):
    """What objectives need from a split reader (training.data.loader)."""

    @property
    def num_rows(self) -> int: ...

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


Reduce = Callable[[torch.Tensor], torch.Tensor]
Forward = Callable[[torch.Tensor], torch.Tensor]


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
    predictions: Predictions | None  # None for language models (nothing to plot per row)


class Objective(ABC):
    """Loss, metrics and baseline of one task; see the module docstring."""

    task: str
    gate_metric: str  # the test metric the registry gate compares
    higher_is_better: bool
    metric_names: tuple[str, ...]  # metric keys without their "val_"/"test_" prefix
    num_stats: int  # length of the vector `batch_stats` returns

    @abstractmethod
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The scalar training loss of one batch (a mean, for backward)."""

    @abstractmethod
    def batch_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A 1-D float64 vector of sums over the batch; vectors of batches add up."""

    @abstractmethod
    def metrics(self, stats: torch.Tensor, prefix: str) -> dict[str, float]:
        """`{prefix}_<name>` for every name in `metric_names`, from summed statistics."""

    @abstractmethod
    def baseline(self, train_reader: Reader, test_reader: Reader, max_rows: int) -> dict:
        """`baseline_test_<name>` for every metric name: a simple model fitted on at most
        `max_rows` train rows, scored on the whole test split."""

    def predict(self, output: torch.Tensor) -> torch.Tensor | None:
        """What the evaluate stage plots per row (a class, a value); None if nothing."""
        return None

    @property
    def curve_metric(self) -> str:
        """The validation twin of the gate metric, plotted beside the loss curves."""
        return "val_" + self.gate_metric.removeprefix("test_")

    def beats(self, a: float, b: float) -> bool:
        """Whether metric value `a` is strictly better than `b` in this task's direction."""
        return a > b if self.higher_is_better else a < b

    def score(
        self,
        model: torch.nn.Module,
        reader: Reader,
        rows: np.ndarray,
        batch_size: int,
        device: torch.device | str,
        reduce: Reduce = _identity,
        prefix: str = "test",
    ) -> dict[str, float]:
        """The model's metrics over `rows` of `reader` (the training loop passes an
        all-reduce as `reduce`, so each rank scores its own rows)."""
        return self.score_with_predictions(
            model, reader, rows, batch_size, device, reduce, prefix, keep_predictions=False
        ).metrics

    def score_with_predictions(
        self,
        model: torch.nn.Module | Callable[[torch.Tensor], torch.Tensor | None],
        reader: Reader,
        rows: np.ndarray,
        batch_size: int,
        device: torch.device | str,
        reduce: Reduce = _identity,
        prefix: str = "test",
        keep_predictions: bool = True,
    ) -> Scored:
        """`score`, also keeping the per-row predictions that the evaluate stage plots
        (the predictions are this process's rows only; they are not reduced).

        `model` is a module, or a callable that runs one (a pipeline's ranks other than the
        last stage's get None back and contribute no statistics)."""
        is_module = isinstance(model, torch.nn.Module)
        was_training = model.training if is_module else False
        if is_module:
            model.eval()

        def forward(x: torch.Tensor) -> torch.Tensor | None:
            out = model(x)
            return out.float() if out is not None else None

        try:
            with torch.no_grad():
                return self._accumulate(
                    forward, reader, rows, batch_size, device, reduce, prefix, keep_predictions
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
    ) -> Scored:
        # The one evaluation path: the model and the baselines both go through it.
        # Statistics stay on the device (no sync per batch; NCCL reduces device tensors).
        stats = torch.zeros(self.num_stats, dtype=torch.float64, device=device)
        truths: list[np.ndarray] = []
        preds: list[np.ndarray] = []
        for start in range(0, len(rows), batch_size):
            x, y = reader.gather(rows[start : start + batch_size])
            target = torch.from_numpy(y).to(device)
            output = forward(torch.from_numpy(x).to(device))
            if output is None:
                continue
            stats += self.batch_stats(output, target)
            predicted = self.predict(output) if keep_predictions else None
            if predicted is not None:
                truths.append(y)
                preds.append(predicted.cpu().numpy())
        stats = reduce(stats)
        predictions = None
        if keep_predictions and preds:
            predictions = Predictions(np.concatenate(truths), np.concatenate(preds))
        return Scored(self.metrics(stats.cpu(), prefix), predictions)

    def _score_baseline(
        self, forward: Forward, test_reader: Reader, batch_size: int = _BASELINE_BATCH_ROWS
    ) -> dict[str, float]:
        rows = np.arange(test_reader.num_rows)
        scored = self._accumulate(
            forward, test_reader, rows, batch_size, "cpu", _identity, "test", False
        )
        return {f"baseline_{key}": value for key, value in scored.metrics.items()}


def _ratio(numerator: float, denominator: float) -> float:
    # An empty split gives NaN metrics rather than a ZeroDivisionError mid-run; NaN never
    # beats anything at the gate.
    return numerator / denominator if denominator else math.nan


def _r2(squared_error: float, total: float) -> float:
    """1 - SSE / SST; with constant labels (SST = 0), scikit-learn's convention."""
    if total > 0:
        return 1.0 - squared_error / total
    return 1.0 if squared_error == 0 else 0.0


def _sample_rows(num_rows: int, max_rows: int) -> np.ndarray:
    """At most `max_rows` row indices, the same ones on every run (sorted: cheap reads)."""
    if num_rows <= max_rows:
        return np.arange(num_rows)
    rng = np.random.default_rng(_BASELINE_SEED)
    return np.sort(rng.choice(num_rows, size=max_rows, replace=False))


def _flat_features(reader: Reader, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, y = reader.gather(rows)
    return x.reshape(len(x), -1), y


class ClassificationObjective(Objective):
    task = "classification"
    gate_metric = "test_accuracy"
    higher_is_better = True
    metric_names = ("accuracy", "macro_f1", "loss")

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.num_stats = num_classes * num_classes + 1  # confusion matrix, summed NLL

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), target)

    def predict(self, output: torch.Tensor) -> torch.Tensor:
        return output.argmax(dim=1)

    def batch_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        c = self.num_classes
        # confusion[true, predicted], flattened row-major
        cells = target.long() * c + output.argmax(dim=1)
        confusion = torch.bincount(cells, minlength=c * c).to(torch.float64)
        nll = F.cross_entropy(output.float(), target, reduction="sum").to(torch.float64)
        return torch.cat([confusion, nll.reshape(1)])

    def metrics(self, stats: torch.Tensor, prefix: str) -> dict[str, float]:
        c = self.num_classes
        confusion = stats[: c * c].reshape(c, c).numpy()
        total = confusion.sum()
        true_counts, pred_counts = confusion.sum(axis=1), confusion.sum(axis=0)
        # F1 = 2TP / (2TP + FP + FN) = 2TP / (true + predicted), averaged over the classes
        # that occur among labels or predictions (scikit-learn's macro average).
        present = (true_counts + pred_counts) > 0
        f1 = 2 * np.diag(confusion)[present] / (true_counts + pred_counts)[present]
        return {
            f"{prefix}_accuracy": _ratio(float(np.trace(confusion)), float(total)),
            f"{prefix}_macro_f1": float(f1.mean()) if present.any() else math.nan,
            f"{prefix}_loss": _ratio(float(stats[c * c]), float(total)),
        }

    def baseline(self, train_reader: Reader, test_reader: Reader, max_rows: int) -> dict:
        x, y = _flat_features(train_reader, _sample_rows(train_reader.num_rows, max_rows))
        probabilities = self._fit_logistic_regression(x, y) or self._majority_class(y)
        return self._score_baseline(
            lambda features: self._log_probs(probabilities(features.numpy())), test_reader
        )

    def _fit_logistic_regression(self, x: np.ndarray, y: np.ndarray):
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        pipeline = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500))
        try:
            with warnings.catch_warnings():
                # A baseline that stopped short of convergence is still a fair baseline.
                warnings.simplefilter("ignore", ConvergenceWarning)
                pipeline.fit(x, y)
        except ValueError:  # e.g. a single class in the sample
            return None
        classes = pipeline.classes_.astype(np.int64)

        def probabilities(features: np.ndarray) -> np.ndarray:
            # Classes unseen in the sample get probability 0 (clipped when logged).
            full = np.zeros((len(features), self.num_classes))
            full[:, classes] = pipeline.predict_proba(features.reshape(len(features), -1))
            return full

        return probabilities

    def _majority_class(self, y: np.ndarray):
        # Add-one smoothing keeps the log loss finite for classes absent from the sample;
        # the most frequent class stays the prediction.
        counts = np.bincount(y.astype(np.int64), minlength=self.num_classes) + 1.0
        prior = counts / counts.sum()
        return lambda features: np.broadcast_to(prior, (len(features), self.num_classes))

    @staticmethod
    def _log_probs(probabilities: np.ndarray) -> torch.Tensor:
        # Log-probabilities are logits whose softmax is the probabilities themselves.
        return torch.from_numpy(np.log(np.clip(probabilities, 1e-15, 1.0))).float()


class RegressionObjective(Objective):
    task = "regression"
    gate_metric = "test_rmse"
    higher_is_better = False
    metric_names = ("rmse", "mae", "r2", "loss")
    num_stats = 5  # squared error, absolute error, centred y, centred y^2, count

    def __init__(self, label_mean: float, label_std: float) -> None:
        self.label_mean = label_mean
        # Dividing the MSE by the train labels' variance puts the loss near 1 for a model
        # that predicts the mean, whatever the label's units (learning rates transfer).
        # (Constant train labels leave the loss unscaled rather than divided by zero.)
        self.label_variance = label_std**2 if label_std > 0 else 1.0

    def _flat(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if output.numel() != target.numel():
            raise ConfigError(
                f"a regression model must output one value per row: got output of shape "
                f"{tuple(output.shape)} for {target.numel()} labels; make the model's last "
                "layer produce (batch,) or (batch, 1)"
            )
        return output.reshape(-1), target.reshape(-1)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        prediction, label = self._flat(output, target)
        return F.mse_loss(prediction.float(), label.float()) / self.label_variance

    def predict(self, output: torch.Tensor) -> torch.Tensor:
        return output.reshape(-1)

    def batch_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        prediction, label = (t.double() for t in self._flat(output, target))
        error = prediction - label
        # y is centred on the train mean (a constant, so sums stay additive) to keep
        # sum(y^2) - sum(y)^2 / n from losing precision when the mean is large.
        centred = label - self.label_mean
        count = torch.tensor(float(label.numel()), dtype=torch.float64, device=label.device)
        return torch.stack(
            [error.square().sum(), error.abs().sum(), centred.sum(), centred.square().sum(), count]
        )

    def metrics(self, stats: torch.Tensor, prefix: str) -> dict[str, float]:
        squared, absolute, y_sum, y_square_sum, count = stats.tolist()
        mse = _ratio(squared, count)
        total = y_square_sum - _ratio(y_sum**2, count)  # n * variance of the labels
        return {
            f"{prefix}_rmse": math.sqrt(mse),
            f"{prefix}_mae": _ratio(absolute, count),
            f"{prefix}_r2": _r2(squared, total) if count else math.nan,
            f"{prefix}_loss": mse / self.label_variance,
        }

    def baseline(self, train_reader: Reader, test_reader: Reader, max_rows: int) -> dict:
        from sklearn.linear_model import LinearRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        x, y = _flat_features(train_reader, _sample_rows(train_reader.num_rows, max_rows))
        pipeline = make_pipeline(StandardScaler(), LinearRegression()).fit(x, y.reshape(-1))

        def forward(features: torch.Tensor) -> torch.Tensor:
            flat = features.numpy().reshape(len(features), -1)
            return torch.from_numpy(pipeline.predict(flat)).float()

        return self._score_baseline(forward, test_reader)


class LanguageModelingObjective(Objective):
    task = "language_modeling"
    gate_metric = "test_loss"
    higher_is_better = False
    metric_names = ("loss", "perplexity", "bits_per_token", "bits_per_byte")
    num_stats = 3  # summed NLL in nats, tokens, bytes those tokens stand for

    def __init__(self, vocab_size: int, token_bytes: np.ndarray | None) -> None:
        self.vocab_size = vocab_size
        # Bytes per token id; None is the bytes tokenizer, where every token is one byte.
        self.token_bytes = (
            None if token_bytes is None else torch.as_tensor(token_bytes, dtype=torch.float64)
        )

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))

    def batch_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        flat = target.reshape(-1)
        logits = output.reshape(-1, output.shape[-1]).float()
        nll = F.cross_entropy(logits, flat, reduction="sum").to(torch.float64)
        tokens = torch.tensor(float(flat.numel()), dtype=torch.float64, device=flat.device)
        if self.token_bytes is None:
            byte_count = tokens
        else:
            if self.token_bytes.device != flat.device:
                self.token_bytes = self.token_bytes.to(flat.device)
            byte_count = self.token_bytes[flat].sum()
        return torch.stack([nll, tokens, byte_count])

    def metrics(self, stats: torch.Tensor, prefix: str) -> dict[str, float]:
        nll, tokens, byte_count = stats.tolist()
        loss = _ratio(nll, tokens)
        return {
            f"{prefix}_loss": loss,
            f"{prefix}_perplexity": math.inf if loss > 700 else math.exp(loss),  # no overflow
            f"{prefix}_bits_per_token": loss / math.log(2),
            f"{prefix}_bits_per_byte": _ratio(nll, byte_count) / math.log(2),
        }

    def baseline(self, train_reader: Reader, test_reader: Reader, max_rows: int) -> dict:
        # A unigram model: add-one smoothed token frequencies of the sampled train windows.
        _, targets = train_reader.gather(_sample_rows(train_reader.num_rows, max_rows))
        counts = np.bincount(targets.reshape(-1), minlength=self.vocab_size) + 1.0
        log_probs = torch.from_numpy(np.log(counts / counts.sum())).float()
        context = test_reader.gather(np.arange(1))[0].shape[1] if test_reader.num_rows else 1
        rows_per_batch = max(1, _LM_BASELINE_ELEMENTS // (context * self.vocab_size))
        return self._score_baseline(
            lambda windows: log_probs.expand(*windows.shape, self.vocab_size),
            test_reader,
            rows_per_batch,
        )


# Each task's gate metric, for readers of finished runs (no objective needs building).
GATE_METRICS = {
    objective.task: objective.gate_metric
    for objective in (ClassificationObjective, RegressionObjective, LanguageModelingObjective)
}


def objective_for(
    task_type: str, data: DataSpec, token_bytes: np.ndarray | None = None
) -> Objective:
    """The objective of `task_type` on data described by `data` (from the manifest);
    `token_bytes` (the tokenizer's bytes per id) for language models."""
    if task_type == "classification":
        if not data.num_classes:
            raise DataError(
                "task.type is classification but the shards have no num_classes (float "
                "labels?); set task.type: regression, or re-run ingest and shard"
            )
        return ClassificationObjective(int(data.num_classes))
    if task_type == "regression":
        if data.num_classes is not None or data.kind == "tokens":
            raise DataError(
                f"task.type is regression but the shards hold {data.kind} data with "
                f"{data.num_classes} classes; set task.type to fit data.source, or re-run "
                "ingest and shard"
            )
        mean = data.label_mean if data.label_mean is not None else 0.0
        std = data.label_std if data.label_std is not None else 1.0
        return RegressionObjective(float(mean), float(std))
    if task_type == "language_modeling":
        if data.kind != "tokens" or not data.vocab_size:
            raise DataError(
                f"task.type is language_modeling but the shards hold {data.kind} data; "
                "use a text source (data.source: text or stdlib) and re-run ingest and shard"
            )
        if token_bytes is not None and len(token_bytes) != data.vocab_size:
            raise DataError(
                f"the tokenizer describes {len(token_bytes)} token ids but the shards' "
                f"vocabulary has {data.vocab_size}; re-run shard to rebuild them together"
            )
        return LanguageModelingObjective(int(data.vocab_size), token_bytes)
    raise ConfigError(f"task.type {task_type!r} is not one of {', '.join(TASK_TYPES)}")
