"""A multi-layer perceptron over flattened features, with a linear path beside it.

The linear path (`skip`) lets the network be at least a linear model from the first step:
the hidden path starts at zero output and only adds what a linear model misses. On small
tables (a few hundred rows) that keeps it level with a linear baseline instead of behind.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        hidden: int,
        depth: int,
        dropout: float,
        skip: bool,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        self.hidden = nn.Sequential(*layers)
        self.head = nn.Linear(width, out_features)
        self.skip = nn.Linear(in_features, out_features, bias=False) if skip else None
        if skip:
            # The model starts as the linear path alone; gradients reach the hidden layers
            # after the first step, once the head's weights leave zero.
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        out = self.head(self.hidden(x))
        if self.skip is not None:
            out = out + self.skip(x)
        return out
