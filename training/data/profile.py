"""A data version's profile: the statistics a later version is compared with for drift.

Tables: per feature, bin edges at the quantiles of the data and the rows between them;
the label's class counts (classification) or its quantile histogram (regression).
Text: how often each UTF-8 byte occurs. The edges are stored with the counts, so a
later version is counted on the very same bins (training.data.drift compares them).

Both stream the raw snapshot in batches, memory flat in its size: a table is read twice
(a hashed sample of rows gives the quantiles, then every row is counted on them; once
when the sample holds every row), text once. A reference profile given to
`profile_raw` is counted on in the first pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training.data.hashing import unit_interval
from training.data.sources import FEATURES, LABEL, ROW_KEY, RawLayout
from training.errors import DataError

# training.data.text is imported where text is read: it loads the tokenizers library,
# which the flow's process (reading profiles, deciding on drift) has no use for.

PROFILE_VERSION = 1
QUANTILE_BINS = 10  # deciles: equal-mass bins, the usual choice for PSI
# The quantile sample holds this many values (rows x features, at least MIN_SAMPLE_ROWS
# rows; its buffer twice that, 32 MiB of float32): 16,384 rows of 256 features. Deciles
# of that many rows are within a fraction of a percent of the data's; the counts on them
# are exact either way.
SAMPLE_VALUES = 1 << 22
MIN_SAMPLE_ROWS = 2048
# Rows per batch while counting: about 16 MiB of float32 values whatever the width.
BATCH_VALUES = 1 << 22
# Values compared at once while counting: 1 MiB of float32, which stays in a core's cache.
CACHE_VALUES = 1 << 18
_SAMPLE_SALT = 0xD71F7


@dataclass(frozen=True)
class Shape:
    """What a profile describes, to tell whether two can be compared at all."""

    kind: str  # table | image | tokens
    feature_shape: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    classes: bool = False  # the label holds classes (else values; text has none)

    @classmethod
    def of_profile(cls, profile: dict[str, Any]) -> Shape:
        if profile["kind"] == "tokens":
            return cls("tokens")
        return cls(
            profile["kind"],
            tuple(profile["feature_shape"]),
            tuple(profile["features"]["names"]),
            "classes" in profile["label"],
        )

    @classmethod
    def of_raw(cls, raw_dir: Path) -> Shape:
        from training.data.text import is_text_snapshot

        if is_text_snapshot(raw_dir):
            return cls("tokens")
        layout = RawLayout.of(pq.read_schema(raw_table_files(raw_dir)[0]))
        kind = "table" if len(layout.feature_shape) == 1 else "image"
        names = tuple(feature_names(layout))
        return cls(kind, layout.feature_shape, names, layout.label_type == "int64")


def feature_names(layout: RawLayout) -> list[str]:
    """The table's feature names: the source's columns, else x0, x1, ... (flat index)."""
    if layout.feature_names:
        return list(layout.feature_names)
    return [f"x{i}" for i in range(layout.width)]


def sample_rows_for(width: int) -> int:
    """How many rows the quantile sample keeps for tables of `width` features."""
    return max(MIN_SAMPLE_ROWS, SAMPLE_VALUES // max(width, 1))


class HashSample:
    """The `size` rows whose keys hash lowest: a uniform sample that is the same however
    the rows are ordered or batched. Candidates are appended to a buffer of twice that
    size, which is cut back to the lowest `size` when full, so each row is copied about
    once and memory stays 2 x `size` rows."""

    def __init__(self, size: int, width: int) -> None:
        self.size = size
        self.hashes = np.empty(2 * size)
        self.rows = np.empty((2 * size, width), dtype=np.float32)
        self.filled = 0
        self.seen = 0
        self.threshold = np.inf  # a row hashing at or above this cannot enter any more

    def add(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self.seen += len(keys)
        hashes = unit_interval(keys, _SAMPLE_SALT)
        if self.threshold < np.inf:
            below = hashes < self.threshold
            hashes, rows = hashes[below], rows[below]
        while len(hashes):
            take = min(len(hashes), len(self.hashes) - self.filled)
            self.hashes[self.filled : self.filled + take] = hashes[:take]
            self.rows[self.filled : self.filled + take] = rows[:take]
            self.filled += take
            hashes, rows = hashes[take:], rows[take:]
            if self.filled == len(self.hashes):
                self._cut()

    def _cut(self) -> None:
        """Keep the `size` lowest hashes, at the front of the buffer."""
        if self.filled <= self.size:
            return
        keep = np.argpartition(self.hashes[: self.filled], self.size - 1)[: self.size]
        self.hashes[: self.size] = self.hashes[keep]
        self.rows[: self.size] = self.rows[keep]
        self.filled = self.size
        self.threshold = float(self.hashes[: self.size].max())

    @property
    def complete(self) -> bool:
        """Whether the sample is every row added (none was left out)."""
        return self.filled == self.seen

    def values(self) -> np.ndarray:
        self._cut()
        if not self.filled:
            raise DataError("no rows to profile")
        return self.rows[: self.filled]


def quantile_edges(sample: np.ndarray, bins: int = QUANTILE_BINS) -> list[np.ndarray]:
    """Per column of `sample` (rows, columns): the sorted, distinct inner edges of its
    quantile bins (the inverted CDF: actual values), framed by the sample's minimum and
    the next float above its maximum.

    Bin i holds [edge i-1, edge i); the two open ends catch what lies outside the
    sample's range, so a value a new version moves beyond the reference's range lands
    in a bin the reference holds (nearly) nothing in, and a constant column still has a
    bin on each side of its value. float32, the features' own type.
    """
    columns = np.ascontiguousarray(np.asarray(sample, dtype=np.float32).T)
    n = columns.shape[1]
    # The inverted CDF's q-quantile is the ceil(n q)-th smallest value (1-based).
    ranks = [0, *(max(math.ceil(n * i / bins) - 1, 0) for i in range(1, bins)), n - 1]
    picked = np.partition(columns, sorted(set(ranks)), axis=1)[:, ranks]
    picked[:, -1] = np.nextafter(picked[:, -1], np.float32(np.inf))
    return [np.unique(row) for row in picked]


class BinCounter:
    """Counts rows per bin, per column, on fixed edges (ragged: one list per column)."""

    def __init__(self, edges: list[np.ndarray]) -> None:
        self.edges = [np.asarray(e, dtype=np.float32) for e in edges]
        most = max((len(e) for e in self.edges), default=0)
        # Padded with +inf, which no finite value reaches: a padded edge counts nothing.
        self._padded = np.full((most, len(self.edges)), np.inf, dtype=np.float32)
        for column, edge in enumerate(self.edges):
            self._padded[: len(edge), column] = edge
        # at_least[j, c]: rows whose value in column c is >= edge j of that column.
        self._at_least = np.zeros((most, len(self.edges)), dtype=np.int64)
        self.rows = 0

    def add(self, values: np.ndarray) -> None:
        """Rows of `values` (rows, columns) join the counts."""
        if not len(values):
            return
        # One vectorized comparison per edge over every column at once (a few passes over
        # the rows, not one per column), a block of rows at a time: the block stays in
        # the CPU cache across the edges, where the whole batch would be read from
        # memory once per edge (2.4 times slower, measured).
        step = max(1, CACHE_VALUES // values.shape[1])
        above = np.empty((min(step, len(values)), values.shape[1]), dtype=bool)
        for start in range(0, len(values), step):
            block = values[start : start + step]
            marks = above[: len(block)]
            for j, edge in enumerate(self._padded):
                np.greater_equal(block, edge, out=marks)
                self._at_least[j] += marks.sum(axis=0, dtype=np.int32)
        self.rows += len(values)

    def counts(self) -> list[list[int]]:
        """Rows per bin: len(edges) + 1 bins per column, from (-inf, edge 0) up."""
        result = []
        for column, edge in enumerate(self.edges):
            at_least = self._at_least[: len(edge), column]
            cumulative = np.concatenate([[self.rows], at_least, [0]])
            result.append((cumulative[:-1] - cumulative[1:]).tolist())
        return result


def histogram(edges: list[np.ndarray], counts: list[list[int]]) -> dict[str, Any]:
    """A JSON histogram: float32 edges as Python floats (exact), counts per bin."""
    return {"edges": [e.astype(float).tolist() for e in edges], "counts": counts}


class ClassCounter:
    """Rows per class id, for any ids (a new version may bring a class never seen)."""

    def __init__(self) -> None:
        self._counts = np.zeros(0, dtype=np.int64)

    def add(self, labels: np.ndarray) -> None:
        if not len(labels):
            return
        if labels.min() < 0:
            raise DataError(f"negative class id {int(labels.min())} in the raw table")
        found = np.bincount(labels.astype(np.int64))
        if len(found) > len(self._counts):
            self._counts = np.concatenate(
                [self._counts, np.zeros(len(found) - len(self._counts), np.int64)]
            )
        self._counts[: len(found)] += found

    def counts(self) -> dict[str, int]:
        return {str(c): int(n) for c, n in enumerate(self._counts) if n}


@dataclass(frozen=True)
class TableBatch:
    keys: np.ndarray
    features: np.ndarray  # (rows, width) float32
    labels: np.ndarray


def raw_table_files(raw_dir: Path) -> list[Path]:
    files = sorted(raw_dir.glob("part-*.parquet"))
    if not files:
        raise DataError(f"no table parts in {raw_dir}; run the ingest stage first")
    return files


def read_table(files: list[Path], width: int, columns: list[str]) -> Iterator[TableBatch]:
    """The raw table's `columns` in batches of about BATCH_VALUES feature values (the
    others come back empty)."""
    batch_rows = max(1024, BATCH_VALUES // max(width, 1))
    for path in files:
        parquet = pq.ParquetFile(path)
        # One row group at a time: asked for a whole file, Arrow decodes every row group
        # before the first batch (the file's size in memory, measured); one row group
        # (ingest's read chunk) bounds it.
        for group in range(parquet.num_row_groups):
            for batch in parquet.iter_batches(batch_rows, row_groups=[group], columns=columns):
                yield _table_batch(batch, width)


def _table_batch(batch: pa.RecordBatch, width: int) -> TableBatch:
    names = batch.schema.names
    empty = np.empty(0)
    features = empty.reshape(0, width)
    if FEATURES in names:
        flat = batch.column(FEATURES).flatten()  # the values of these rows (offset-aware)
        features = flat.to_numpy(zero_copy_only=False).reshape(-1, width)
    return TableBatch(
        batch.column(ROW_KEY).to_numpy() if ROW_KEY in names else empty,
        features,
        batch.column(LABEL).to_numpy(zero_copy_only=False) if LABEL in names else empty,
    )


def _labels_as_column(labels: np.ndarray) -> np.ndarray:
    return np.asarray(labels, dtype=np.float32).reshape(-1, 1)


class _Histograms:
    """Quantile histograms of a matrix's columns: a hashed sample of rows gives the
    edges, then every row is counted on them (straight from the sample when it holds
    every row, so a small table is read once)."""

    def __init__(self, width: int) -> None:
        self.sample = HashSample(sample_rows_for(width), width)
        self.edges: list[np.ndarray] = []
        self.counter = BinCounter([])

    def fix_edges(self) -> bool:
        """Set the edges from the sample; whether the rows must still be counted."""
        values = self.sample.values()
        self.edges = quantile_edges(values)
        self.counter = BinCounter(self.edges)
        if self.sample.complete:
            self.counter.add(values)
            return False
        return True

    def to_json(self) -> dict[str, Any]:
        return histogram(self.edges, self.counter.counts())


def _reference_counters(
    reference: dict[str, Any] | None,
) -> tuple[BinCounter | None, BinCounter | None]:
    """Counters on a reference profile's bins (features, regression label)."""
    if reference is None:
        return None, None
    features = BinCounter([np.asarray(e) for e in reference["features"]["edges"]])
    label = reference.get("label") or {}
    values = BinCounter([np.asarray(label["edges"])]) if "edges" in label else None
    return features, values


def profile_table(
    raw_dir: Path, reference: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(profile of the table in `raw_dir`, its counts on `reference`'s bins or None).

    `reference` must be a table profile of the same features (training.data.drift's
    `not_comparable` says whether it is)."""
    files = raw_table_files(raw_dir)
    layout = RawLayout.of(pq.read_schema(files[0]))
    width = layout.width
    classes = ClassCounter() if layout.label_type == "int64" else None
    features = _Histograms(width)
    values = None if classes is not None else _Histograms(1)  # a regression label
    ref_features, ref_values = _reference_counters(reference)
    ref_classes = ClassCounter() if reference is not None and classes is not None else None
    rows = 0
    # Pass 1: the quantile samples, the class counts, and the counts on the reference.
    for batch in read_table(files, width, [ROW_KEY, FEATURES, LABEL]):
        rows += len(batch.keys)
        features.sample.add(batch.keys, batch.features)
        label = _labels_as_column(batch.labels)
        if values is not None:
            values.sample.add(batch.keys, label)
        for counter, data in (
            (classes, batch.labels),
            (ref_features, batch.features),
            (ref_classes, batch.labels),
            (ref_values, label),
        ):
            if counter is not None:
                counter.add(data)
    # Pass 2, unless the samples held every row: every row on this version's own bins.
    count_features = features.fix_edges()
    count_label = values is not None and values.fix_edges()
    if count_features or count_label:
        columns = [FEATURES] * count_features + [LABEL] * count_label
        for batch in read_table(files, width, columns):
            if count_features:
                features.counter.add(batch.features)
            if values is not None and count_label:
                values.counter.add(_labels_as_column(batch.labels))
    label_profile: dict[str, Any] = {"classes": classes.counts()} if classes is not None else {}
    if values is not None:  # a regression label: one column, stored flat
        one = values.to_json()
        label_profile = {"edges": one["edges"][0], "counts": one["counts"][0]}
    profile = {
        "version": PROFILE_VERSION,
        "kind": "table" if len(layout.feature_shape) == 1 else "image",
        "rows": rows,
        "feature_shape": list(layout.feature_shape),
        "features": {"names": feature_names(layout), **features.to_json()},
        "label": label_profile,
    }
    counted = None
    if ref_features is not None:
        counted = {"rows": rows, "features": {"counts": ref_features.counts()}}
        if ref_classes is not None:
            counted["label"] = {"classes": ref_classes.counts()}
        elif ref_values is not None:
            counted["label"] = {"counts": ref_values.counts()[0]}
    return profile, counted


def utf8_bytes(column: pa.Array) -> np.ndarray:
    """The UTF-8 bytes of a string column's values, concatenated (a view, no copy)."""
    large = pa.types.is_large_string(column.type)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int64 if large else np.int32)
    start = int(offsets[column.offset])
    stop = int(offsets[column.offset + len(column)])
    data = column.buffers()[2]
    return np.frombuffer(data, dtype=np.uint8)[start:stop] if data is not None else np.empty(0)


def profile_text(raw_dir: Path) -> dict[str, Any]:
    """Byte counts of every document: the unigrams of the bytes tokenizer, and a basis
    that compares across versions whatever tokenizer each trained (BPE is retrained with
    the data, so its ids mean other strings in another version)."""
    from training.data.text import DOCUMENTS_FILE, TEXT

    counts = np.zeros(256, dtype=np.int64)
    documents = 0
    parquet = pq.ParquetFile(raw_dir / DOCUMENTS_FILE)
    for group in range(parquet.num_row_groups):  # one at a time, as read_table does
        for batch in parquet.iter_batches(4096, row_groups=[group], columns=[TEXT]):
            counts += np.bincount(utf8_bytes(batch.column(0)), minlength=256)
            documents += batch.num_rows
    return {
        "version": PROFILE_VERSION,
        "kind": "tokens",
        "basis": "bytes",
        "documents": documents,
        "bytes": int(counts.sum()),
        "counts": counts.tolist(),
    }


def profile_raw(
    raw_dir: Path, reference: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(profile of the raw snapshot, its counts on `reference`'s bins or None). For text
    the profile is its own count: byte bins are the same in every version."""
    from training.data.text import is_text_snapshot

    if is_text_snapshot(raw_dir):
        profile = profile_text(raw_dir)
        return profile, (profile if reference is not None else None)
    return profile_table(raw_dir, reference)
