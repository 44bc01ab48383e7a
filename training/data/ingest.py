"""Ingest: snapshot the configured source into data/raw/ as Parquet (DVC tracks it)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from training.atomic import atomic_dir
from training.config import DataConfig
from training.data.sources import load_source
from training.errors import DataError


def ingest(cfg: DataConfig, raw_dir: Path) -> int:
    """Write the source to `raw_dir` (replaced whole, only on success). Returns rows."""
    table = load_source(cfg)
    if table.num_rows == 0:
        raise DataError(f"source {cfg.source!r} produced no rows; check data.max_rows")
    with atomic_dir(raw_dir) as staging:
        pq.write_table(table, staging / f"{cfg.source}.parquet")
    return table.num_rows
