"""Sources yield the input table in chunks, never whole, so any size streams through.

A chunk is an Arrow table as the source has it, with where it came from (a file, or a
built-in name) and the index of its first row there, so errors can point at real rows.
Built-in sources yield the normalized columns directly; user tables are normalized by
training.data.validate.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from training.config import DataConfig
from training.errors import DataError

ROW_KEY = "row_id"
FEATURES = "features"
LABEL = "label"
META_SHAPE = b"gradline.feature_shape"
META_CLASSES = b"gradline.num_classes"

# Built-in sources generate in fixed chunks, so their rows never depend on batch settings.
_GENERATE_ROWS = 65536


@dataclass(frozen=True)
class SourceChunk:
    origin: str
    first_row: int
    table: pa.Table


def raw_schema(shape: tuple[int, ...], num_classes: int) -> pa.Schema:
    """The normalized table every stage after ingest reads."""
    return pa.schema(
        [
            pa.field(ROW_KEY, pa.uint64(), nullable=False),
            pa.field(FEATURES, pa.list_(pa.float32(), math.prod(shape)), nullable=False),
            pa.field(LABEL, pa.int64(), nullable=False),
        ],
        metadata={
            META_SHAPE: ",".join(map(str, shape)).encode(),
            META_CLASSES: str(num_classes).encode(),
        },
    )


def shape_of(schema: pa.Schema) -> tuple[int, ...]:
    return tuple(int(d) for d in schema.metadata[META_SHAPE].decode().split(","))


def classes_of(schema: pa.Schema) -> int:
    return int(schema.metadata[META_CLASSES])


def to_table(
    keys: np.ndarray, features: np.ndarray, labels: np.ndarray, num_classes: int
) -> pa.Table:
    """A normalized table from keys, a (rows, *shape) float array and integer labels."""
    shape = tuple(features.shape[1:]) or (1,)
    flat = pa.array(np.ascontiguousarray(features, dtype=np.float32).reshape(-1))
    columns = [
        pa.array(np.asarray(keys, dtype=np.uint64)),
        pa.FixedSizeListArray.from_arrays(flat, math.prod(shape)),
        pa.array(np.asarray(labels, dtype=np.int64)),
    ]
    return pa.Table.from_arrays(columns, schema=raw_schema(shape, num_classes))


def digits_chunks(cfg: DataConfig) -> Iterator[SourceChunk]:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes): real data, no download.

    Pixels 0..16 are scaled to 0..1 here so every consumer sees the same values.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    features = bunch.data.astype(np.float32).reshape(-1, 8, 8) / 16.0
    keys = np.arange(len(bunch.target), dtype=np.uint64)
    yield SourceChunk("digits", 0, to_table(keys, features, bunch.target, 10))


def synthetic_chunks(cfg: DataConfig) -> Iterator[SourceChunk]:
    """Gaussian class clusters: deterministic by seed, learnable, generated chunk by chunk."""
    shape = tuple(cfg.synthetic_shape)
    width = math.prod(shape)
    centers = np.random.default_rng([cfg.seed, 0xC0FFEE]).standard_normal(
        (cfg.synthetic_classes, width), dtype=np.float32
    )
    for first in range(0, cfg.synthetic_rows, _GENERATE_ROWS):
        n = min(_GENERATE_ROWS, cfg.synthetic_rows - first)
        rng = np.random.default_rng([cfg.seed, first // _GENERATE_ROWS])
        labels = rng.integers(0, cfg.synthetic_classes, n)
        noise = rng.standard_normal((n, width), dtype=np.float32) * np.float32(cfg.synthetic_noise)
        features = (centers[labels] + noise).reshape(n, *shape)
        keys = np.arange(first, first + n, dtype=np.uint64)
        yield SourceChunk("synthetic", first, to_table(keys, features, labels, cfg.synthetic_classes))


def table_files(cfg: DataConfig, root: Path) -> list[Path]:
    """The user's files: one file, or every *.parquet / *.csv in a folder, sorted."""
    path = (root / cfg.path).resolve()
    suffix = f".{cfg.source}"
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob(f"*{suffix}") if p.is_file())
        if files:
            return files
        raise DataError(
            f"no {suffix} files in {cfg.path}; put the table there or set data.path "
            "to a file or folder that holds it"
        )
    raise DataError(f"data.path {cfg.path!r} does not exist (looked in {path})")


def _parquet_chunks(path: Path, batch_rows: int, shown: str) -> Iterator[SourceChunk]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
        first = 0
        for batch in reader.iter_batches(batch_size=batch_rows):
            yield SourceChunk(shown, first, pa.Table.from_batches([batch]))
            first += batch.num_rows
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(
            f"{shown}: not a readable Parquet file, truncated or corrupt ({exc}). "
            "Export it again, or remove it from data.path"
        ) from exc


def _first_invalid_utf8(path: Path) -> tuple[int, int] | None:
    """(line, byte offset) of the first byte sequence that is not UTF-8, if any."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, line = 0, 1
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                return line + block[: exc.start].count(b"\n"), offset + exc.start
            offset += len(block)
            line += block.count(b"\n")
    return None


def _not_utf8(path: Path, shown: str) -> DataError | None:
    bad = _first_invalid_utf8(path)
    if bad is None:
        return None
    return DataError(
        f"{shown}: not UTF-8 (first bad byte at line {bad[0]}, offset {bad[1]}). "
        f"Re-encode it, e.g. `iconv -f latin1 -t utf-8 {path.name}`"
    )


def _csv_chunks(path: Path, batch_rows: int, shown: str) -> Iterator[SourceChunk]:
    import pyarrow.csv as pcsv

    try:
        reader = pcsv.open_csv(path, read_options=pcsv.ReadOptions(block_size=1 << 22))
        # Arrow reads a column holding invalid UTF-8 as binary instead of failing.
        if any(pa.types.is_binary(f.type) for f in reader.schema) and (
            error := _not_utf8(path, shown)
        ):
            raise error
        first = 0
        for batch in reader:
            yield SourceChunk(shown, first, pa.Table.from_batches([batch]))
            first += batch.num_rows
    except (pa.ArrowInvalid, OSError) as exc:
        raise _not_utf8(path, shown) or DataError(
            f"{shown}: cannot be parsed as CSV ({exc}). Check the header, the delimiter "
            "and that every value in a numeric column is a number"
        ) from exc


def open_chunks(cfg: DataConfig, root: Path) -> Iterator[SourceChunk]:
    """All chunks of the configured source, in a stable order, at most data.max_rows rows."""
    if cfg.source == "digits":
        chunks = digits_chunks(cfg)
    elif cfg.source == "synthetic":
        chunks = synthetic_chunks(cfg)
    else:
        read = _parquet_chunks if cfg.source == "parquet" else _csv_chunks
        files = table_files(cfg, root)

        def _files() -> Iterator[SourceChunk]:
            for path in files:
                shown = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
                yield from read(path, cfg.read_batch_rows, shown)

        chunks = _files()
    remaining = cfg.max_rows
    for chunk in chunks:
        if remaining is not None:
            if remaining <= 0:
                return
            if chunk.table.num_rows > remaining:
                chunk = SourceChunk(chunk.origin, chunk.first_row, chunk.table.slice(0, remaining))
            remaining -= chunk.table.num_rows
        yield chunk
