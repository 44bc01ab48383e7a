"""JobSpec: what each key of params.yaml is for. The one owner of "what defines the job".

Every key has one use:
- it decides the data: a DVC param of the ingest or shard stage, and an MLflow param.
  The ingest stage's keys reach the job through the data version (DVC's md5 of
  data/raw); the shard stage's are in the job key themselves (they cut the same raw
  data into other splits);
- it computes the model (task, model, optim, train, update): a DVC param of the train
  stage, part of the job key, an MLflow param;
- it only affects evaluation and reporting (evaluate): a DVC param of the evaluate
  stage, recorded on the run as a `gradline.<key>` tag by each evaluation;
- it only describes a run (runtime, parallel, registry, orchestrate, sweep): no stage
  depends on it, no job key holds it; each attempt records it as a `gradline.<key>` tag;
- it belongs to another command (score: `gradline score`): no stage, no job key, nothing
  on a training run (a scoring run records its own settings).

The job key, the MLflow params and tags, `compare-updates`' checks (no key that decides
the data) and the params lists in dvc.yaml all derive from this table
(tests/test_dvc_contract.py checks dvc.yaml against `stage_params`). A job keyed this
way resumes under any `runtime` or `parallel` value, and a change to a key reruns
exactly the stages that read it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from training.config.schema import OPEN_SECTIONS, SECTIONS, Config

STAGES = ("ingest", "shard", "train", "evaluate")
DATA_STAGES = frozenset({"ingest", "shard"})
# Stages whose keys are in the job key (ingest's enter through the data version).
KEYED_STAGES = frozenset({"shard", "train"})


@dataclass(frozen=True)
class KeyUse:
    stages: tuple[str, ...]  # the DVC stages that read it (rerun when it changes)
    mlflow: Literal["param", "tag", "none"]  # how the job's MLflow run records it

    @property
    def decides_data(self) -> bool:
        return bool(DATA_STAGES & set(self.stages))

    @property
    def in_job_key(self) -> bool:
        return bool(KEYED_STAGES & set(self.stages))


DATA = KeyUse(("ingest",), "param")
SPLIT = KeyUse(("shard",), "param")
COMPUTE = KeyUse(("train",), "param")
EVALUATION = KeyUse(("evaluate",), "tag")
RUN = KeyUse((), "tag")
OTHER_COMMAND = KeyUse((), "none")

SECTION_USES: dict[str, KeyUse] = {
    "data": DATA,
    "shard": SPLIT,
    "task": COMPUTE,
    "model": COMPUTE,
    "optim": COMPUTE,
    "train": COMPUTE,
    "update": COMPUTE,
    "evaluate": EVALUATION,
    "runtime": RUN,
    "parallel": RUN,
    "registry": RUN,
    "orchestrate": RUN,
    # A sweep searches over jobs; each trial is a job of its own (training.mlops.sweep).
    "sweep": RUN,
    "score": OTHER_COMMAND,
}
# Keys used differently from the rest of their section: the task's kind of labels
# decides how ingest reads the label column.
# A forecasting job's shards are windows cut by the task's context and horizon at split
# dates the shard stage computes, so those keys decide the shards too.
KEY_USES: dict[str, KeyUse] = {
    "task.type": KeyUse(("ingest", "shard", "train"), "param"),
    "task.context": KeyUse(("shard", "train"), "param"),
    "task.horizon": KeyUse(("shard", "train"), "param"),
    "task.season": KeyUse(("shard", "train"), "param"),
    "data.split_dates": KeyUse(("ingest", "shard"), "param"),
}


def use(key: str) -> KeyUse:
    """The use of `section.key` (an open section's keys share the section's)."""
    return KEY_USES.get(key) or SECTION_USES[key.split(".")[0]]


def stage_params(stage: str, cfg: Config | None = None) -> list[str]:
    """The params dvc.yaml lists for `stage`: a section by its name when the stage reads
    all of it (and an open section always), else key by key."""
    flat = (cfg or Config()).flat()
    listed: list[str] = []
    for section in SECTIONS:
        keys = [k for k in flat if k.split(".")[0] == section and stage in use(k).stages]
        whole = section in OPEN_SECTIONS or len(keys) == len(_section_keys(flat, section))
        if keys and whole:
            listed.append(section)
        elif keys:
            listed.extend(keys)
    return listed


def _section_keys(flat: dict[str, Any], section: str) -> list[str]:
    return [k for k in flat if k.split(".")[0] == section]


def job_identity(cfg: Config) -> dict[str, Any]:
    """What defines the job besides the data version: every key in the job key."""
    return {k: v for k, v in cfg.flat().items() if use(k).in_job_key}


def job_key(cfg: Config, data_version: str) -> str:
    identity = {**job_identity(cfg), "data_version": data_version}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def mlflow_params(cfg: Config) -> dict[str, str]:
    """What the job's MLflow run holds as params: the keys that define the job."""
    return {k: str(v) for k, v in cfg.flat().items() if use(k).mlflow == "param"}


def run_tags(cfg: Config, stage: str | None = None) -> dict[str, str]:
    """`gradline.<key>` tags for the keys a run records as tags; with `stage`, only the
    ones that stage reads (an evaluation records its own settings)."""
    return {
        f"gradline.{k}": str(v)
        for k, v in cfg.flat().items()
        if use(k).mlflow == "tag" and (stage is None or stage in use(k).stages)
    }
