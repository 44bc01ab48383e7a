"""A small ResNet for image-shaped features: (H, W) or (C, H, W) per example.

GroupNorm, not BatchNorm: BatchNorm's statistics depend on each rank's local batch, so a
run on 1 rank and on N ranks would compute different models from the same global batch.
GroupNorm normalises each example on its own, which keeps that agreement.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _norm(channels: int) -> nn.GroupNorm:
    # Up to 8 groups that divide the channels (1 group on odd widths: LayerNorm-like).
    return nn.GroupNorm(math.gcd(channels, 8), channels)


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut; a 1x1 projection where the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.norm1 = _norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.norm2 = _norm(out_channels)
        # Each block starts as its shortcut, so a deep stack trains like a shallow one at first.
        nn.init.zeros_(self.norm2.weight)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), _norm(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, `stages` stages of `blocks` residual blocks (each stage after the first halves
    the image and doubles the channels), global average pooling, a linear head."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        out_features: int,
        *,
        channels: int,
        stages: int,
        blocks: int,
        dropout: float,
    ) -> None:
        super().__init__()
        if len(input_shape) not in (2, 3):
            raise ValueError(f"ResNet takes (H, W) or (C, H, W) inputs, not {input_shape}")
        # Stored so forward also takes flattened rows, as a table of pixels would give.
        self.image_shape = tuple(input_shape) if len(input_shape) == 3 else (1, *input_shape)
        self.stem = nn.Sequential(
            nn.Conv2d(self.image_shape[0], channels, 3, padding=1, bias=False),
            _norm(channels),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        width = channels
        for stage in range(stages):
            out_width = channels * 2**stage
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(ResidualBlock(width, out_width, stride))
                width = out_width
        self.stages = nn.Sequential(*layers)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.image_shape)
        x = self.stages(self.stem(x))
        x = x.mean(dim=(2, 3))  # global average pooling
        return self.head(self.dropout(x))
