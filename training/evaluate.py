"""What the evaluate stage shows beside the metrics: plots, per-row predictions, samples.

The metrics themselves come from the task's objective (training/objectives.py); this
module only turns its predictions into files: a confusion matrix for classification, a
predicted-vs-actual scatter for regression, predictions.json for both, sampled text for
language models, and the training curves of any task.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from training.atomic import write_json
from training.objectives import Predictions

__all__ = [
    "Predictions",
    "plot_confusion_matrix",
    "plot_loss_curves",
    "plot_predicted_vs_actual",
    "sample_text",
    "write_prediction_artifacts",
    "write_predictions",
]


class TextTokenizer(Protocol):
    """What sampling needs from training.data.tokenizer.Tokenizer."""

    eot: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    _pyplot().close(fig)


def write_prediction_artifacts(
    task: str, pred: Predictions, num_classes: int | None, plots: Path
) -> list[Path]:
    """The task's plot and predictions.json under `plots`; returns the images to log."""
    write_predictions(pred, plots / "predictions.json")
    if task == "classification":
        image = plots / "confusion_matrix.png"
        plot_confusion_matrix(pred, int(num_classes or 0), image)
    else:
        image = plots / "predicted_vs_actual.png"
        plot_predicted_vs_actual(pred, image)
    return [image]


def write_predictions(pred: Predictions, out: Path) -> None:
    """Rows of {actual, predicted}, the data of the plot (DVC plots read it)."""
    pairs = zip(pred.y_true.reshape(-1).tolist(), pred.y_pred.reshape(-1).tolist(), strict=True)
    write_json(out, [{"actual": actual, "predicted": predicted} for actual, predicted in pairs])


def plot_confusion_matrix(pred: Predictions, num_classes: int, out: Path) -> None:
    from sklearn.metrics import confusion_matrix

    plt = _pyplot()
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
    _save(fig, out)


def plot_predicted_vs_actual(pred: Predictions, out: Path) -> None:
    """Regression: one point per test row; a perfect model lies on the diagonal."""
    plt = _pyplot()
    actual, predicted = pred.y_true.reshape(-1), pred.y_pred.reshape(-1)
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(actual, predicted, s=8, alpha=0.6)
    if len(actual):
        low = float(min(actual.min(), predicted.min()))
        high = float(max(actual.max(), predicted.max()))
        ax.plot([low, high], [low, high], "k--", linewidth=1, label="predicted = actual")
        ax.legend()
    ax.set(xlabel="actual", ylabel="predicted", title="Predicted vs actual (test split)")
    _save(fig, out)


def plot_loss_curves(
    history: dict[str, list[tuple[int, float]]], out: Path, metric: str | None = "val_accuracy"
) -> None:
    """Training and validation loss by step, and beside them the task's validation
    `metric` (e.g. the objective's `curve_metric`) unless it is the loss itself."""
    plt = _pyplot()
    second = metric is not None and metric != "val_loss"
    fig, axes = plt.subplots(1, 2 if second else 1, figsize=(10 if second else 5, 4), squeeze=False)
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
    _save(fig, out)


def sample_text(
    model: torch.nn.Module,
    tokenizer: TextTokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    context: int,
    seed: int,
) -> str:
    """A sampled continuation of each prompt, as one readable text.

    Each prompt follows an end-of-document token, as a document's first tokens do in
    training; a continuation stops at the next end-of-document token. The same seed gives
    the same text, so samples of two evaluations differ only by the model.
    """
    from training.models.gpt import generate

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    sections = []
    try:
        for number, prompt in enumerate(prompts, start=1):
            ids = [tokenizer.eot, *tokenizer.encode(prompt)]
            start = torch.tensor([ids], dtype=torch.long, device=device)
            with torch.no_grad():
                out = generate(
                    model, start, max_new_tokens, temperature, top_k, context, generator=generator
                )
            continuation = out[0, len(ids) :].tolist()
            if tokenizer.eot in continuation:
                continuation = continuation[: continuation.index(tokenizer.eot)]
            text = tokenizer.decode(ids[1:] + continuation)
            sections.append(f"=== sample {number}, prompt {prompt!r} ===\n{text}\n")
    finally:
        model.train(was_training)
    return "\n".join(sections)
