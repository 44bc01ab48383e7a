"""A NaN loss or gradient skips the step on every rank, is counted, and never reaches a
checkpoint; too many in a row stop the job, naming the step, without a retry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from training.engine.faults import FaultPlan, PoisonableLoss, parse
from training.engine.launch import TrainingCannotContinue, launch_workers
from training.engine.nonfinite import NonFiniteGuard, NonFiniteTraining
from training.errors import USER_ERROR_EXIT_CODE

from .conftest import train_job
from .test_distributed import _config

NAN_STEP = 6  # after the warmup, between the checkpoints at 4 and 8


def test_the_nan_fault_poisons_its_steps_only() -> None:
    plan = FaultPlan(parse("nan:rank=1:step=3:steps=2"), rank=1)
    assert [plan.poisons_loss(n) for n in range(6)] == [False] * 3 + [True] * 2 + [False]
    assert not FaultPlan(parse("nan:rank=1:step=3"), rank=0).poisons_loss(3)
    loss = PoisonableLoss(torch.nn.functional.mse_loss)
    loss.poisoned = True
    assert torch.isnan(loss(torch.ones(2), torch.zeros(2)))


def test_the_guard_stops_after_the_limit_in_a_row_naming_the_step() -> None:
    guard = NonFiniteGuard(limit=3)
    guard.last_checkpoint = Path("ckpt/step-00000004")
    for step, stepped in [(4, False), (5, False), (6, True), (7, False), (8, False)]:
        guard.record(step, stepped, lr=0.01)  # a finite step resets the run
    with pytest.raises(NonFiniteTraining, match="steps 7 to 9") as stop:
        guard.record(9, False, lr=0.01)
    assert "at step 9, learning rate 0.01" in str(stop.value)
    assert "ckpt/step-00000004" in str(stop.value)
    assert guard.skipped == 5 and not NonFiniteTraining.retryable


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in _tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in _tensors(value)]
    return []


def _checkpoint_tensors(folder: Path, scratch: Path) -> list[torch.Tensor]:
    single = scratch / f"{folder.name}.pt"
    dcp_to_torch_save(folder, single)
    return _tensors(torch.load(single, weights_only=True))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_nan_on_one_rank_is_skipped_on_both_and_the_job_learns(
    tiny_shards, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("GRADLINE_FAULT", f"nan:rank=1:step={NAN_STEP}")
    cfg = _config(optim={"grad_clip": 0.0}, runtime={"checkpoint_every_steps": 4})
    result = launch_workers(train_job(tiny_shards, tmp_path, cfg), 2, max_restarts=0)
    # Had rank 0 stepped alone, or rank 1 stepped with its NaN gradient, a rank's weights
    # would differ or be NaN: every save checks every rank's weights and would refuse.
    assert result["step"] == 39 and result["val_accuracy"] > 0.8
    folders = sorted((tmp_path / "ckpt").glob("step-*"))
    assert folders and all(int(f.name[5:]) > NAN_STEP for f in folders)  # keep=3: the last
    for folder in folders:
        state = json.loads((folder / "train_state.json").read_text())
        assert state["totals"]["nonfinite_steps"] == 1.0, folder
        tensors = _checkpoint_tensors(folder, tmp_path)
        assert tensors and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_nans_past_the_limit_stop_the_job_naming_the_step_without_a_retry(
    tiny_shards, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("GRADLINE_FAULT", f"nan:rank=0:step={NAN_STEP}:steps=20")
    cfg = _config(train={"max_nonfinite_steps": 3}, runtime={"checkpoint_every_steps": 4})
    with pytest.raises(TrainingCannotContinue) as stop:
        launch_workers(train_job(tiny_shards, tmp_path, cfg), 2, max_restarts=2)
    message = str(stop.value)
    assert stop.value.exit_code == USER_ERROR_EXIT_CODE
    assert f"steps {NAN_STEP} to {NAN_STEP + 2}" in message, message
    # Steps 6 and 7 were skipped, so the checkpoint after them (8) still holds finite
    # weights and is the one named; none is written once the job stopped.
    assert "last finite checkpoint is" in message and "step-00000008" in message, message
    assert "a retry would fail the same way" in message
    folders = sorted((tmp_path / "ckpt").glob("step-*"))
    assert [f.name for f in folders] == ["step-00000004", "step-00000008"]
    for folder in folders:
        tensors = _checkpoint_tensors(folder, tmp_path)
        assert tensors and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
