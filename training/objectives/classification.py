"""Classification: integer labels in 0..num_classes-1, the model outputs one logit each.

Loss: cross-entropy. Metrics from a confusion matrix and the summed log loss:
accuracy, macro F1, log loss. Baseline: logistic regression on standardized features
(the majority class when it cannot be fitted). Gate: test_accuracy, higher is better.
The registered model returns class ids; evaluation draws the confusion matrix.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from training import plots
from training.data.spec import DataSpec
from training.errors import DataError
from training.objectives import TASKS, base
from training.objectives.base import Predictions, Reader, ratio
from training.objectives.bootstrap import Bootstrap


class Objective(base.Objective):
    name = "classification"
    metric_names = TASKS["classification"].metric_names
    prediction_dtype = np.int64

    def __init__(self, data: DataSpec) -> None:
        super().__init__(data)
        self.num_classes = int(data.num_classes)
        self.num_stats = self.num_classes**2 + 1  # confusion matrix, summed NLL

    @classmethod
    def for_data(cls, data: DataSpec, tokenizer: Any = None) -> Objective:
        if not data.num_classes:
            raise DataError(
                "task.type is classification but the shards have no num_classes (float "
                "labels?); set task.type: regression, or re-run ingest and shard"
            )
        return cls(data)

    @property
    def output_size(self) -> int:
        return self.num_classes

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), target)

    def predict(self, output: torch.Tensor) -> torch.Tensor:
        return output.argmax(dim=1)

    def prediction_columns(self, output: torch.Tensor) -> dict[str, np.ndarray]:
        """The class and each class's probability (`prob_<class>`, softmax of the logits)."""
        columns = super().prediction_columns(output)
        probabilities = torch.softmax(output.float(), dim=1).numpy()
        columns.update({f"prob_{k}": probabilities[:, k] for k in range(self.num_classes)})
        return columns

    def batch_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        c = self.num_classes
        # confusion[true, predicted], flattened row-major
        cells = target.long() * c + output.argmax(dim=1)
        confusion = torch.bincount(cells, minlength=c * c).to(torch.float64)
        nll = F.cross_entropy(output.float(), target, reduction="sum").to(torch.float64)
        return torch.cat([confusion, nll.reshape(1)])

    def row_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Each row adds 1 to one confusion cell and its NLL to the last statistic: two
        # non-zeros in a row of c*c+1, so sparse (a dense one grows with classes squared).
        c, rows = self.num_classes, len(target)
        cells = target.long() * c + output.argmax(dim=1)
        nll = F.cross_entropy(output.float(), target, reduction="none").to(torch.float64)
        index = torch.arange(rows, device=target.device).repeat(2)
        columns = torch.cat([cells, torch.full_like(cells, c * c)])
        values = torch.cat([torch.ones(rows, dtype=torch.float64, device=nll.device), nll])
        return torch.sparse_coo_tensor(
            torch.stack([index, columns]), values, (rows, self.num_stats), check_invariants=False
        )

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
            f"{prefix}_accuracy": ratio(float(np.trace(confusion)), float(total)),
            f"{prefix}_macro_f1": float(f1.mean()) if present.any() else math.nan,
            f"{prefix}_loss": ratio(float(stats[c * c]), float(total)),
        }

    def baseline(
        self,
        train_reader: Reader,
        test_reader: Reader,
        max_rows: int,
        bootstrap: Bootstrap | None = None,
    ) -> dict:
        x, y = base.flat_features(train_reader, base.sample_rows(train_reader.num_rows, max_rows))
        probabilities = self._fit_logistic_regression(x, y) or self._majority_class(y)
        return self.score_baseline(
            lambda features: _log_probs(probabilities(features.numpy())),
            test_reader,
            bootstrap=bootstrap,
        )

    def _fit_logistic_regression(self, x: np.ndarray, y: np.ndarray):
        # Deferred: scikit-learn takes ~2 s to import, and every training worker imports
        # this module, though only the evaluate stage fits a baseline.
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

    plot_file = "confusion_matrix.png"

    def per_class(self, predictions: Predictions | None) -> dict[str, list[float]]:
        """Each class's recall (NaN for a class absent from the split) and support."""
        if predictions is None:
            return {}
        true = predictions.y_true.astype(np.int64)
        hits = true == predictions.y_pred.astype(np.int64)
        support = np.bincount(true, minlength=self.num_classes)
        correct = np.bincount(true[hits], minlength=self.num_classes)
        recall = [ratio(float(h), float(n)) for h, n in zip(correct, support, strict=True)]
        return {"recall": recall, "support": support.astype(float).tolist()}

    def plot(self, predictions: Predictions, out: Path) -> None:
        plot_confusion_matrix(predictions, self.num_classes, out)


def _log_probs(probabilities: np.ndarray) -> torch.Tensor:
    # Log-probabilities are logits whose softmax is the probabilities themselves.
    return torch.from_numpy(np.log(np.clip(probabilities, 1e-15, 1.0))).float()


def plot_confusion_matrix(pred: Predictions, num_classes: int, out: Path) -> None:
    cells = pred.y_true.astype(np.int64) * num_classes + pred.y_pred.astype(np.int64)
    matrix = np.bincount(cells, minlength=num_classes**2).reshape(num_classes, num_classes)
    fig, axes = plots.figure(6, 5)
    ax = axes[0][0]
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax)
    ax.set(xlabel="predicted", ylabel="true", title="Confusion matrix (test split)")
    ax.set_xticks(range(num_classes))
    ax.set_yticks(range(num_classes))
    for (i, j), count in np.ndenumerate(matrix):
        if count:
            color = "white" if count > matrix.max() / 2 else "black"
            ax.text(j, i, str(count), ha="center", va="center", color=color, fontsize=8)
    plots.save(fig, out)
