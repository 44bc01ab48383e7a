"""Shard: split raw rows into train/val/test and write uncompressed Arrow IPC shards.

A row's split is a pure function of its key (training.data.manifest), so it never moves
when rows are added. Shards are uncompressed, one record batch each, so readers can memory-map
them and view columns without a copy. `manifest.json` describes everything a reader
needs and lets it verify what it reads, and carries the train split's statistics that
standardize table features (and regression targets) inside the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from training.atomic import atomic_dir, write_json
from training.data.manifest import (
    MANIFEST,
    MANIFEST_VERSION,
    SPLITS,
    ensure_room_for_shards,
    file_sha256,
    split_codes,
)
from training.data.options import USER_TABLE_SOURCES, ShardConfig
from training.data.sources import FEATURES, LABEL, ROW_KEY, RawLayout
from training.data.text import is_text_snapshot
from training.data.tokens import write_token_shards
from training.errors import DataError
from training.progress import Progress

# A standard deviation below this is a constant column: it is divided by 1 instead, so
# standardizing never blows a constant up into noise.
MIN_STD = 1e-6


class RunningMoments:
    """Mean and standard deviation per column, merged batch by batch (Chan et al.'s
    parallel update) in float64, so a split of any size streams through once."""

    def __init__(self) -> None:
        self.count = 0
        self.mean: np.ndarray | None = None
        self.m2: np.ndarray | None = None  # sum of squared deviations from the mean

    def add(self, values: np.ndarray) -> None:
        """Rows of `values` (rows, columns) join the statistics."""
        if not len(values):
            return
        batch = np.asarray(values, dtype=np.float64)
        n = len(batch)
        mean = batch.mean(axis=0)
        m2 = np.square(batch - mean).sum(axis=0)
        if self.mean is None or self.m2 is None:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + np.square(delta) * (self.count * n / total)
        self.count = total

    def result(self) -> tuple[list[float], list[float]]:
        """(mean, std) per column; the population std, floored at MIN_STD to 1."""
        if self.mean is None or self.m2 is None:
            raise ValueError("no rows were added")
        std = np.sqrt(self.m2 / self.count)
        return self.mean.tolist(), np.where(std < MIN_STD, 1.0, std).tolist()


def _train_statistics(
    table: pa.Table,
    layout: RawLayout,
    features: RunningMoments | None,
    labels: RunningMoments | None,
) -> None:
    """Feed one batch of train rows to the running statistics."""
    if features is not None:
        column = table.column(FEATURES).combine_chunks()
        flat = column.flatten().to_numpy(zero_copy_only=False)
        features.add(flat.reshape(-1, layout.width))
    if labels is not None:
        labels.add(table.column(LABEL).to_numpy().reshape(-1, 1))


class IdCounts:
    """Distinct ids and the largest id of each id column, over every row: what sizes the
    embedding tables (training.data.spec). Ids are below 2**24, so one bitmap of seen ids
    per column (16 MB) counts them exactly in one streaming pass."""

    ID_LIMIT = 1 << 24

    def __init__(self, columns: int) -> None:
        self.seen = [np.zeros(self.ID_LIMIT, dtype=bool) for _ in range(columns)]

    def add(self, table: pa.Table, layout: RawLayout) -> None:
        if not self.seen or not table.num_rows:
            return
        flat = table.column(FEATURES).combine_chunks().flatten().to_numpy(zero_copy_only=False)
        ids = flat.reshape(-1, layout.width)[:, : len(self.seen)].astype(np.int64)
        if ids.min() < 0 or ids.max() >= self.ID_LIMIT:
            raise DataError(
                f"id columns {list(layout.categorical_columns)} hold values outside "
                f"0..2**24-1; ids are codes from ingest (re-run the ingest stage)"
            )
        for column, seen in enumerate(self.seen):
            seen[ids[:, column]] = True

    def result(self, layout: RawLayout) -> dict[str, Any] | None:
        if not self.seen:
            return None
        return {
            "columns": list(layout.categorical_columns),
            # A user's raw ids were hashed at ingest (the registered model hashes them
            # too); a built-in source's ids are its own integers.
            "hashed": layout.source in USER_TABLE_SOURCES,
            "distinct": [int(seen.sum()) for seen in self.seen],
            "bound": [int(np.flatnonzero(seen)[-1]) + 1 if seen.any() else 0 for seen in self.seen],
        }


def _raw_files(raw_dir: Path) -> list[Path]:
    files = sorted(raw_dir.glob("*.parquet"))
    if not files:
        raise DataError(f"no Parquet files in {raw_dir}; run the ingest stage first")
    return files


class _SplitWriter:
    """Buffers one split's rows and writes a shard each time the buffer reaches the target
    size: memory stays about one shard per split, whatever the data size."""

    def __init__(self, name: str, folder: Path, target_bytes: int) -> None:
        self.name, self.folder, self.target_bytes = name, folder, target_bytes
        self.pending: list[pa.Table] = []
        self.pending_bytes = 0
        self.shards: list[dict[str, Any]] = []
        self.rows = 0

    def add(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        self.pending.append(table)
        self.pending_bytes += table.nbytes
        if self.pending_bytes >= self.target_bytes:
            buffered = pa.concat_tables(self.pending)
            rows_per_shard = max(1, int(self.target_bytes * buffered.num_rows / buffered.nbytes))
            while buffered.num_rows >= rows_per_shard:
                self._write(buffered.slice(0, rows_per_shard))
                buffered = buffered.slice(rows_per_shard)
            self.pending = [buffered] if buffered.num_rows else []
            self.pending_bytes = buffered.nbytes if buffered.num_rows else 0

    def flush(self) -> None:
        if self.pending:
            self._write(pa.concat_tables(self.pending))
            self.pending, self.pending_bytes = [], 0

    def _write(self, table: pa.Table) -> None:
        table = table.combine_chunks()
        path = self.folder / f"{self.name}-{len(self.shards):05d}.arrow"
        # One record batch per file, uncompressed: a memory-mapped reader views it zero-copy.
        batch = table.to_batches(max_chunksize=table.num_rows)[0]
        with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
            writer.write_batch(batch)
        self.shards.append({"file": path.name, "rows": table.num_rows, "sha256": file_sha256(path)})
        self.rows += table.num_rows


def write_shards(
    cfg: ShardConfig, raw_dir: Path, out_dir: Path, data_version: str, batch_rows: int = 65536
) -> dict:
    """Split and shard `raw_dir` into `out_dir` (replaced whole, only on success)."""
    if is_text_snapshot(raw_dir):  # documents: tokenized into token shards instead
        return write_token_shards(cfg, raw_dir, out_dir, data_version)
    files = _raw_files(raw_dir)
    schema = pq.read_schema(files[0])
    layout = RawLayout.of(schema)
    kind = "table" if len(layout.feature_shape) == 1 else "image"
    # Tables are standardized inside the model; images are left as they are.
    feature_moments = RunningMoments() if kind == "table" else None
    label_moments = RunningMoments() if layout.label_type == "float32" else None
    id_counts = IdCounts(len(layout.categorical_columns))
    target = max(1, int(cfg.target_shard_mb * 2**20))
    rows_in = sum(pq.ParquetFile(path).metadata.num_rows for path in files)
    ensure_room_for_shards(out_dir, files)
    with atomic_dir(out_dir) as staging, Progress("shard", rows_in, "rows") as progress:
        writers = [_SplitWriter(name, staging, target) for name in SPLITS]
        total = 0
        for path in files:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
                table = pa.Table.from_batches([batch], schema=schema)
                id_counts.add(table, layout)
                keys = table.column(ROW_KEY).to_numpy()
                codes = split_codes(keys, cfg.val_fraction, cfg.test_fraction)
                for code, writer in enumerate(writers):
                    rows = table.filter(pa.array(codes == code))
                    writer.add(rows)
                    if writer.name == "train":
                        _train_statistics(rows, layout, feature_moments, label_moments)
                total += table.num_rows
                progress.advance(table.num_rows)
        for writer in writers:
            writer.flush()
            if not writer.shards:
                raise DataError(
                    f"split {writer.name!r} is empty ({total} rows in all); use more rows "
                    "(data.max_rows) or larger shard.val_fraction / shard.test_fraction"
                )
        manifest: dict[str, Any] = {
            "version": MANIFEST_VERSION,
            "data_version": data_version,
            "schema": {f.name: str(f.type) for f in schema},
            "kind": kind,
            "feature_shape": list(layout.feature_shape),
            "num_classes": layout.num_classes,
            "label_type": layout.label_type,
            "feature_names": list(layout.feature_names) if layout.feature_names else None,
            "categorical": id_counts.result(layout),
            "feature_stats": _stats(feature_moments),
            "label_stats": _stats(label_moments, scalar=True),
            "splits": {w.name: {"rows": w.rows, "shards": w.shards} for w in writers},
        }
        write_json(staging / MANIFEST, manifest)
    return manifest


def _stats(moments: RunningMoments | None, scalar: bool = False) -> dict[str, Any] | None:
    if moments is None:
        return None
    mean, std = moments.result()
    return {"mean": mean[0], "std": std[0]} if scalar else {"mean": mean, "std": std}
