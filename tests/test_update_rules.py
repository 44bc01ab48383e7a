"""Update rules in one process: when they sync, what DiLoCo's outer step does, and which
checkpoints they can resume from (the multi-process behaviour is in test_updates)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from training.config import ParallelConfig
from training.engine.updates import DiLoCo, LocalSGD, SyncEveryStep, check_replicas
from training.errors import ConfigError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _local_step(model: nn.Module, delta: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)


def test_local_sgd_syncs_every_h_steps_after_the_warmup() -> None:
    rule = LocalSGD(_model(), world_size=1, every=3, warmup=2)
    assert [rule.syncs_gradients(s) for s in range(4)] == [True, True, False, False]
    assert [rule._due(done) for done in range(1, 10)] == [
        False, False, False, False, True, False, False, True, False,
    ]  # fmt: skip


def test_diloco_moves_the_anchor_by_the_outer_step_of_the_replicas_mean_change() -> None:
    """One replica (its mean is itself): the pseudo-gradient is anchor - replica; plain
    SGD with outer_lr 0.5 moves the anchor halfway, and the replica restarts there;
    Nesterov momentum 0.9 then adds 0.9 x the previous step to the next one."""
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    par = ParallelConfig(update="diloco", outer_lr=0.5, outer_momentum=0.0)
    rule = DiLoCo(model, world_size=1, every=2, warmup=0, par=par)
    _local_step(model, 1.0)
    rule.after_step(1)  # not due
    _local_step(model, 1.0)
    rule.after_step(2)  # due: replica = start + 2, pseudo-gradient -2, anchor += 1
    for p, s in zip(model.parameters(), start, strict=True):
        torch.testing.assert_close(p.detach(), s + 1.0)

    model = _model()
    rule = DiLoCo(model, 1, 1, 0, ParallelConfig(outer_lr=1.0, outer_momentum=0.9))
    _local_step(model, 1.0)
    rule.after_step(1)  # g = -1: buf = -1, Nesterov step g + 0.9 buf = -1.9: anchor +1.9
    _local_step(model, 1.0)
    rule.after_step(2)  # g = -1: buf = 0.9 x -1 - 1 = -1.9, step -1 + 0.9 x -1.9 = -2.71
    for p, s in zip(model.parameters(), start, strict=True):
        torch.testing.assert_close(p.detach(), s + 1.9 + 2.71)


def test_diloco_state_restores_the_anchor_and_the_outer_momentum() -> None:
    par = ParallelConfig(outer_lr=0.7, outer_momentum=0.9)
    model = _model()
    rule = DiLoCo(model, 1, 1, 0, par)
    _local_step(model, 0.5)
    rule.after_step(1)
    saved = copy.deepcopy(rule.state_dict())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    _local_step(model, 0.5)
    rule.after_step(2)
    expected = [p.detach().clone() for p in model.parameters()]

    again = _model()
    with torch.no_grad():
        for n, p in again.named_parameters():
            p.copy_(weights[n])
    resumed = DiLoCo(again, 1, 1, 0, par)
    resumed.load_state_dict(saved)
    _local_step(again, 0.5)
    resumed.after_step(2)
    for got, want in zip(again.parameters(), expected, strict=True):
        assert torch.equal(got.detach(), want)


def test_replicas_that_differ_resume_only_on_as_many_ranks() -> None:
    local = LocalSGD(_model(), world_size=2, every=4, warmup=0)
    assert check_replicas(local, 2, 2) is True
    with pytest.raises(ConfigError, match=r"runtime\.world_size=2"):
        check_replicas(local, 2, 4)
    # Synchronous replicas are identical: any size resumes (per-rank extras are dropped).
    assert check_replicas(SyncEveryStep(), 2, 4) is False
    assert check_replicas(SyncEveryStep(), None, 4) is True
