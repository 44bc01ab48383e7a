"""Models. Plain nn.Modules with no distributed code: wrapping happens in training.dist."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild the architecture; saved beside the weights."""

    in_features: int
    num_classes: int
    hidden: int
    dropout: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class MLPClassifier(nn.Module):
    """Two hidden layers are enough for 8x8 digits (~97% test accuracy) and train in seconds."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(spec.in_features, spec.hidden),
            nn.ReLU(),
            nn.Dropout(spec.dropout),
            nn.Linear(spec.hidden, spec.hidden),
            nn.ReLU(),
            nn.Dropout(spec.dropout),
            nn.Linear(spec.hidden, spec.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(spec: ModelSpec) -> MLPClassifier:
    return MLPClassifier(spec)
