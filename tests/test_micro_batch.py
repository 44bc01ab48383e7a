"""micro_batch: auto's arithmetic: what a row costs, and the fewest micro-batches that fit."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from training.config import Config
from training.engine.micro_batch import accumulation_steps, bytes_per_row, static_bytes
from training.errors import ConfigError


def _mlp(hidden: int, scale: int = 1) -> nn.Module:
    return nn.Sequential(nn.Linear(16 * scale, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def test_a_row_costs_its_activations_whatever_the_weights() -> None:
    x = torch.randn(2, 16)
    narrow = bytes_per_row(_mlp(64), x, contextlib.nullcontext)
    wide = bytes_per_row(_mlp(1024), x, contextlib.nullcontext)
    # The hidden activations (one tensor, saved by ReLU and by the second Linear: held
    # once) grow with the width; the weights, 16x more, do not count per row.
    assert 64 * 4 <= narrow < 1024 * 4 <= wide
    assert wide - narrow == pytest.approx((1024 - 64) * 4, rel=0.01)


def test_static_bytes_are_weights_gradients_and_adamw_moments() -> None:
    model = _mlp(64)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert static_bytes(model, Config()) == 4 * weights  # adamw: 2 moments
    sgd = Config.model_validate({"optim": {"name": "sgd", "momentum": 0.0}})
    assert static_bytes(model, sgd) == 2 * weights


def test_the_fewest_micro_batches_that_fit_and_always_a_divisor() -> None:
    assert accumulation_steps(32, static=100, per_row=10, budget=500) == 1
    assert accumulation_steps(32, static=100, per_row=10, budget=300) == 2  # 16 rows
    assert accumulation_steps(24, static=100, per_row=10, budget=170) == 4  # 6, not 7 rows
    with pytest.raises(ConfigError, match="even one row per micro-batch needs"):
        accumulation_steps(32, static=100, per_row=10, budget=105)


def test_auto_refuses_a_hand_set_accumulation_and_pipelines() -> None:
    with pytest.raises(ValueError, match="micro_batch: auto chooses"):
        Config.model_validate({"train": {"micro_batch": "auto", "grad_accum_steps": 2}})
