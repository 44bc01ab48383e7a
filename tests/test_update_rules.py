"""Update rules in one process: when they sync, what DiLoCo's outer step does, and which
checkpoints they can resume from (the multi-process behaviour is in test_updates)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from training.config import UpdateConfig
from training.engine.topology import Topology
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
    update = UpdateConfig(rule="diloco", sync_every=2, outer_lr=0.5, outer_momentum=0.0)
    rule = DiLoCo(model, world_size=1, update=update)
    _local_step(model, 1.0)
    rule.after_step(1)  # not due
    _local_step(model, 1.0)
    rule.after_step(2)  # due: replica = start + 2, pseudo-gradient -2, anchor += 1
    for p, s in zip(model.parameters(), start, strict=True):
        torch.testing.assert_close(p.detach(), s + 1.0)

    model = _model()
    rule = DiLoCo(model, 1, UpdateConfig(sync_every=1, outer_lr=1.0, outer_momentum=0.9))
    _local_step(model, 1.0)
    rule.after_step(1)  # g = -1: buf = -1, Nesterov step g + 0.9 buf = -1.9: anchor +1.9
    _local_step(model, 1.0)
    rule.after_step(2)  # g = -1: buf = 0.9 x -1 - 1 = -1.9, step -1 + 0.9 x -1.9 = -2.71
    for p, s in zip(model.parameters(), start, strict=True):
        torch.testing.assert_close(p.detach(), s + 1.9 + 2.71)


def test_diloco_state_restores_the_anchor_and_the_outer_momentum() -> None:
    update = UpdateConfig(sync_every=1, outer_lr=0.7, outer_momentum=0.9)
    model = _model()
    rule = DiLoCo(model, 1, update)
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
    resumed = DiLoCo(again, 1, update)
    resumed.load_state_dict(saved)
    _local_step(again, 0.5)
    resumed.after_step(2)
    for got, want in zip(again.parameters(), expected, strict=True):
        assert torch.equal(got.detach(), want)


def _ranks(world: int, nodes: int = 1) -> Topology:
    """Rank 0 of `world` workers on `nodes` nodes, as elastic's environment says."""
    env = {"WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world // nodes, "GROUP_WORLD_SIZE": nodes}
    return Topology.from_env("gloo", {k: str(v) for k, v in env.items()})


def test_replicas_that_differ_resume_only_on_as_many_ranks() -> None:
    local = LocalSGD(_model(), world_size=2, every=4, warmup=0)
    assert check_replicas(local, 2, _ranks(2)) is True
    with pytest.raises(ConfigError, match=r"resume it on 2 workers \(runtime\.procs_per_node=2\)"):
        check_replicas(local, 2, _ranks(4))
    # Synchronous replicas are identical: any size resumes (per-rank extras are dropped).
    assert check_replicas(SyncEveryStep(), 2, _ranks(4)) is False
    assert check_replicas(SyncEveryStep(), None, _ranks(4)) is True


def test_a_resume_message_counts_workers_per_node_on_many_nodes() -> None:
    """8 replicas written by 2 nodes of 4, resumed by 2 nodes of 2: the user sets
    runtime.procs_per_node to 4 on each node, not to the job's 8."""
    local = LocalSGD(_model(), world_size=4, every=4, warmup=0)
    message = r"8 workers \(runtime\.procs_per_node=4 on each of 2 nodes \(8 workers\)\)"
    with pytest.raises(ConfigError, match=message):
        check_replicas(local, 8, _ranks(4, nodes=2))
