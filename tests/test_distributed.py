"""Multi-process training on CPU with gloo, through the real elastic launcher."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training.config import Config, TrainConfig
from training.launch import launch_workers
from training.loop import TrainJob, load_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _job(shards: Path, work: Path, **train) -> TrainJob:
    cfg = Config(train=TrainConfig(batch_size=32, checkpoint_every=1, hidden=32, **train))
    return TrainJob(
        config=cfg.model_dump(),
        shard_dir=str(shards),
        checkpoint_dir=str(work / "ckpt"),
        model_dir=str(work / "model"),
        tracking_uri=None,
        run_id=None,
    )


def _weights(work: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(work / "model")
    return model.state_dict()


def test_two_ranks_train_and_resume_to_identical_weights(tiny_shards, tmp_path) -> None:
    straight = tmp_path / "straight"
    result = launch_workers(_job(tiny_shards, straight, epochs=4), world_size=2, max_restarts=0)
    assert result["val_accuracy"] > 0.5 and result["epoch"] == 4

    # Same job stopped after 2 epochs, then continued from its checkpoint to 4.
    resumed = tmp_path / "resumed"
    launch_workers(_job(tiny_shards, resumed, epochs=2), world_size=2, max_restarts=0)
    again = launch_workers(_job(tiny_shards, resumed, epochs=4), world_size=2, max_restarts=0)
    assert again["step"] == result["step"]
    a, b = _weights(straight), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
