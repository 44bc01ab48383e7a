"""The sweep's Optuna study: its storage in the project, and what survives between runs.

The study lives in `sweeps/<name>/optuna.db` (SQLite), named by `sweep.name`: running
the sweep again continues it up to its budget. Besides Optuna's own records the study
keeps, as study attributes: the fingerprint its trials share (data version, the other
job keys, the space, the metric: a sweep whose fingerprint changed is refused, since
its trials would not be comparable), its parent MLflow run, the seconds spent so far,
and the trials a stop interrupted, which the next run trains again from their
checkpoints (enqueued with the same keys and folder).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial, TrialState

from training.config.sweep import ParamSpec, SweepConfig
from training.errors import ConfigError
from training.mlops.sweep.plan import SweepPlan, fits, storage_url, sweep_folder

FINGERPRINT = "fingerprint"
PARENT_RUN = "parent_run_id"
SECONDS = "seconds_spent"
INTERRUPTED = "interrupted"  # trial numbers a stop interrupted (they are trained again)
# Trial attributes.
FOLDER = "folder"  # the trial's folder under checkpoints/sweeps/<name>/
RESUMES = "resumes"  # the interrupted trial this one continues
BASELINE = "baseline"  # params.yaml's own values


def distribution(spec: ParamSpec) -> BaseDistribution:
    if spec.type == "choice":
        return CategoricalDistribution(list(spec.choices or []))
    if spec.type == "int":
        return IntDistribution(int(spec.low), int(spec.high))
    return FloatDistribution(spec.low, spec.high, log=spec.type == "log")


def distributions(plan: SweepPlan) -> dict[str, BaseDistribution]:
    return {key: distribution(spec) for key, spec in plan.space.items()}


def sampler(sweep: SweepConfig) -> optuna.samplers.BaseSampler:
    if sweep.sampler == "random":
        return optuna.samplers.RandomSampler(seed=sweep.seed)
    # constant_liar: trials running at once are told apart, not drawn alike.
    return optuna.samplers.TPESampler(seed=sweep.seed, constant_liar=True)


def pruner(sweep: SweepConfig) -> optuna.pruners.BasePruner:
    if sweep.pruner == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=sweep.min_trials, n_warmup_steps=sweep.warmup_steps
        )
    if sweep.pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=sweep.warmup_steps or "auto")
    return optuna.pruners.NopPruner()


def open_study(plan: SweepPlan, data_version: str) -> optuna.Study:
    """Create the study, or load it and check it continues under the same fingerprint."""
    optuna.logging.set_verbosity(logging.WARNING)  # the sweep says what happens itself
    sweep_folder(plan.root, plan.sweep.name).mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(
        storage=plan.storage,
        study_name=plan.sweep.name,
        direction=plan.direction,
        sampler=sampler(plan.sweep),
        pruner=pruner(plan.sweep),
        load_if_exists=True,
    )
    wanted = plan.fingerprint(data_version)
    found = study.user_attrs.get(FINGERPRINT)
    if found is None:
        study.set_user_attr(FINGERPRINT, wanted)
        _enqueue_baseline(plan, study)
    elif found != wanted:
        raise ConfigError(
            f"sweep {plan.sweep.name!r} ({plan.folder / 'optuna.db'}) was started with "
            f"other settings: {'; '.join(differences(found, wanted))}. Its trials would "
            "not compare with new ones: set sweep.name to start a new sweep, or put these "
            "back to continue this one"
        )
    return study


def load_study(root, name: str) -> optuna.Study:
    """An existing study (for --apply); ConfigError when there is none."""
    optuna.logging.set_verbosity(logging.WARNING)
    path = sweep_folder(root, name) / "optuna.db"
    if not path.is_file():
        raise ConfigError(f"no sweep named {name!r} ({path} is missing): run `gradline sweep`")
    try:
        return optuna.load_study(study_name=name, storage=storage_url(root, name))
    except KeyError:
        raise ConfigError(f"{path} holds no study named {name!r}") from None


def differences(found: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """What changed between two fingerprints, key by key, for messages."""
    lines = []
    if found["data_version"] != wanted["data_version"]:
        lines.append(f"data version {found['data_version']} -> now {wanted['data_version']}")
    for part in ("job", "space"):
        for key in sorted(set(found[part]) | set(wanted[part])):
            before, now = found[part].get(key), wanted[part].get(key)
            if before != now:
                where = "sweep.space." if part == "space" else ""
                lines.append(f"{where}{key} {json.dumps(before)} -> now {json.dumps(now)}")
    for key in ("metric", "direction"):
        if found[key] != wanted[key]:
            lines.append(f"sweep.{key} {found[key]} -> now {wanted[key]}")
    return lines


def _enqueue_baseline(plan: SweepPlan, study: optuna.Study) -> None:
    """params.yaml's own values as the first trial, when they lie in the space: the
    table then shows what the sweep gained over them."""
    if not plan.sweep.baseline_trial:
        return
    flat = plan.base.flat()
    values = {key: flat[key] for key in plan.space}
    if all(fits(spec, values[key]) for key, spec in plan.space.items()):
        study.enqueue_trial(values, user_attrs={BASELINE: True})


def interrupted(study: optuna.Study) -> set[int]:
    return set(study.user_attrs.get(INTERRUPTED, []))


def mark_interrupted(study: optuna.Study, number: int) -> None:
    study.set_user_attr(INTERRUPTED, sorted(interrupted(study) | {number}))


def recover(study: optuna.Study) -> list[int]:
    """Trials left RUNNING by a sweep that was killed outright (the project lock says no
    sweep runs now) end as interrupted; every interrupted trial not yet taken up again
    is enqueued with its keys and folder, so it resumes from its checkpoint. Returns the
    numbers enqueued."""
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        mark_interrupted(study, trial.number)
        study.tell(trial.number, state=TrialState.FAIL)
    trials = study.get_trials(deepcopy=False)
    taken = {t.user_attrs[RESUMES] for t in trials if RESUMES in t.user_attrs}
    again = []
    for number in sorted(interrupted(study) - taken):
        old = trials[number]
        attrs = {RESUMES: number, FOLDER: old.user_attrs.get(FOLDER, folder_name(number))}
        if old.user_attrs.get(BASELINE):
            attrs[BASELINE] = True
        study.enqueue_trial(old.params, user_attrs=attrs)
        again.append(number)
    return again


def folder_name(number: int) -> str:
    return f"trial-{number:04d}"


def counted(study: optuna.Study) -> int:
    """Trials that count against sweep.trials: every one started, except those a stop
    interrupted (the trial that resumes each counts instead)."""
    skip = interrupted(study)
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING)
    return sum(
        t.state in states and not (t.state == TrialState.FAIL and t.number in skip)
        for t in study.get_trials(deepcopy=False)
    )


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The best complete trial, or None before any completed."""
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return None
    return study.best_trial
