"""Forecasting windows seen relative to their last observed value.

A window's features are its `context` past values (scaled by the series' train-span
mean and std), then its covariates. Series with a trend (prices, GDP, CO2) leave the
train span's range soon after the cutoff: a network fed absolute levels then sees
inputs it never trained on and extrapolates badly, often worse than repeating the last
value. Subtracting the last value from the past values and adding it back to every
predicted step makes the model level-invariant: it learns the shape of what comes next
(the seasonal swing, the slope), and its zero output is the last-value forecast, the
naive baseline it starts from.
"""

from __future__ import annotations

import torch
from torch import nn


class LevelRelative(nn.Module):
    """Wraps `model`: past values - last value -> model -> outputs + last value."""

    def __init__(self, model: nn.Module, context: int) -> None:
        super().__init__()
        if context < 1:
            raise ValueError(f"a forecasting window needs a context of at least 1, got {context}")
        self.model = model
        self.context = int(context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1)
        last = flat[:, self.context - 1 : self.context]
        past = flat[:, : self.context] - last
        out = self.model(torch.cat([past, flat[:, self.context :]], dim=1).reshape(x.shape))
        # The last value in float32 even under bf16 autocast: it carries the level.
        return out.float() + last.float()
