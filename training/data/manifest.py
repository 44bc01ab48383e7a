"""The shard folder's shared facts: its manifest, its splits, and its shard files.

Both writers (training.data.shards for rows, training.data.tokens for token streams)
write `manifest.json` with this layout, and every reader goes through `read_manifest`
and `split_shards`. A row's (or document's) split is a pure function of its key (a
stable hash), so it never moves when data is added.
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

from training.data.hashing import unit_interval
from training.data.integrity import ensure_shard_intact, file_sha256
from training.errors import DataError, ensure_free

SPLITS = ("train", "val", "test")
MANIFEST = "manifest.json"
MANIFEST_VERSION = 3
_SPLIT_SALT = 0x5EED_5B11


def split_codes(keys: np.ndarray, val_fraction: float, test_fraction: float) -> np.ndarray:
    """0 train, 1 val, 2 test: a pure function of each row's key, so a row keeps its split
    however many rows are added around it."""
    u = unit_interval(keys, _SPLIT_SALT)
    return np.where(u < test_fraction, 2, np.where(u < test_fraction + val_fraction, 1, 0))


def ensure_room_for_shards(out_dir: Path, raw_files: list[Path], per_value: float = 1.0) -> None:
    """Fail before sharding when the shards cannot fit beside the old ones (kept until
    the swap): their size is about the raw data's uncompressed size (Parquet's row-group
    metadata), times `per_value` (token ids per byte of text, times their width)."""
    uncompressed = 0
    for path in raw_files:
        meta = pq.ParquetFile(path).metadata
        uncompressed += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    ensure_free(out_dir.parent, int(uncompressed * per_value))


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

    def map(self, unit: str = "rows") -> pa.RecordBatch:
        """The shard's one record batch, memory-mapped (columns are zero-copy views onto
        the file), after checking its checksum (once per process) and that it holds as
        many `unit` as the manifest says."""
        ensure_shard_intact(self.path, self.sha256)
        try:
            batch = ipc.open_file(pa.memory_map(str(self.path), "r")).get_batch(0)
        except (OSError, pa.ArrowInvalid) as exc:
            raise DataError(f"cannot read shard {self.path}: {exc}; re-run shard") from exc
        if batch.num_rows != self.rows:
            raise DataError(
                f"shard {self.path} has {batch.num_rows} {unit}, the manifest says "
                f"{self.rows}; re-run the shard stage"
            )
        return batch


def split_shards(shard_dir: Path, manifest: dict[str, Any], split: str) -> list[ShardInfo]:
    return [
        ShardInfo(shard_dir / s["file"], s["rows"], s["sha256"])
        for s in manifest["splits"][split]["shards"]
    ]
