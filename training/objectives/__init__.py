"""Tasks as plug-ins: one module per task owns everything task-specific.

A task module (classification.py, regression.py, language_modeling.py) defines an
`Objective`: the loss, the metrics and their additive statistics, the baseline, the
gate's metric and direction, the output the model must produce, the label scaling,
what the registered model predicts on raw inputs, and the plots or samples evaluation
shows. This registry lists each task as a card: the few facts that layers without
torch need (the config, the data plane), and the module that implements it. Adding a
task is a new module and a card here.

The task modules import torch, so they are imported on first use (`objective_for`):
the config and the data stages validate tasks without paying torch's ~2 s import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from training.data.options import DataKind, LabelKind
from training.data.spec import DataSpec
from training.errors import ConfigError
from training.options import Section

if TYPE_CHECKING:
    from training.objectives.base import Objective


@dataclass(frozen=True)
class TaskCard:
    name: str
    module: str  # training.objectives.<module> defines `Objective` for the task
    learns_from: tuple[DataKind, ...]  # the kinds of examples it can learn from
    labels: LabelKind | None  # what a table's label column must hold (None: no labels)
    gate_metric: str  # the test metric the registry gate compares
    higher_is_better: bool
    # Every metric the task reports (without "val_"/"test_"), each with whether higher
    # is better: what early stopping and checkpoint selection may watch.
    metrics: tuple[tuple[str, bool], ...] = ()

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.metrics)

    def validation_metric(self, name: str) -> tuple[str, bool]:
        """(`val_<name>`, higher is better) for metric `name` ("": the gate's metric);
        ConfigError naming the task's metrics when it reports no such metric."""
        bare = (name or self.gate_metric).removeprefix("val_").removeprefix("test_")
        directions = dict(self.metrics)
        if bare not in directions:
            raise ConfigError(
                f"task {self.name} has no validation metric {name!r}; choose one of "
                f"{', '.join('val_' + n for n in directions)} (or leave it empty for "
                f"val_{self.gate_metric.removeprefix('test_')}, the gate's metric)"
            )
        return "val_" + bare, directions[bare]

    def fits(self, kinds: tuple[DataKind, ...]) -> bool:
        return bool(set(kinds) & set(self.learns_from))


TASKS: dict[str, TaskCard] = {
    card.name: card
    for card in (
        TaskCard(
            "classification", "classification", ("table", "image"), "classes",
            "test_accuracy", higher_is_better=True,
            metrics=(("accuracy", True), ("macro_f1", True), ("loss", False)),
        ),
        TaskCard(
            "regression", "regression", ("table", "image"), "values",
            "test_rmse", higher_is_better=False,
            metrics=(("rmse", False), ("mae", False), ("r2", True), ("loss", False)),
        ),
        TaskCard(
            "language_modeling", "language_modeling", ("tokens",), None,
            "test_loss", higher_is_better=False,
            metrics=(
                ("loss", False), ("perplexity", False), ("bits_per_token", False),
                ("bits_per_byte", False),
            ),
        ),
        # Recommendation: 0/1 clicks from id and dense features (objectives/click.py).
        # recall@10 / ndcg@10 are evaluate-only (not additive), so not listed here.
        TaskCard(
            "click", "click", ("table",), "classes", "test_auc", higher_is_better=True,
            metrics=(
                ("auc", True), ("log_loss", False), ("normalized_entropy", False),
                ("loss", False),
            ),
        ),
    )
}  # fmt: skip


def task_card(name: str) -> TaskCard:
    if name not in TASKS:
        raise ConfigError(f"task.type {name!r} is not one of {', '.join(TASKS)}")
    return TASKS[name]


def tasks_learning(kinds: tuple[DataKind, ...]) -> list[str]:
    """The tasks that can learn from examples of these kinds."""
    return [name for name, card in TASKS.items() if card.fits(kinds)]


def tasks_with_labels(labels: LabelKind | None) -> list[str]:
    return [name for name, card in TASKS.items() if card.labels == labels]


@dataclass(frozen=True)
class Generation:
    """How a generative task samples what a run shows: the evaluate section's prompts
    and settings, seeded by the job's seed (Config.generation)."""

    prompts: tuple[str, ...]
    max_new_tokens: int
    temperature: float
    top_k: int | None
    seed: int


class TaskConfig(Section):
    """What is learned, and so the loss, the metrics, the baseline and the gate."""

    type: Literal[tuple(TASKS)] = Field(  # type: ignore[valid-type]
        "classification",
        description="classification (integer labels), regression (float labels), "
        "language_modeling (text sources) or click (0/1 clicks on ids, recommendation)",
    )

    @property
    def card(self) -> TaskCard:
        return TASKS[self.type]


def objective_for(task: str, data: DataSpec, tokenizer: Any = None) -> Objective:
    """The objective of `task` on data described by `data` (from the manifest). Language
    models take the tokenizer of the data's token ids (training.data.tokenizer): bytes
    per token for bits per byte, text for samples."""
    card = task_card(task)
    module = importlib.import_module(f"{__name__}.{card.module}")
    return module.Objective.for_data(data, tokenizer)
