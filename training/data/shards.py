"""Shard: split raw rows into train/val/test and write uncompressed Arrow IPC shards.

A row's split is a pure function of its key (a stable hash), so it never moves when rows
are added. Shards are uncompressed, one record batch each, so readers can memory-map
them and view columns without a copy. `manifest.json` describes everything a reader
needs and lets it verify what it reads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from training.atomic import atomic_dir, write_json
from training.config import ShardConfig
from training.data.sources import FEATURES, LABEL, ROW_KEY
from training.errors import DataError

SPLITS = ("train", "val", "test")
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def split_of(row_key: str, val_fraction: float, test_fraction: float) -> str:
    """Stable split assignment: blake2b of the key mapped to [0, 1)."""
    digest = hashlib.blake2b(row_key.encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "val"
    return "train"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_raw(raw_dir: Path) -> pa.Table:
    files = sorted(raw_dir.glob("*.parquet"))
    if not files:
        raise DataError(f"no Parquet files in {raw_dir}; run the ingest stage first")
    return pa.concat_tables(pq.read_table(f) for f in files)


def _write_shard(table: pa.Table, path: Path) -> dict[str, Any]:
    # One record batch per file, uncompressed: a memory-mapped reader views it zero-copy.
    batch = table.combine_chunks().to_batches(max_chunksize=max(table.num_rows, 1))[0]
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        writer.write_batch(batch)
    return {"file": path.name, "rows": table.num_rows, "sha256": file_sha256(path)}


def write_shards(cfg: ShardConfig, raw_dir: Path, out_dir: Path, data_version: str) -> dict:
    """Split and shard `raw_dir` into `out_dir` (replaced whole, only on success)."""
    table = _read_raw(raw_dir)
    keys = table.column(ROW_KEY).to_pylist()
    split = np.array([split_of(k, cfg.val_fraction, cfg.test_fraction) for k in keys])
    width = table.schema.field(FEATURES).type.list_size
    labels = table.column(LABEL).to_numpy()
    manifest: dict[str, Any] = {
        "version": MANIFEST_VERSION,
        "data_version": data_version,
        "schema": {f.name: str(f.type) for f in table.schema},
        "feature_shape": [width],
        "num_classes": int(labels.max()) + 1,
        "splits": {},
    }
    with atomic_dir(out_dir) as staging:
        for name in SPLITS:
            part = table.filter(pa.array(split == name))
            shards = []
            for n, start in enumerate(range(0, part.num_rows, cfg.rows_per_shard)):
                chunk = part.slice(start, cfg.rows_per_shard)
                shards.append(_write_shard(chunk, staging / f"{name}-{n:05d}.arrow"))
            if not shards:
                raise DataError(
                    f"split {name!r} is empty ({table.num_rows} rows in all); "
                    "use more rows (data.max_rows) or larger shard fractions"
                )
            manifest["splits"][name] = {"rows": part.num_rows, "shards": shards}
        write_json(staging / MANIFEST, manifest)
    return manifest


def read_manifest(shard_dir: Path) -> dict[str, Any]:
    path = shard_dir / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} not found; run the shard stage first (dvc repro shard)")
    manifest = json.loads(path.read_text())
    if manifest.get("version") != MANIFEST_VERSION:
        raise DataError(
            f"{path} has manifest version {manifest.get('version')}, this gradline reads "
            f"version {MANIFEST_VERSION}; re-run the shard stage"
        )
    return manifest


def split_digest(manifest: dict[str, Any], split: str) -> str:
    """One checksum for a whole split: equal digests mean the very same rows."""
    joined = "".join(s["sha256"] for s in manifest["splits"][split]["shards"])
    return hashlib.sha256(joined.encode()).hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    rows: int
    sha256: str


def split_shards(shard_dir: Path, manifest: dict[str, Any], split: str) -> list[ShardInfo]:
    return [
        ShardInfo(shard_dir / s["file"], s["rows"], s["sha256"])
        for s in manifest["splits"][split]["shards"]
    ]
