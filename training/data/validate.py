"""Validation: every input row is accepted (normalized) or rejected with a reason.

Problems with a whole file (missing or wrongly typed columns, features that changed since
the previous data version) always fail with a message naming the file and the columns.
Problems with rows (nulls, NaN/Inf, labels that are not classes, ragged tensors,
duplicates) fail too, or, with `data.on_invalid: quarantine`, send the rows aside with
their reason. Either way the counts add up: rows in = rows accepted + rows quarantined.

Labels follow the task: classes become int64 in 0..num_classes-1, regression targets
float32. A float column of whole numbers holds classes too: pandas writes integer labels
as floats as soon as one of them is missing. New rows to score have no labels
(`labels=None`): the same checks run on their features and key (`Validator.screen`).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.data.categorical import id_codes
from training.data.hashing import content_keys, keys_from_column
from training.data.options import USER_TABLE_SOURCES, DataConfig, LabelKind
from training.data.sources import (
    BUILTIN_SOURCES,
    FEATURES,
    LABEL,
    LABEL_TYPES,
    ROW_KEY,
    RawLayout,
    SourceChunk,
)
from training.data.sources import to_table as normalized_table
from training.errors import ConfigError, DataError

REASONS = (
    "null value",
    "ragged tensor shape",
    "NaN or Inf",
    "label not an integer",
    "label out of range",
    "duplicate",
)
QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("origin", pa.string()),
        pa.field("source_row", pa.int64()),
        pa.field("reason", pa.string()),
        pa.field("row", pa.string()),  # the row as the source had it, as JSON
    ]
)
HINTS = {
    "null value": "fill or drop the missing values",
    "ragged tensor shape": "every value of the tensor column needs data.feature_shape elements",
    "NaN or Inf": "replace non-finite values",
    "label not an integer": "classes are whole numbers 0..data.num_classes-1; fix the labels, "
    "or set task.type: regression to predict a number",
    "label out of range": "labels must lie in 0..data.num_classes-1",
    "duplicate": "remove repeated rows, or set data.duplicates: keep",
}


def _is_numeric(dtype: pa.DataType) -> bool:
    """A number column; an all-null column (an empty CSV column) counts, its rows are
    then rejected one by one as missing."""
    return pa.types.is_integer(dtype) or pa.types.is_floating(dtype) or pa.types.is_null(dtype)


def _quoted(names) -> str:
    return ", ".join(map(repr, names))


@dataclass
class ValidationReport:
    rows_in: int = 0
    rows_accepted: int = 0
    rows_quarantined: int = 0
    reasons: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    # Columns of the input that are neither features, label nor key (with features
    # listed in data.feature_columns or data.tensor_column), in the order first seen.
    ignored_columns: list[str] = field(default_factory=list)

    def add_rejected(self, reason: str, where: str) -> None:
        self.reasons[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < 3:
            shown.append(where)

    def add_ignored(self, columns: list[str]) -> None:
        self.ignored_columns += [c for c in columns if c not in self.ignored_columns]

    def describe(self) -> str:
        lines = [f"{self.rows_in} rows read, {sum(self.reasons.values())} invalid:"]
        for reason in REASONS:
            if count := self.reasons.get(reason):
                examples = "; ".join(self.examples[reason])
                lines.append(f"  {reason}: {count} rows, e.g. {examples} ({HINTS[reason]})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "rows_in": self.rows_in,
            "rows_accepted": self.rows_accepted,
            "rows_quarantined": self.rows_quarantined,
            "invalid_by_reason": dict(sorted(self.reasons.items())),
            "ignored_columns": list(self.ignored_columns),
        }


@dataclass(frozen=True)
class ColumnPlan:
    """How to read features, label and key out of one input schema."""

    label: str | None  # None: unlabelled rows (new data to score)
    key: str | None
    feature_columns: tuple[str, ...] | None  # several numeric columns, or
    tensor: str | None  # one list column


def schema_change(previous: RawLayout, current: RawLayout) -> str | None:
    """What changed between two versions of a table whose features are inferred, and how
    to accept it; None when nothing did."""
    old, new = previous.feature_names or (), current.feature_names or ()
    added = [c for c in new if c not in old]
    removed = [c for c in old if c not in new]
    changes = []
    if added:
        changes.append(f"column(s) added: {_quoted(added)}")
    if removed:
        changes.append(f"column(s) removed: {_quoted(removed)}")
    if not added and not removed and old != new:
        changes.append(f"columns reordered: {_quoted(old)} -> {_quoted(new)}")
    if previous.feature_shape != current.feature_shape and not changes:
        changes.append(
            f"feature shape {list(previous.feature_shape)} -> {list(current.feature_shape)}"
        )
    if previous.label_type != current.label_type:
        changes.append(
            f"label type {previous.label_type} -> {current.label_type} (task.type changed)"
        )
    if not changes:
        return None
    accept = f"set data.feature_columns to {json.dumps(list(new))} to train on this version"
    if old and not removed and added:
        accept += f", or to {json.dumps(list(old))} to keep the previous features"
    return (
        f"the features changed since the previous data version: {'; '.join(changes)}. "
        "A model trained on the previous version cannot take these rows. To accept the "
        f"change, {accept}: with the features listed, other columns are ignored and ingest "
        "no longer compares the table with the previous version"
    )


@dataclass(frozen=True)
class Screened:
    """One chunk of unlabelled rows, checked: the good rows' features and where they are
    in the chunk, and the bad rows with their reasons."""

    features: np.ndarray  # (good rows, features) float32
    good: np.ndarray  # bool per row of the chunk
    quarantined: pa.Table  # QUARANTINE_SCHEMA


class Validator:
    def __init__(
        self,
        cfg: DataConfig,
        labels: LabelKind | None = "classes",
        previous: RawLayout | None = None,
    ) -> None:
        """`labels`: what the label column holds; None for new rows to score, which have
        no label column (any column of that name is ignored)."""
        self.cfg = cfg
        self.builtin = cfg.source in BUILTIN_SOURCES
        self.labelled = labels is not None
        self.label_type = LABEL_TYPES[labels] if labels else None
        self.previous = previous  # the layout of the snapshot this ingest replaces
        self.shape: tuple[int, ...] | None = tuple(cfg.feature_shape) if cfg.feature_shape else None
        self.num_classes: int | None = cfg.num_classes if labels == "classes" else None
        if labels == "classes" and not self.builtin and self.num_classes is None:
            raise ConfigError(
                f"data.num_classes is required to classify a {cfg.source} table: labels are "
                "checked against 0..num_classes-1 (or set task.type: regression)"
            )
        self.feature_names: tuple[str, ...] | None = None
        # A user's id columns: hashed to codes and placed first among the features.
        self.categorical_columns: tuple[str, ...] = (
            () if self.builtin else tuple(cfg.categorical_columns or ())
        )
        self.report = ValidationReport()
        self._seen: set[int] = set()
        self._first_plan: tuple[str, ColumnPlan] | None = None

    @property
    def layout(self) -> RawLayout:
        """The normalized table's layout (once the first chunk has fixed the shape)."""
        if self.shape is None:
            raise RuntimeError("the layout is known only after the first chunk with a row")
        return RawLayout(
            self.cfg.source,
            self.shape,
            self.label_type,
            self.num_classes,
            self.feature_names,
            self.categorical_columns,
        )

    # ---- file level -------------------------------------------------------------------
    def _plan_builtin(self, schema: pa.Schema) -> ColumnPlan:
        layout = RawLayout.of(schema)
        if layout.label_type != self.label_type:
            held = next(kind for kind, dtype in LABEL_TYPES.items() if dtype == layout.label_type)
            wanted = next(kind for kind, dtype in LABEL_TYPES.items() if dtype == self.label_type)
            raise ConfigError(
                f"data.source {self.cfg.source} is a data set labelled with {held} and task.type "
                f"asks for {wanted}: set the task.type that learns {held}"
            )
        self.shape, self.num_classes = layout.feature_shape, layout.num_classes
        self.feature_names = layout.feature_names
        self.categorical_columns = layout.categorical_columns
        return ColumnPlan(LABEL, ROW_KEY, None, FEATURES)

    def plan(self, origin: str, schema: pa.Schema) -> ColumnPlan:
        if self.builtin:
            return self._plan_builtin(schema)
        cfg = self.cfg
        names = schema.names
        label = cfg.label_column if self.labelled else None
        problems = self._named_column_problems(origin, schema, label)
        used = {label, cfg.key_column}
        features: tuple[str, ...] | None = None
        if cfg.tensor_column:
            used.add(cfg.tensor_column)
            problems += self._tensor_problems(schema)
        else:
            features = self._feature_columns_of(names, used)
            used.update(features)
            problems += self._feature_problems(schema, features)
        if problems:
            raise DataError(f"{origin}: " + "; ".join(problems))
        plan = ColumnPlan(label, cfg.key_column, features, cfg.tensor_column)
        self._same_as_first_plan(origin, plan)
        # Features named in the config (or one tensor column): the rest is not ours.
        self.report.add_ignored([c for c in names if c not in used])
        return plan

    def _named_column_problems(
        self, origin: str, schema: pa.Schema, label: str | None
    ) -> list[str]:
        """Each name once (else fail now), the columns the config names there, and a
        numeric label."""
        cfg, names = self.cfg, schema.names
        repeated = sorted({c for c in names if names.count(c) > 1})
        if repeated:
            raise DataError(
                f"{origin}: column name(s) repeated: {_quoted(repeated)}; every column "
                "needs its own name"
            )
        wanted = ([label] if label else []) + ([cfg.key_column] if cfg.key_column else [])
        if cfg.tensor_column:
            wanted.append(cfg.tensor_column)
        if cfg.feature_columns:
            wanted.extend(cfg.feature_columns)
        missing = [c for c in wanted + list(self.categorical_columns) if c not in names]
        if missing:
            return [
                f"missing column(s) {_quoted(missing)}; the file has "
                f"{', '.join(names)} (set data.label_column / data.feature_columns / "
                "data.categorical_columns / data.tensor_column / data.key_column to match)"
            ]
        if label and not _is_numeric(label_type := schema.field(label).type):
            return [
                f"label column {cfg.label_column!r} has type {label_type}; labels must be "
                + ("numbers" if self.num_classes is None else "whole numbers (classes)")
            ]
        return []

    def _tensor_problems(self, schema: pa.Schema) -> list[str]:
        column = self.cfg.tensor_column
        if column not in schema.names:
            return []  # reported as missing
        dtype = schema.field(column).type
        list_like = pa.types.is_list(dtype) or pa.types.is_large_list(dtype)
        list_like = list_like or pa.types.is_fixed_size_list(dtype)
        if list_like and _is_numeric(dtype.value_type):
            return []
        return [f"tensor column {column!r} has type {dtype}; it must be a list of numbers"]

    def _feature_columns_of(self, names: list[str], used: set[str | None]) -> tuple[str, ...]:
        """Id columns first (the model's tables take the leading features), then the
        numeric ones; an id column listed among feature_columns too counts once."""
        ids = self.categorical_columns
        dense = tuple(self.cfg.feature_columns or [c for c in names if c not in used])
        return ids + tuple(c for c in dense if c not in ids)

    def _feature_problems(self, schema: pa.Schema, features: tuple[str, ...]) -> list[str]:
        cfg, names, ids = self.cfg, schema.names, self.categorical_columns
        problems = []
        wrong = [
            f"{c} ({schema.field(c).type})"
            for c in features
            if c in names and c not in ids and not _is_numeric(schema.field(c).type)
        ]
        if wrong:
            problems.append(
                f"feature column(s) not numeric: {', '.join(wrong)}; every feature "
                "value must be a number"
                + (
                    ""
                    if cfg.feature_columns
                    else ", or list the features to use in "
                    "data.feature_columns (other columns are then ignored), or name "
                    "columns of ids in data.categorical_columns"
                )
            )
        if not features:
            problems.append("no feature columns; set data.feature_columns")
        elif cfg.feature_shape and math.prod(cfg.feature_shape) != len(features):
            problems.append(
                f"data.feature_shape {cfg.feature_shape} holds "
                f"{math.prod(cfg.feature_shape)} values, but there are {len(features)} "
                "feature columns"
            )
        return problems

    def _same_as_first_plan(self, origin: str, plan: ColumnPlan) -> None:
        """The first file's plan sets the table's features; every later file must match."""
        if self._first_plan is None:
            self._first_plan = (origin, plan)
            if plan.feature_columns is not None:
                self.feature_names = plan.feature_columns
                self.shape = self.shape or (len(plan.feature_columns),)
                self._check_schema_change(origin)
        elif self._first_plan[1] != plan:
            raise DataError(
                f"{origin}: columns differ from {self._first_plan[0]}; every file of the "
                "table needs the same columns"
            )

    def _check_schema_change(self, origin: str) -> None:
        """With features inferred ("all but label and key"), a column that appears or goes
        away between data versions would silently change what models take as input."""
        inferred = self.cfg.feature_columns is None and self.cfg.tensor_column is None
        previous = self.previous
        if not inferred or previous is None or previous.source not in USER_TABLE_SOURCES:
            return
        if change := schema_change(previous, self.layout):
            raise DataError(f"{origin}: {change}")

    # ---- row level --------------------------------------------------------------------
    def _features(self, table: pa.Table, plan: ColumnPlan, bad: np.ndarray, reason: list):
        n = table.num_rows
        if plan.feature_columns is not None:
            columns = [table.column(c) for c in plan.feature_columns]
            null = np.zeros(n, dtype=bool)
            for column in columns:
                if column.null_count:  # known without a pass over the values
                    null |= column.is_null().to_numpy(zero_copy_only=False)
            _mark(bad, reason, null, "null value")
            # An unsafe cast: integers beyond 2**24 round, as float32 must; overflow
            # becomes Inf and is rejected as such below. Nulls become NaN. Id columns
            # become their 24-bit codes (training.data.categorical).
            return np.column_stack(
                [
                    id_codes(c)
                    if name in self.categorical_columns
                    else c.cast(pa.float32(), safe=False).to_numpy(zero_copy_only=False)
                    for name, c in zip(plan.feature_columns, columns, strict=True)
                ]
            )
        column = table.column(plan.tensor).combine_chunks()
        fixed = pa.types.is_fixed_size_list(column.type)
        if fixed and self.shape and column.type.list_size == math.prod(self.shape):
            values = column.flatten()
            if column.null_count == 0 and values.null_count == 0:
                # Already the right shape and complete: view it, no per-row work.
                return (
                    values.to_numpy(zero_copy_only=False)
                    .reshape(n, -1)
                    .astype(np.float32, copy=False)
                )
        _mark(bad, reason, column.is_null().to_numpy(zero_copy_only=False), "null value")
        lengths = pc.fill_null(pc.list_value_length(column), -1).to_numpy()
        if self.shape is None:  # infer from the first non-null value
            known = lengths[lengths >= 0]
            self.shape = (int(known[0]),) if len(known) else None
        width = math.prod(self.shape) if self.shape else 0
        _mark(bad, reason, (lengths != width) & (lengths >= 0), "ragged tensor shape")
        matrix = np.full((n, max(width, 1)), np.nan, dtype=np.float32)
        good = lengths == width
        if good.any():
            values = pc.list_flatten(column.filter(pa.array(good)))
            inner_null = values.is_null().to_numpy(zero_copy_only=False).reshape(-1, width)
            matrix[good] = (
                values.cast(pa.float32(), safe=False)
                .to_numpy(zero_copy_only=False)
                .reshape(-1, width)
            )
            null_rows = np.zeros(n, dtype=bool)
            null_rows[good] = inner_null.any(axis=1)
            _mark(bad, reason, null_rows, "null value")
        return matrix

    def _labels(self, column: pa.ChunkedArray, bad: np.ndarray, reason: list) -> np.ndarray:
        column = column.combine_chunks()
        if self.num_classes is None:  # regression: any finite number
            _mark(bad, reason, column.is_null().to_numpy(zero_copy_only=False), "null value")
            values = column.cast(pa.float32(), safe=False).to_numpy(zero_copy_only=False)
            _mark(bad, reason, ~np.isfinite(values), "NaN or Inf")
            return values
        # Classes. A NaN in a float column is how pandas marks a missing label.
        null = pc.is_null(column, nan_is_null=True).to_numpy(zero_copy_only=False)
        _mark(bad, reason, null, "null value")
        if pa.types.is_integer(column.type):
            labels = pc.fill_null(column, -1).to_numpy().astype(np.int64)
        else:
            values = column.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
            whole = np.isfinite(values) & (np.floor(values) == values)
            _mark(bad, reason, ~whole, "label not an integer")
            # Compared as floats first: a huge value must not wrap around in the cast.
            fits = whole & (values >= 0) & (values < self.num_classes)
            labels = np.where(fits, values, -1).astype(np.int64)
        _mark(bad, reason, (labels < 0) | (labels >= self.num_classes), "label out of range")
        return labels

    def _check(self, chunk: SourceChunk):
        """The checks every row goes through: (plan, features, labels or None, bad, reason)."""
        table = chunk.table
        plan = self.plan(chunk.origin, table.schema)
        n = table.num_rows
        bad = np.zeros(n, dtype=bool)
        reason: list[str | None] = [None] * n
        features = self._features(table, plan, bad, reason)
        labels = self._labels(table.column(plan.label), bad, reason) if plan.label else None
        _mark(bad, reason, ~np.isfinite(features).all(axis=1), "NaN or Inf")
        if plan.key:
            null_key = table.column(plan.key).is_null().to_numpy(zero_copy_only=False)
            _mark(bad, reason, null_key, "null value")
        return plan, features, labels, bad, reason

    def process(self, chunk: SourceChunk) -> tuple[pa.Table, pa.Table]:
        """Split one chunk into (normalized accepted rows, quarantine rows)."""
        table = chunk.table
        plan, features, labels, bad, reason = self._check(chunk)
        n = table.num_rows
        if plan.key:
            key_col = table.column(plan.key).combine_chunks()
            keys = keys_from_column(pc.fill_null(key_col, 0) if key_col.null_count else key_col)
        else:
            # Float labels enter the key by their bits: casting would merge 1.2 and 1.7.
            label_bits = labels.view(np.int32) if labels.dtype == np.float32 else labels
            keys = content_keys(np.nan_to_num(features), label_bits)
        if self.cfg.duplicates == "reject":
            dup = np.zeros(n, dtype=bool)
            for i, key in enumerate(keys.tolist()):
                if not bad[i]:
                    dup[i] = key in self._seen
                    self._seen.add(key)
            _mark(bad, reason, dup, "duplicate")

        good = self._count(n, bad)
        if not good.any():  # nothing to keep (and perhaps no shape known yet)
            accepted = pa.table({})
        else:
            if bad.any():
                keys, features, labels = keys[good], features[good], labels[good]
            accepted = normalized_table(keys, features, labels, self.layout)
        quarantined = self._quarantine(chunk, np.flatnonzero(bad), reason, table)
        return accepted, quarantined

    def screen(self, chunk: SourceChunk) -> Screened:
        """Check one chunk of unlabelled rows (new data to score): the same row checks as
        ingest, without labels, keys or duplicates (every row gets its own prediction)."""
        if self.labelled:
            raise RuntimeError("screen() checks unlabelled rows: build it with labels=None")
        _, features, _, bad, reason = self._check(chunk)
        good = self._count(chunk.table.num_rows, bad)
        quarantined = self._quarantine(chunk, np.flatnonzero(bad), reason, chunk.table)
        return Screened(features[good] if bad.any() else features, good, quarantined)

    def _count(self, n: int, bad: np.ndarray) -> np.ndarray:
        self.report.rows_in += n
        good = ~bad
        self.report.rows_accepted += int(good.sum())
        return good

    def _quarantine(self, chunk, bad_rows, reason, table) -> pa.Table:
        if not len(bad_rows):
            return QUARANTINE_SCHEMA.empty_table()
        rows = table.take(pa.array(bad_rows)).to_pylist()
        origin, first = chunk.origin, chunk.first_row
        for i in bad_rows:
            self.report.add_rejected(reason[i], f"{origin} row {first + int(i)}")
        return pa.Table.from_pydict(
            {
                "origin": [origin] * len(bad_rows),
                "source_row": [first + int(i) for i in bad_rows],
                "reason": [reason[i] for i in bad_rows],
                "row": [json.dumps(r, default=str) for r in rows],
            },
            schema=QUARANTINE_SCHEMA,
        )


def _mark(bad: np.ndarray, reason: list, mask: np.ndarray, why: str) -> None:
    """Flag rows; each row keeps the first reason it failed for."""
    for i in np.flatnonzero(mask & ~bad):
        reason[i] = why
    bad |= mask
