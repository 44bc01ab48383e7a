"""Sources yield the input table in chunks, never whole, so any size streams through.

A chunk is an Arrow table as the source has it, with where it came from (a file, or a
built-in name) and the index of its first row there, so errors can point at real rows.
Built-in sources yield the normalized columns directly; user tables are normalized by
training.data.validate.
"""

from __future__ import annotations

import codecs
import csv
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from training.data import clicks
from training.data.options import DataConfig, LabelKind
from training.errors import DataError

ROW_KEY = "row_id"
FEATURES = "features"
LABEL = "label"
META_SOURCE = b"gradline.source"
META_SHAPE = b"gradline.feature_shape"
META_CLASSES = b"gradline.num_classes"
META_LABEL_TYPE = b"gradline.label_type"
META_FEATURE_NAMES = b"gradline.feature_names"
META_CATEGORICAL = b"gradline.categorical_columns"
# The label column's type by what it holds (the task says): classes are whole numbers,
# values (regression targets) are floats.
LABEL_TYPES: dict[LabelKind, str] = {"classes": "int64", "values": "float32"}

# Built-in sources generate in fixed chunks, so their rows never depend on batch settings.
_GENERATE_ROWS = 65536


@dataclass(frozen=True)
class SourceChunk:
    origin: str
    first_row: int
    table: pa.Table


@dataclass(frozen=True)
class RawLayout:
    """What a normalized table holds. Recorded in the raw snapshot's Parquet schema
    metadata, so the shard stage (and the next ingest, to report a schema change) reads
    it back without being told."""

    source: str | None  # None: written before gradline recorded it
    feature_shape: tuple[int, ...]
    label_type: str  # "int64" (classes) or "float32" (regression targets)
    num_classes: int | None  # classification only
    feature_names: tuple[str, ...] | None = None  # tables built from named numeric columns
    # The leading features that hold id codes (training.data.spec), in order; () if none.
    categorical_columns: tuple[str, ...] = ()

    def schema(self) -> pa.Schema:
        """The normalized table every stage after ingest reads."""
        names = list(self.feature_names) if self.feature_names is not None else None
        return pa.schema(
            [
                pa.field(ROW_KEY, pa.uint64(), nullable=False),
                pa.field(FEATURES, pa.list_(pa.float32(), self.width), nullable=False),
                pa.field(LABEL, pa.type_for_alias(self.label_type), nullable=False),
            ],
            metadata={
                META_SOURCE: (self.source or "").encode(),
                META_SHAPE: ",".join(map(str, self.feature_shape)).encode(),
                META_CLASSES: json.dumps(self.num_classes).encode(),
                META_LABEL_TYPE: self.label_type.encode(),
                META_FEATURE_NAMES: json.dumps(names).encode(),
                META_CATEGORICAL: json.dumps(list(self.categorical_columns)).encode(),
            },
        )

    @property
    def width(self) -> int:
        return math.prod(self.feature_shape)

    @classmethod
    def of(cls, schema: pa.Schema) -> RawLayout:
        """The layout recorded in a normalized table's schema (older snapshots lack the
        source, label type and names: integer labels and no names then)."""
        meta = schema.metadata or {}
        if META_SHAPE not in meta:
            raise DataError(
                f"not a gradline raw table (no {META_SHAPE.decode()} in its schema); "
                "run the ingest stage"
            )
        names = json.loads(meta.get(META_FEATURE_NAMES, b"null"))
        return cls(
            source=meta.get(META_SOURCE, b"").decode() or None,
            feature_shape=tuple(int(d) for d in meta[META_SHAPE].decode().split(",")),
            label_type=meta.get(META_LABEL_TYPE, b"int64").decode(),
            num_classes=json.loads(meta[META_CLASSES]),
            feature_names=tuple(names) if names is not None else None,
            categorical_columns=tuple(json.loads(meta.get(META_CATEGORICAL, b"[]"))),
        )


def to_table(
    keys: np.ndarray, features: np.ndarray, labels: np.ndarray, layout: RawLayout
) -> pa.Table:
    """A normalized table from keys, a (rows, *shape) float array and labels."""
    flat = pa.array(np.ascontiguousarray(features, dtype=np.float32).reshape(-1))
    columns = [
        pa.array(np.asarray(keys, dtype=np.uint64)),
        pa.FixedSizeListArray.from_arrays(flat, layout.width),
        pa.array(np.asarray(labels, dtype=layout.label_type)),
    ]
    return pa.Table.from_arrays(columns, schema=layout.schema())


def digits_chunks(cfg: DataConfig, labels: LabelKind) -> Iterator[SourceChunk]:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes): real data, no download.

    Pixels 0..16 are scaled to 0..1 here so every consumer sees the same values.
    """
    from sklearn.datasets import load_digits  # deferred: scikit-learn takes ~2 s to import

    bunch = load_digits()
    features = bunch.data.astype(np.float32).reshape(-1, 8, 8) / 16.0
    keys = np.arange(len(bunch.target), dtype=np.uint64)
    layout = RawLayout("digits", (8, 8), "int64", 10)
    yield SourceChunk("digits", 0, to_table(keys, features, bunch.target, layout))


def diabetes_chunks(cfg: DataConfig, labels: LabelKind) -> Iterator[SourceChunk]:
    """scikit-learn's bundled diabetes table (442 patients, 10 measurements, a disease
    progression score to predict): real regression data, no download.

    The values are the raw measurements (scaled=False), as a user's table would hold
    them: standardizing is the model's job, with statistics of the train split.
    """
    from sklearn.datasets import load_diabetes  # deferred, as above

    bunch = load_diabetes(scaled=False)
    keys = np.arange(len(bunch.target), dtype=np.uint64)
    names = tuple(bunch.feature_names)
    layout = RawLayout("diabetes", (len(names),), "float32", None, names)
    yield SourceChunk("diabetes", 0, to_table(keys, bunch.data, bunch.target, layout))


def synthetic_chunks(cfg: DataConfig, labels: LabelKind) -> Iterator[SourceChunk]:
    """Gaussian class clusters: deterministic by seed, learnable, generated chunk by chunk.

    For regression the same features get a target that is a fixed linear function of
    them plus noise, so a model has something to learn there too.
    """
    shape = tuple(cfg.synthetic_shape)
    width = math.prod(shape)
    centers = np.random.default_rng([cfg.seed, 0xC0FFEE]).standard_normal(
        (cfg.synthetic_classes, width), dtype=np.float32
    )
    weights = np.random.default_rng([cfg.seed, 0xBEEF]).standard_normal(width) / math.sqrt(width)
    regression = labels == "values"
    classes = None if regression else cfg.synthetic_classes
    layout = RawLayout("synthetic", shape, LABEL_TYPES[labels], classes)
    for first in range(0, cfg.synthetic_rows, _GENERATE_ROWS):
        n = min(_GENERATE_ROWS, cfg.synthetic_rows - first)
        rng = np.random.default_rng([cfg.seed, first // _GENERATE_ROWS])
        labels = rng.integers(0, cfg.synthetic_classes, n)
        noise = rng.standard_normal((n, width), dtype=np.float32) * np.float32(cfg.synthetic_noise)
        features = centers[labels] + noise
        if regression:
            labels = features @ weights + 0.1 * rng.standard_normal(n)
        keys = np.arange(first, first + n, dtype=np.uint64)
        yield SourceChunk(
            "synthetic", first, to_table(keys, features.reshape(n, *shape), labels, layout)
        )


def clicks_chunks(cfg: DataConfig, labels: LabelKind) -> Iterator[SourceChunk]:
    """Generated click logs with power-law users and items and a planted click model
    (training.data.clicks): id columns user_id, item_id, category, then dense ones."""
    layout = RawLayout("clicks", (len(clicks.COLUMNS),), "int64", 2, clicks.COLUMNS,
                       clicks.ID_COLUMNS)  # fmt: skip
    for first, features, clicked in clicks.click_batches(cfg):
        keys = np.arange(first, first + len(clicked), dtype=np.uint64)
        yield SourceChunk("clicks", first, to_table(keys, features, clicked, layout))


BUILTIN_SOURCES: dict[str, Callable[[DataConfig, LabelKind], Iterator[SourceChunk]]] = {
    "digits": digits_chunks,
    "diabetes": diabetes_chunks,
    "synthetic": synthetic_chunks,
    "clicks": clicks_chunks,
}


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


def _parquet_chunks(path: Path, shown: str, cfg: DataConfig) -> Iterator[SourceChunk]:
    try:
        reader = pq.ParquetFile(path)
        first = 0
        for batch in reader.iter_batches(batch_size=cfg.read_batch_rows):
            yield SourceChunk(shown, first, pa.Table.from_batches([batch]))
            first += batch.num_rows
    # A corrupt footer can also name a column in bytes that are not UTF-8.
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        raise DataError(
            f"{shown}: not a readable Parquet file, truncated or corrupt ({exc}). "
            "Export it again, or remove it from data.path"
        ) from exc


# ---- CSV ------------------------------------------------------------------------------
# Arrow reads a CSV in blocks and fixes each column's type from the first block. Faults
# surface in several forms (a UnicodeDecodeError for the header, a binary column, an
# ArrowInvalid for a later block); all of them end in one DataError that names the file
# and the line, found again by reading the file with Python's csv module.

_CSV_BLOCK_BYTES = 1 << 22
_FIELD_COUNT = re.compile(r"Expected (\d+) columns, got (\d+)")
# Arrow names the row ("Row #202: ") only when its reader knows it, which depends on how
# its threads split the file: the message is matched with or without it.
_CONVERSION = re.compile(
    r"In CSV column #(\d+): (?:Row #\d+: )?CSV conversion error to (\w+): invalid value '(.*)'"
)


def _first_invalid_utf8(path: Path) -> tuple[int, int] | None:
    """(line, byte offset) of the first byte sequence that is not UTF-8, if any."""

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
    pending = decoder.getstate()[0]
    if pending:  # a file cut inside a multi-byte character
        return line, offset - len(pending)
    return None


def _not_utf8(path: Path, shown: str) -> DataError | None:
    bad = _first_invalid_utf8(path)
    if bad is None:
        return None
    where = f"line {bad[0]}" + (" (the header)" if bad[0] == 1 else "")
    return DataError(
        f"{shown}: not UTF-8 (first bad byte at {where}, byte offset {bad[1]}). "
        f"Re-encode it, e.g. `iconv -f latin1 -t utf-8 {path.name}`"
    )


def _csv_line(path: Path, wanted: Callable[[list[str]], bool]) -> int | None:
    """The line on which the first data row for which `wanted` holds ends, if any."""
    try:
        with path.open(newline="", encoding="utf-8", errors="replace") as handle:
            rows = csv.reader(handle)
            next(rows, None)  # the header
            for row in rows:
                if row and wanted(row):
                    return rows.line_num
    except csv.Error:
        return None
    return None


def _csv_error(path: Path, shown: str, exc: Exception, names: list[str]) -> DataError:
    """One clear message for a CSV that Arrow could not read."""
    if error := _not_utf8(path, shown):
        return error
    text = str(exc)
    if "Empty CSV file" in text:
        return DataError(
            f"{shown}: empty, or a header cut short with no line after it; a CSV needs a "
            "header line and rows below it"
        )
    if match := _FIELD_COUNT.search(text):
        expected, got = int(match[1]), int(match[2])
        line = _csv_line(path, lambda row: len(row) != expected)
        where = f"line {line}" if line else "a row"
        return DataError(
            f"{shown}: {where} has {got} fields, the header has {expected}. The file may "
            "be truncated, or a value holds the delimiter without quotes"
        )
    if (match := _CONVERSION.search(text)) and int(match[1]) < len(names):
        index, target, value = int(match[1]), match[2], match[3]
        line = _csv_line(path, lambda row: len(row) > index and row[index] == value)
        where = f"line {line}, " if line else ""
        kind = "a number" if target in ("double", "int64", "null") else target
        return DataError(
            f"{shown}: {where}column {names[index]!r}: {value!r} is not {kind}, like the "
            "values above it. Fix the value, or leave it empty to mark it missing"
        )
    return DataError(
        f"{shown}: cannot be parsed as CSV ({text}). Check the header, the delimiter "
        "and that every value in a numeric column is a number"
    )


def _csv_chunks(path: Path, shown: str, cfg: DataConfig) -> Iterator[SourceChunk]:

    def open_csv(types: dict[str, pa.DataType] | None = None) -> pcsv.CSVStreamingReader:
        return pcsv.open_csv(
            path,
            read_options=pcsv.ReadOptions(block_size=_CSV_BLOCK_BYTES),
            convert_options=pcsv.ConvertOptions(column_types=types or {}),
        )

    names: list[str] = []
    try:
        reader = open_csv()
        names = reader.schema.names
        # Arrow reads a column holding invalid UTF-8 as binary instead of failing.
        if any(pa.types.is_binary(f.type) for f in reader.schema) and (
            error := _not_utf8(path, shown)
        ):
            raise error
        # Whole numbers (or nothing) in the first block need not mean integers further
        # down: a decimal there, or labels that pandas wrote as 1.0 because some were
        # missing, would fail the whole file. Read numbers as float64 (exact for integers
        # up to 2**53); validation takes integral labels as classes. A key keeps its type.
        widen = {
            f.name: pa.float64()
            for f in reader.schema
            if (pa.types.is_integer(f.type) or pa.types.is_null(f.type))
            and f.name != cfg.key_column
        }
        # Ids are text as written ("007" stays "007"; training.data.categorical).
        ids = [name for name in cfg.categorical_columns or () if name in names]
        widen.update({name: pa.string() for name in ids})
        if widen:
            reader.close()
            reader = open_csv(widen)
        first = 0
        for batch in reader:
            yield SourceChunk(shown, first, pa.Table.from_batches([batch]))
            first += batch.num_rows
    except (UnicodeDecodeError, pa.ArrowException, OSError) as exc:
        raise _csv_error(path, shown, exc, names) from exc


def open_chunks(
    cfg: DataConfig, root: Path, labels: LabelKind = "classes"
) -> Iterator[SourceChunk]:
    """All chunks of the configured source, in a stable order, at most data.max_rows rows;
    `labels`: what the task needs the label column to hold."""
    if cfg.source in BUILTIN_SOURCES:
        chunks = BUILTIN_SOURCES[cfg.source](cfg, labels)
    else:
        read = _parquet_chunks if cfg.source == "parquet" else _csv_chunks
        files = table_files(cfg, root)

        def _files() -> Iterator[SourceChunk]:
            for path in files:
                shown = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
                yield from read(path, shown, cfg)

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
