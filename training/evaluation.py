"""Scoring a trained model on the test split, beside its task's baseline.

`TestData` is the test split and the task's objective for it: the evaluate stage scores
the trained model with it, and the registry gate re-scores a champion with the very same
routine (the loop's validation calls the same objective), so every test metric of a
task is computed one way. `evaluate` adds the baseline on the same split, what the task
shows (plots, predictions, samples) and the details a model card reports: each metric's
bootstrap interval (the model's and the baseline's, resampled alike), the per-class
figures, the model's size.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from training.config import Config
from training.data.loader import open_reader
from training.data.manifest import read_manifest
from training.data.spec import DataSpec, incompatibility
from training.data.tokenizer import shard_tokenizer
from training.models.folder import ModelSpec
from training.models.registry import context_length
from training.objectives import objective_for
from training.objectives.base import Objective, Scored
from training.objectives.bootstrap import Bootstrap


@dataclass(frozen=True)
class TestData:
    """The test split and what scores a model on it: the objective and the readers."""

    manifest: dict[str, Any]
    data: DataSpec
    objective: Objective
    test: Any
    context: int | None

    @classmethod
    def open(cls, cfg: Config, shards: Path) -> TestData:
        manifest = read_manifest(shards)
        data = DataSpec.from_manifest(manifest)
        tokenizer = shard_tokenizer(shards, manifest) if data.kind == "tokens" else None
        objective = objective_for(cfg.task.type, data, tokenizer)
        context = context_length(cfg.model, data.kind)
        test = open_reader(shards, manifest, "test", context=context)
        return cls(manifest, data, objective, test, context)

    def score(
        self,
        model: nn.Module,
        batch_size: int,
        keep_predictions: bool = False,
        bootstrap: Bootstrap | None = None,
    ) -> Scored:
        """The one evaluation routine (the loop's validation calls the same objective)."""
        rows = np.arange(self.test.num_rows)
        return self.objective.score(
            model,
            self.test,
            rows,
            batch_size,
            "cpu",
            keep_predictions=keep_predictions,
            bootstrap=bootstrap,
        )

    def unfit(self, spec: ModelSpec, task: str) -> str | None:
        """Why a model with this spec cannot score this data for `task`, or None."""
        return incompatibility(spec.data_spec, spec.task, self.data, task)


@dataclass(frozen=True)
class Evaluation:
    metrics: dict[str, float]  # test_* and baseline_test_*
    figures: list[Path]  # what the task drew, to log with the run
    objective: Objective
    # What a model card reports beside the metrics (evaluation/details.json on the run):
    # intervals, per-class figures, the model's size, the test split's rows.
    details: dict[str, Any]


def evaluate(cfg: Config, model: nn.Module, shards: Path, plots: Path) -> Evaluation:
    """The model's test metrics and its baseline's on the same split; the task's plots,
    predictions or samples written under `plots` (replaced whole)."""
    test = TestData.open(cfg, shards)
    settings = cfg.evaluate
    bootstrap = Bootstrap(settings.bootstrap_replicates, settings.bootstrap_seed)
    scored = test.score(model, settings.batch_size, keep_predictions=True, bootstrap=bootstrap)
    train = open_reader(shards, test.manifest, "train", context=test.context)
    baseline = test.objective.baseline(
        train, test.test, settings.baseline_max_rows, bootstrap=bootstrap
    )
    if plots.exists():
        shutil.rmtree(plots)  # another task's plots must not linger beside these
    plots.mkdir(parents=True)
    figures = test.objective.artifacts(model, scored, plots, cfg.generation(), test.context)
    details = {
        "test_rows": test.test.num_rows,
        "parameters": sum(p.numel() for p in model.parameters()),
        "bootstrap": bootstrap.to_dict(),
        "per_class": test.objective.per_class(scored.predictions),
    }
    return Evaluation({**scored.metrics, **baseline}, figures, test.objective, details)
