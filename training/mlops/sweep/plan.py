"""The sweep's plan: everything checked before a study, a run or a file exists.

The space may name any key that computes the model (task, model, optim, train,
update) and exists in the config, never a key that decides the data (every trial trains
on the data as params.yaml makes it, versioned once for the whole sweep) nor one that
only says how a run goes. Each key's bounds (or each choice) is validated with the rest
of the config, so a value no trial could train with fails here, naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config import Config, jobspec, load_config, parse_override
from training.config.loading import validate
from training.config.sweep import ParamSpec, SweepConfig
from training.errors import ConfigError
from training.mlops.children import refuse_data_key
from training.project import Project

COMMAND = "gradline sweep"


@dataclass(frozen=True)
class SweepPlan:
    root: Path
    overrides: tuple[str, ...]  # --set for this sweep only (not written to params.yaml)
    base: Config  # params.yaml + overrides: every trial is this with its keys set
    metric: str  # the validation metric compared, e.g. val_accuracy
    direction: str  # maximize | minimize
    slots: int  # device slots of the quota
    at_once: int  # trials run at the same time

    @property
    def sweep(self) -> SweepConfig:
        return self.base.sweep

    @property
    def space(self) -> dict[str, ParamSpec]:
        return self.base.sweep.space

    @property
    def folder(self) -> Path:
        """The study's storage, table and plots."""
        return sweep_folder(self.root, self.sweep.name)

    @property
    def storage(self) -> str:
        return storage_url(self.root, self.sweep.name)

    @property
    def checkpoints(self) -> Path:
        """Every trial's job folder and model, one folder per trial."""
        return Project(self.root).checkpoints / "sweeps" / self.sweep.name

    def fingerprint(self, data_version: str) -> dict[str, Any]:
        """What makes two trials comparable: the same data, every other job key, the
        same space and metric. A study continues only under the same fingerprint."""
        identity = jobspec.job_identity(self.base)
        return {
            "data_version": data_version,
            "job": {k: v for k, v in identity.items() if k not in self.space},
            "space": {k: spec.model_dump() for k, spec in self.space.items()},
            "metric": self.metric,
            "direction": self.direction,
        }


def sweep_folder(root: Path, name: str) -> Path:
    return root / "sweeps" / name


def storage_url(root: Path, name: str) -> str:
    return f"sqlite:///{(sweep_folder(root, name) / 'optuna.db').resolve()}"


def plan_sweep(
    root: Path, overrides: list[str] | tuple[str, ...], devices: Callable[[], int]
) -> SweepPlan:
    """Validate the whole sweep (see the module docstring). `devices` counts this
    machine's training devices, called only when orchestrate.device_slots leaves the
    quota's size to the machine."""
    for text in overrides:
        section, key, _ = parse_override(text)
        refuse_data_key(f"{section}.{key}", f"--set {text}", COMMAND)
    base = load_config(Project(root).params, overrides)
    sweep = base.sweep
    if not sweep.space:
        raise ConfigError(
            "sweep.space is empty: name the keys to search in params.yaml's sweep "
            "section, e.g. `optim.lr: {type: log, low: 0.0001, high: 0.1}`"
        )
    if base.runtime.node_range != (1, 1):
        raise ConfigError(
            f"runtime.nnodes={base.runtime.nnodes}: a sweep runs its trials on this "
            "machine; set runtime.nnodes: 1 (a trial may still use every device here)"
        )
    flat = base.flat()
    for key, spec in sweep.space.items():
        _check_key(key, spec, flat)
    for key, spec in sweep.space.items():
        for value in corners(spec):
            try:
                trial_config(base, {key: value})
            except ConfigError as exc:
                raise ConfigError(
                    f"sweep.space.{key}: a trial with {key}={value!r}: {exc}"
                ) from None
    metric, direction = metric_and_direction(base)
    slots, at_once = concurrency(base, devices)
    return SweepPlan(root, tuple(overrides), base, metric, direction, slots, at_once)


def _check_key(key: str, spec: ParamSpec, flat: dict[str, Any]) -> None:
    section = key.split(".")[0]
    if key not in flat:
        known = [k for k in flat if k.split(".")[0] == section]
        where = f"keys of {section} are {', '.join(known)}" if known else "no such section"
        raise ConfigError(f"sweep.space.{key}: not a key of the config ({where})")
    refuse_data_key(key, f"sweep.space.{key}", COMMAND)
    if not jobspec.use(key).in_job_key:
        raise ConfigError(
            f"sweep.space.{key}: {key} does not change the model (it says how a run goes "
            "or how it is evaluated); a sweep searches keys that compute the model: "
            "task, model, optim, train and update"
        )
    current = flat[key]
    whole = isinstance(current, int) and not isinstance(current, bool)
    if whole and spec.type in ("log", "uniform"):
        raise ConfigError(
            f"sweep.space.{key}: {key} is a whole number ({current}); draw it with "
            f"type int, or choice"
        )


def corners(spec: ParamSpec) -> list[Any]:
    """The values that bound the space: each end, or every choice."""
    if spec.type == "choice":
        return list(spec.choices or [])
    if spec.type == "int":
        return [int(spec.low), int(spec.high)]
    return [spec.low, spec.high]


def fits(spec: ParamSpec, value: Any) -> bool:
    """Whether `value` lies in the space of `spec` (params.yaml's own value may not)."""
    if spec.type == "choice":
        return any(type(value) is type(c) and value == c for c in spec.choices or [])
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if spec.type == "int" and not isinstance(value, int):
        return False
    return spec.low <= value <= spec.high


def trial_config(base: Config, values: dict[str, Any]) -> Config:
    """`base` with the trial's keys set, validated as params.yaml would be."""
    raw = base.model_dump()
    for key, value in values.items():
        section, name = key.split(".")
        raw[section][name] = value
    shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
    return validate(raw, f"the trial's config ({shown})")


def metric_and_direction(cfg: Config) -> tuple[str, str]:
    """The metric trials are compared on and its direction: by default the validation
    twin of the task's gate metric (val_accuracy for test_accuracy), in the gate's
    direction."""
    card = cfg.task.card
    own = "val_" + card.gate_metric.removeprefix("test_")
    metric = cfg.sweep.metric or own
    if cfg.sweep.direction != "auto":
        return metric, cfg.sweep.direction
    if metric != own:
        raise ConfigError(
            f"sweep.direction: auto knows the direction of the task's own metric ({own}) "
            f"only; set sweep.direction: maximize or minimize for {metric}"
        )
    return metric, "maximize" if card.higher_is_better else "minimize"


def concurrency(cfg: Config, devices: Callable[[], int]) -> tuple[int, int]:
    """(device slots, trials at once): as many trials as the quota has room for, each
    holding runtime.procs_per_node slots (the quota's rule, tasks/quota.py), at most
    sweep.max_parallel."""
    slots = cfg.orchestrate.device_slots or devices()
    needed = cfg.runtime.procs_per_node
    if needed > slots:
        raise ConfigError(
            f"runtime.procs_per_node={needed} needs {needed} device slots but the quota "
            f"has {slots} (orchestrate.device_slots, 0: the devices here): lower "
            "runtime.procs_per_node or raise orchestrate.device_slots"
        )
    at_once = slots // needed
    if cfg.sweep.max_parallel:
        at_once = min(at_once, cfg.sweep.max_parallel)
    return slots, at_once


def space_json(plan: SweepPlan) -> str:
    """The space as the parent run records it."""
    return json.dumps(
        {k: spec.model_dump(exclude_none=True) for k, spec in plan.space.items()}, sort_keys=True
    )
