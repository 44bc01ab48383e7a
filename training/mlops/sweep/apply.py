"""`gradline sweep --apply`: the best trial's keys into params.yaml.

Only the keys the sweep searched are written (validated with the rest of params.yaml
first; atomically, comments kept), so the normal `gradline run` then trains, gates and
registers that configuration. Keys the trials ran with through `--set` are not written:
when params.yaml's other job keys differ from the trials', the message says which, since
the pipeline will then train a job the sweep never measured.
"""

from __future__ import annotations

import json
from pathlib import Path

from training.config import jobspec, load_config, update_params_file
from training.errors import ConfigError
from training.mlops.sweep.plan import trial_config
from training.mlops.sweep.study import FINGERPRINT, best_trial, load_study
from training.project import Project


def apply_best(root: Path, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """Write the best complete trial's keys into params.yaml; what was done, in words.
    `overrides` pick the sweep (e.g. sweep.name=...); they are not written."""
    project = Project(root)
    name = load_config(project.params, overrides).sweep.name
    study = load_study(root, name)
    best = best_trial(study)
    if best is None:
        raise ConfigError(
            f"sweep {name!r} has no complete trial yet: run `gradline sweep` (with a "
            "budget left) first"
        )
    values = dict(best.params)
    # params.yaml alone: what `gradline run` will train once the keys are in.
    applied = trial_config(load_config(project.params), values)
    flat = applied.flat()
    changes: dict[str, dict] = {}
    for key in values:
        section, field = key.split(".")
        changes.setdefault(section, {})[field] = flat[key]
    update_params_file(project.params, changes)
    fingerprint = study.user_attrs[FINGERPRINT]
    metric = fingerprint["metric"]
    lines = [
        f"params.yaml now holds the best trial of sweep {name!r} (trial {best.number}, "
        f"{metric} {best.value:.4g}): " + ", ".join(f"{k}={v!r}" for k, v in values.items())
    ]
    if drift := _other_keys_differ(fingerprint["job"], applied, set(values)):
        lines.append(
            "note: the trials ran with other job keys than params.yaml holds ("
            + "; ".join(drift)
            + "): `gradline run` trains a job the sweep did not measure"
        )
    lines.append("Run `gradline run` to train, gate and register it.")
    return "\n".join(lines)


def _other_keys_differ(trials: dict, applied, searched: set[str]) -> list[str]:
    # JSON both ways: the study keeps the fingerprint as JSON.
    here = json.loads(json.dumps(jobspec.job_identity(applied)))
    keys = sorted((set(trials) | set(here)) - searched)
    return [
        f"{k}: trials {json.dumps(trials.get(k))}, params.yaml {json.dumps(here.get(k))}"
        for k in keys
        if trials.get(k) != here.get(k)
    ]
