"""A DLRM-style recommendation model: embedding tables, a bottom MLP, dot interactions.

A row is `num_categorical` id codes followed by dense values (training.data.spec). Each
id column has its own embedding table (all of them one `EmbeddingTables` module, the
part the parallel layer may shard across ranks); the dense values go through the bottom
MLP to a vector of the embedding's width. The model's signal is in how these vectors
meet: the dot product of every pair of them (user with item, item with category, dense
with user, ...) is a feature, and the top MLP turns those dots and the bottom vector
into one logit per row. The dots are what a factorization model scores, so the model is
at least a factorization machine over the ids and can learn more on top of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from training.models.embedding_tables import EmbeddingTables


def _mlp(width: int, hidden: Sequence[int], out: int, last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    layers.append(nn.Linear(width, out))
    if last_activation:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """(N, num_categorical + num_dense) float rows -> (N, out) logits."""

    def __init__(
        self,
        table_rows: Sequence[int],
        num_dense: int,
        out_features: int = 1,
        *,
        embedding_dim: int,
        bottom: Sequence[int],
        top: Sequence[int],
    ) -> None:
        super().__init__()
        self.num_categorical = len(table_rows)
        self.num_dense = int(num_dense)
        # The one module holding every table: the embedding sharding swaps exactly this.
        self.embeddings = EmbeddingTables(table_rows, embedding_dim)
        # Dense features -> one more vector of the embedding's width (ReLU keeps it in the
        # same non-negative-ish range the dots are learned over). None without dense data.
        self.bottom = (
            _mlp(self.num_dense, bottom, embedding_dim, last_activation=True)
            if self.num_dense
            else None
        )
        vectors = self.num_categorical + (1 if self.bottom is not None else 0)
        pairs = vectors * (vectors - 1) // 2
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        # Which entries of the (vectors x vectors) dot matrix are features: each pair once.
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        top_in = pairs + (embedding_dim if self.bottom is not None else 0)
        self.top = _mlp(max(top_in, 1), top, out_features, last_activation=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1)
        ids = x[:, : self.num_categorical].long()
        vectors = self.embeddings(ids)  # (N, C, dim)
        parts: list[torch.Tensor] = []
        if self.bottom is not None:
            dense = self.bottom(x[:, self.num_categorical :].float())  # (N, dim)
            vectors = torch.cat([dense.unsqueeze(1).to(vectors.dtype), vectors], dim=1)
            parts.append(dense)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))  # (N, V, V)
        parts.append(dots[:, self.pair_rows, self.pair_cols])
        features = torch.cat(parts, dim=1)
        if features.shape[1] == 0:  # one id column, no dense: nothing to interact
            features = vectors.sum(dim=(1, 2)).unsqueeze(1)
        return self.top(features)
