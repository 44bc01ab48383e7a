"""The trained model, consolidated once from the job's final distributed checkpoint.

Whatever the layout, the workers' last act is a complete checkpoint keyed by the whole
model's parameter names. After they exit, the launcher builds the model once on CPU and
fills it from that checkpoint (only the model's part, not the optimizer's): one full
copy in memory, never a gather of every rank's state onto one rank.
"""

from __future__ import annotations

from pathlib import Path

from training.config import Config
from training.data.manifest import read_manifest
from training.data.spec import DataSpec
from training.engine.checkpoint import (
    CorruptCheckpoint,
    find_at,
    find_latest,
    load_model_weights,
)
from training.engine.updates import model_key
from training.errors import GradlineError
from training.models.folder import ModelSpec, save_model_dir
from training.models.registry import build_model


class NoFinalCheckpoint(GradlineError):
    """The workers finished but their final checkpoint is missing or incomplete."""

    retryable = True


class NoSelectedCheckpoint(GradlineError):
    """The checkpoint train.select chose (the best step's) is missing or fails its check."""


def consolidate_model(
    cfg: Config, shard_dir: Path, job_dir: Path, model_dir: Path, step: int, selected: int
):
    """Write `model_dir` (weights, what rebuilds them, the tokenizer) from the checkpoint
    of step `selected` (train.select) of the job in `job_dir`, whose final checkpoint must
    be at `step`."""
    found = find_latest(job_dir)
    if found is None or int(found[1]["step"]) != step:
        at = f"step {found[1]['step']}" if found else "none"
        raise NoFinalCheckpoint(
            f"training ended at step {step} but the newest complete checkpoint in {job_dir} "
            f"is {at}; run the job again to resume and save it"
        )
    if selected != step:
        try:
            found = find_at(job_dir, selected)
        except CorruptCheckpoint as exc:
            raise NoSelectedCheckpoint(
                f"the best step's checkpoint cannot be used: {exc}. Set train.select: last "
                "to register the final weights, or retrain with gradline run --force"
            ) from exc
    manifest = read_manifest(shard_dir)
    data = DataSpec.from_manifest(manifest)
    model = build_model(cfg.model, cfg.task.type, data)
    load_model_weights(found[0], model, model_key(found[1]))
    spec = ModelSpec(task=cfg.task.type, model=cfg.model.model_dump(), data=data.to_dict())
    tokenizer = manifest.get("tokenizer") or {}
    tokenizer_file = shard_dir / tokenizer["file"] if tokenizer.get("file") else None
    save_model_dir(model, spec, model_dir, tokenizer_file)
