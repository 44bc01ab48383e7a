"""Regression: a numeric label per row, the model outputs one value.

The model learns standardized targets and its output is mapped back into the label's
units inside the model (training.models.standardize), from the train split's label
statistics. Loss: MSE over the train labels' variance (near 1 for a model that predicts
the mean, whatever the units, so learning rates transfer). Metrics: RMSE, MAE, R², loss.
Baseline: linear regression. Gate: test_rmse, lower is better. The registered model
returns values in the label's units; evaluation draws predicted against actual.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from training import plots
from training.data.spec import DataSpec
from training.errors import ConfigError, DataError
from training.objectives import TASKS, base
from training.objectives.base import Predictions, Reader, ratio
from training.objectives.bootstrap import Bootstrap


class Objective(base.Objective):
    name = "regression"
    metric_names = TASKS["regression"].metric_names
    num_stats = 5  # squared error, absolute error, centred y, centred y^2, count
    prediction_dtype = np.float32

    def __init__(self, data: DataSpec) -> None:
        super().__init__(data)
        self.label_mean = float(data.label_mean if data.label_mean is not None else 0.0)
        self.label_std = float(data.label_std if data.label_std is not None else 1.0)
        # (Constant train labels leave the loss unscaled rather than divided by zero.)
        self.label_variance = self.label_std**2 if self.label_std > 0 else 1.0

    @classmethod
    def for_data(cls, data: DataSpec, tokenizer: Any = None) -> Objective:
        if data.num_classes is not None or data.kind == "tokens":
            raise DataError(
                f"task.type is regression but the shards hold {data.kind} data with "
                f"{data.num_classes} classes; set task.type to fit data.source, or re-run "
                "ingest and shard"
            )
        return cls(data)

    @property
    def output_size(self) -> int:
        return 1

    def output_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (input_shape[0],)  # (B, 1) outputs are flattened by the label scaling

    def label_scaling(self) -> tuple[float, float]:
        return self.label_mean, self.label_std

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

    def row_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        prediction, label = (t.double() for t in self._flat(output, target))
        error = prediction - label
        centred = label - self.label_mean
        ones = torch.ones_like(label)
        return torch.stack([error.square(), error.abs(), centred, centred.square(), ones], 1)

    def metrics(self, stats: torch.Tensor, prefix: str) -> dict[str, float]:
        squared, absolute, y_sum, y_square_sum, count = stats.tolist()
        mse = ratio(squared, count)
        total = y_square_sum - ratio(y_sum**2, count)  # n * variance of the labels
        return {
            f"{prefix}_rmse": math.sqrt(mse),
            f"{prefix}_mae": ratio(absolute, count),
            f"{prefix}_r2": _r2(squared, total) if count else math.nan,
            f"{prefix}_loss": mse / self.label_variance,
        }

    def baseline(
        self,
        train_reader: Reader,
        test_reader: Reader,
        max_rows: int,
        bootstrap: Bootstrap | None = None,
    ) -> dict:
        # Deferred: scikit-learn takes ~2 s to import, and every training worker imports
        # this module, though only the evaluate stage fits a baseline.
        from sklearn.linear_model import LinearRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        x, y = base.flat_features(train_reader, base.sample_rows(train_reader.num_rows, max_rows))
        pipeline = make_pipeline(StandardScaler(), LinearRegression()).fit(x, y.reshape(-1))

        def forward(features: torch.Tensor) -> torch.Tensor:
            flat = features.numpy().reshape(len(features), -1)
            return torch.from_numpy(pipeline.predict(flat)).float()

        return self.score_baseline(forward, test_reader, bootstrap=bootstrap)

    plot_file = "predicted_vs_actual.png"

    def plot(self, predictions: Predictions, out: Path) -> None:
        plot_predicted_vs_actual(predictions, out)


def _r2(squared_error: float, total: float) -> float:
    """1 - SSE / SST; with constant labels (SST = 0), scikit-learn's convention."""
    if total > 0:
        return 1.0 - squared_error / total
    return 1.0 if squared_error == 0 else 0.0


def plot_predicted_vs_actual(pred: Predictions, out: Path) -> None:
    """One point per test row; a perfect model lies on the diagonal."""
    actual, predicted = pred.y_true.reshape(-1), pred.y_pred.reshape(-1)
    fig, axes = plots.figure(5, 5)
    ax = axes[0][0]
    ax.scatter(actual, predicted, s=8, alpha=0.6)
    if len(actual):
        low = float(min(actual.min(), predicted.min()))
        high = float(max(actual.max(), predicted.max()))
        ax.plot([low, high], [low, high], "k--", linewidth=1, label="predicted = actual")
        ax.legend()
    ax.set(xlabel="actual", ylabel="predicted", title="Predicted vs actual (test split)")
    plots.save(fig, out)
