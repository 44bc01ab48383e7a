"""Embedding tables over sparse categorical ids: one table per categorical feature.

This is the part of a recommendation model that outgrows one device: the dense layers
are small, the tables grow with the number of users and items. It is plain model code;
the parallel layer may swap it for a module that keeps each table (or each table's
rows) on one rank (training.engine.embedding_sharding), with the same `forward`.

Ids arrive as exact integers of any size below 2**24 (the data plane's id codes fit a
float32 feature column exactly) and are hashed into each table's rows by remainder, so
a table smaller than its id space (`model.table_rows`) still takes every id.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class EmbeddingTables(nn.Module):
    """ids (N, C) int64 -> embeddings (N, C, dim); table i has `rows[i]` rows."""

    def __init__(self, rows: Sequence[int], dim: int) -> None:
        super().__init__()
        if not rows or min(rows) < 1:
            raise ValueError(f"every table needs at least one row, got rows={list(rows)}")
        self.rows = tuple(int(r) for r in rows)
        self.dim = int(dim)
        self.tables = nn.ModuleList(nn.Embedding(r, dim) for r in self.rows)
        for table in self.tables:
            # Small enough that the first dot interactions are near zero, large enough
            # that rows start apart.
            nn.init.normal_(table.weight, std=dim**-0.5)

    def bucketed(self, ids: torch.Tensor) -> torch.Tensor:
        """Each column's ids as rows of its table (remainder by the table's size)."""
        sizes = torch.tensor(self.rows, dtype=torch.int64, device=ids.device)
        return torch.remainder(ids.long(), sizes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.bucketed(ids)
        return torch.stack([table(rows[:, i]) for i, table in enumerate(self.tables)], dim=1)

    def state_bytes(self) -> int:
        """Bytes of the tables' weights held by this process."""
        return sum(t.weight.numel() * t.weight.element_size() for t in self.tables)
