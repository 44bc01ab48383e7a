"""Each step seeds the random streams it draws from (dropout) from (seed, data-parallel
rank, pipeline stage, step) alone, and cheaply: no stack trace formatted per step."""

from __future__ import annotations

import traceback

import torch

from training.engine.loop import seed_step, step_seed
from training.engine.topology import Topology


def _topo(rank: int) -> Topology:
    return Topology(rank, 2, rank, "gloo", torch.device("cpu"))


def _mask(rank: int, step: int) -> torch.Tensor:
    seed_step(7, _topo(rank), step)
    return torch.nn.functional.dropout(torch.ones(256), p=0.5, training=True)


def test_a_steps_draws_depend_on_the_step_and_rank_only():
    torch.manual_seed(123)  # whatever came before the step does not matter
    first = _mask(0, 5)
    torch.rand(1000)
    assert torch.equal(_mask(0, 5), first)
    assert not torch.equal(_mask(0, 6), first)
    assert not torch.equal(_mask(1, 5), first)


def test_the_draws_are_those_of_torch_manual_seed():
    # What a job seeded before this change drew: a resume across it stays bitwise.
    torch.manual_seed(step_seed(7, _topo(1), 9))
    before = torch.nn.functional.dropout(torch.ones(256), p=0.5, training=True)
    assert torch.equal(_mask(1, 9), before)


def test_seeding_a_step_formats_no_stack_trace(monkeypatch):
    formatted = []
    real = traceback.format_stack
    monkeypatch.setattr(traceback, "format_stack", lambda *a: formatted.append(1) or real(*a))
    for step in range(10):
        seed_step(7, _topo(0), step)
    assert formatted == []
