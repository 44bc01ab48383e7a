"""A small temporal convolution network (TCN) for forecasting windows.

The window's first `context` features are a series of past values; they pass through
causal dilated 1-D convolutions (each output sees only its own time and earlier ones;
dilations 1, 2, 4, ... widen the receptive field exponentially with depth), with a
residual path around each block. The last time step's channels, joined with the
window's covariates (the features after the context), make the `horizon` forecasts
through one linear layer. A linear path from the raw context to the output sits beside
it, as in the MLP: the net starts as a linear autoregression and learns what that
misses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalBlock(nn.Module):
    """Two causal dilated convolutions with a residual connection."""

    def __init__(self, channels: int, kernel_size: int, dilation: int, dropout: float) -> None:
        super().__init__()
        # Left padding only: the output at time t never sees t+1.
        self.pad = (kernel_size - 1) * dilation
        self.conv1 = nn.Conv1d(channels, channels, kernel_size, dilation=dilation)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size, dilation=dilation)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dropout(F.gelu(self.conv1(F.pad(x, (self.pad, 0)))))
        h = self.dropout(F.gelu(self.conv2(F.pad(h, (self.pad, 0)))))
        return x + h


class TCN(nn.Module):
    def __init__(
        self,
        context: int,
        covariates: int,
        horizon: int,
        *,
        channels: int,
        layers: int,
        kernel_size: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Conv1d(1, channels, 1)
        self.blocks = nn.Sequential(
            *(CausalBlock(channels, kernel_size, 2**i, dropout) for i in range(layers))
        )
        self.head = nn.Linear(channels + covariates, horizon)
        self.linear = nn.Linear(context, horizon, bias=False)
        # Starts as the linear path alone (see the module docstring).
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        past, covariates = x[:, : self.context], x[:, self.context :]
        h = self.blocks(self.embed(past.unsqueeze(1)))  # (B, channels, context)
        last = h[:, :, -1]
        return self.head(torch.cat([last, covariates], dim=1)) + self.linear(past)
