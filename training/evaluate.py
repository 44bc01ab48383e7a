"""Evaluation on a held-out split: predictions, metrics and a confusion-matrix image."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from training.data.loader import open_reader


@dataclass(frozen=True)
class Predictions:
    y_true: np.ndarray
    y_pred: np.ndarray
    loss: float


@torch.no_grad()
def predict_split(
    model: torch.nn.Module, shard_dir: Path, manifest: dict, split: str, batch_size: int
) -> Predictions:
    reader = open_reader(shard_dir, manifest, split)
    rows = np.arange(reader.num_rows)
    truths, preds, loss_sum = [], [], 0.0
    for start in range(0, len(rows), batch_size):
        x, y = reader.gather(rows[start : start + batch_size])
        logits = model(torch.from_numpy(x))
        target = torch.from_numpy(y)
        loss_sum += F.cross_entropy(logits, target, reduction="sum").item()
        truths.append(y)
        preds.append(logits.argmax(1).numpy())
    return Predictions(np.concatenate(truths), np.concatenate(preds), loss_sum / len(rows))


def classification_metrics(pred: Predictions, prefix: str = "test") -> dict[str, float]:
    from sklearn.metrics import accuracy_score, f1_score

    return {
        f"{prefix}_accuracy": float(accuracy_score(pred.y_true, pred.y_pred)),
        f"{prefix}_macro_f1": float(f1_score(pred.y_true, pred.y_pred, average="macro")),
        f"{prefix}_loss": float(pred.loss),
    }


def plot_confusion_matrix(pred: Predictions, num_classes: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    from sklearn.metrics import confusion_matrix

    matrix = confusion_matrix(pred.y_true, pred.y_pred, labels=list(range(num_classes)))
    fig, ax = plt.subplots(figsize=(6, 5))
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax)
    ax.set(xlabel="predicted", ylabel="true", title="Confusion matrix (test split)")
    ax.set_xticks(range(num_classes))
    ax.set_yticks(range(num_classes))
    for (i, j), count in np.ndenumerate(matrix):
        if count:
            color = "white" if count > matrix.max() / 2 else "black"
            ax.text(j, i, str(count), ha="center", va="center", color=color, fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_loss_curves(history: dict[str, list[tuple[int, float]]], out: Path) -> None:
    """Training and validation curves by step, from the run's metric history."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        if history.get(key):
            steps, values = zip(*history[key], strict=True)
            loss_ax.plot(steps, values, style, label=key, markersize=3)
    loss_ax.set(xlabel="step", ylabel="loss", title="Loss", yscale="log")
    loss_ax.legend()
    if history.get("val_accuracy"):
        steps, values = zip(*history["val_accuracy"], strict=True)
        acc_ax.plot(steps, values, "o-", label="val_accuracy", markersize=3)
        acc_ax.legend()
    acc_ax.set(xlabel="step", ylabel="accuracy", title="Validation accuracy")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
