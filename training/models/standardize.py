"""Raw data in, the label's units out: standardization held inside the model.

Tables are standardized with the train split's statistics, and regression outputs are
mapped back to the label's units, by buffers saved with the weights. So the registered
model takes raw rows and predicts real values with no preprocessing beside it, and the
model inside sees inputs and learns targets of scale about 1 whatever the data's units.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

# A feature whose train-split spread is below this (a constant column, such as the always
# blank border pixels of digits) is only centred: dividing by ~0 would blow up its noise.
MIN_STD = 1e-6


class Standardized(nn.Module):
    """Wraps `model`: features -> (x - mean) / std -> model -> out * label_std + label_mean.

    Either part is optional: `feature_mean`/`feature_std` (one value per flattened
    feature) for tables; `label_mean`/`label_std` for regression, whose (B, 1) or (B,)
    output becomes (B,).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        feature_mean: Sequence[float] | None = None,
        feature_std: Sequence[float] | None = None,
        label_mean: float | None = None,
        label_std: float | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.scales_features = feature_mean is not None
        self.regression = label_mean is not None
        if self.scales_features:
            std = torch.tensor(feature_std, dtype=torch.float32)
            self.register_buffer("feature_mean", torch.tensor(feature_mean, dtype=torch.float32))
            self.register_buffer("feature_std", torch.where(std > MIN_STD, std, 1.0))
        if self.regression:
            std = label_std if label_std and label_std > MIN_STD else 1.0
            self.register_buffer("label_mean", torch.tensor(float(label_mean)))
            self.register_buffer("label_std", torch.tensor(float(std)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales_features:
            flat = x.reshape(x.shape[0], -1)
            x = ((flat - self.feature_mean) / self.feature_std).reshape(x.shape)
        out = self.model(x)
        if self.regression:
            # In float32 even under bf16 autocast: the label's units need the precision.
            out = out.reshape(out.shape[0]).float() * self.label_std + self.label_mean
        return out
