"""The `sweep` section: what `gradline sweep` searches, how, and for how long.

A sweep is no part of any job: each trial is a job of its own (params.yaml with the
trial's keys set), so this section is in no job key and no DVC stage reads it
(training.config.jobspec). Which keys the space may name (those that compute the model:
task, model, optim, train, update, never the data) and whether each trial's config
validates are checked when a sweep is planned (training.mlops.sweep), where the rest of
the config is known.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from training.options import Name, Seconds, Section, Seed, WorkerCount

Choice = str | int | float | bool | None


class ParamSpec(Section):
    """How one key is drawn: `log` (log-uniform float), `uniform` (float), `int` (whole
    numbers from low to high, both included) between `low` and `high`, or one of
    `choices`."""

    type: Literal["log", "uniform", "int", "choice"]
    low: float | None = None
    high: float | None = None
    choices: list[Choice] | None = None

    @model_validator(mode="after")
    def _well_formed(self) -> ParamSpec:
        if self.type == "choice":
            if not self.choices or self.low is not None or self.high is not None:
                raise ValueError(
                    "type choice takes `choices` (a list of at least one value) and no "
                    "low/high, e.g. {type: choice, choices: [64, 128, 256]}"
                )
            if len({repr(c) for c in self.choices}) != len(self.choices):
                raise ValueError(f"choices {self.choices} name a value twice")
            return self
        if self.choices is not None or self.low is None or self.high is None:
            raise ValueError(
                f"type {self.type} takes `low` and `high` (no choices), e.g. "
                "{type: log, low: 0.0001, high: 0.1}"
            )
        if not self.low < self.high:
            raise ValueError(f"low ({self.low:g}) must be below high ({self.high:g})")
        if self.type == "log" and self.low <= 0:
            raise ValueError(f"type log needs low above 0 (got {self.low:g})")
        if self.type == "int" and not (self.low.is_integer() and self.high.is_integer()):
            raise ValueError(f"type int needs whole low and high (got {self.low:g}, {self.high:g})")
        return self


# Keys every built-in model has: the learning rate, the weight decay, the dropout.
DEFAULT_SPACE = {
    "optim.lr": ParamSpec(type="log", low=0.0003, high=0.03),
    "optim.weight_decay": ParamSpec(type="log", low=0.00001, high=0.01),
    "model.dropout": ParamSpec(type="uniform", low=0.0, high=0.5),
}


class SweepConfig(Section):
    name: Name = Field(
        "sweep",
        description="the study: its storage is sweeps/<name>/optuna.db; running the same "
        "name again continues it",
    )
    space: dict[str, ParamSpec] = Field(
        default_factory=lambda: dict(DEFAULT_SPACE),
        description="section.key -> {type: log|uniform|int|choice, low/high or choices}",
    )
    metric: str = Field(
        "", description="a validation metric (val_...); empty: the task's gate metric's twin"
    )
    direction: Literal["auto", "maximize", "minimize"] = Field(
        "auto", description="auto: the task's direction (needs the task's own metric)"
    )
    sampler: Literal["tpe", "random"] = "tpe"
    seed: Seed = Field(0, description="seeds the sampler")
    pruner: Literal["median", "asha", "none"] = Field(
        "median", description="median | asha (successive halving) | none"
    )
    warmup_steps: int = Field(
        100, ge=0, description="no trial is pruned before this training step (asha: first rung)"
    )
    min_trials: int = Field(3, ge=0, description="median: finished trials before it prunes any")
    trials: int | None = Field(
        20, ge=1, description="trials in the study, across runs of the sweep (null: no limit)"
    )
    wall_time_s: Seconds | None = Field(
        None, gt=0, description="seconds the sweep may spend, across runs (null: no limit)"
    )
    max_parallel: WorkerCount = Field(
        0, ge=0, description="trials at once (0: as many as the device quota allows)"
    )
    baseline_trial: bool = Field(
        True, description="the first trial trains params.yaml's own values of the space"
    )

    @model_validator(mode="after")
    def _has_a_budget_and_keys(self) -> SweepConfig:
        if self.trials is None and self.wall_time_s is None:
            raise ValueError(
                "a sweep needs a budget: set sweep.trials (a number of trials) or "
                "sweep.wall_time_s (seconds), or both"
            )
        for key in self.space:
            parts = key.split(".")
            if len(parts) != 2 or not all(parts):
                raise ValueError(
                    f"space key {key!r} is not of the form section.key (e.g. optim.lr)"
                )
        if self.metric and not self.metric.startswith("val_"):
            raise ValueError(
                f"metric {self.metric!r}: a sweep compares trials on validation metrics, "
                "which start with val_ (e.g. val_loss); empty picks the task's"
            )
        return self
