"""Helpers shared by the benchmark scripts (not imported by gradline itself)."""

from __future__ import annotations

import math
import time
from pathlib import Path

from training.config import DataConfig, ShardConfig
from training.data.ingest import ingest
from training.data.shards import write_shards


def make_synthetic_shards(
    folder: Path, rows: int, row_bytes: int, shard_mb: float = 64.0
) -> tuple[Path, Path]:
    """Synthetic rows of about `row_bytes` bytes (float32 features) through the real
    ingest and shard stages. Returns (raw_dir, shard_dir)."""
    features = max(1, row_bytes // 4)
    cfg = DataConfig(source="synthetic", synthetic_rows=rows, synthetic_shape=[features])
    raw, shards = folder / "raw", folder / "shards"
    ingest(cfg, folder, raw, folder / "quarantine", folder / "ingest.json")
    write_shards(ShardConfig(target_shard_mb=shard_mb), raw, shards, "benchmark")
    return raw, shards


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def fmt(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4g}"
