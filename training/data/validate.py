"""Validation: every input row is accepted (normalized) or rejected with a reason.

Problems with a whole file (missing, extra or wrongly typed columns) always fail with a
message naming the file and the columns. Problems with rows (nulls, NaN/Inf, labels out
of range, ragged tensors, duplicates) fail too, or, with `data.on_invalid: quarantine`,
send the rows aside with their reason. Either way the counts add up:
rows in = rows accepted + rows quarantined.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.config import DataConfig
from training.data.hashing import content_keys, keys_from_column
from training.data.sources import FEATURES, LABEL, ROW_KEY, SourceChunk, classes_of, shape_of
from training.data.sources import to_table as normalized_table
from training.errors import DataError

REASONS = ("null value", "ragged tensor shape", "NaN or Inf", "label out of range", "duplicate")
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
    "NaN or Inf": "replace non-finite feature values",
    "label out of range": "labels must lie in 0..data.num_classes-1",
    "duplicate": "remove repeated rows, or set data.duplicates: keep",
}


def _is_numeric(dtype: pa.DataType) -> bool:
    return pa.types.is_integer(dtype) or pa.types.is_floating(dtype)


@dataclass
class ValidationReport:
    rows_in: int = 0
    rows_accepted: int = 0
    rows_quarantined: int = 0
    reasons: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add_rejected(self, reason: str, where: str) -> None:
        self.reasons[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < 3:
            shown.append(where)

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
        }


@dataclass(frozen=True)
class ColumnPlan:
    """How to read features, label and key out of one input schema."""

    label: str
    key: str | None
    feature_columns: tuple[str, ...] | None  # several numeric columns, or
    tensor: str | None  # one list column
    num_classes: int


class Validator:
    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self.builtin = cfg.source in ("digits", "synthetic")
        self.shape: tuple[int, ...] | None = (
            tuple(cfg.feature_shape) if cfg.feature_shape else None
        )
        self.num_classes: int | None = cfg.num_classes
        self.report = ValidationReport()
        self._seen: set[int] = set()
        self._first_plan: tuple[str, ColumnPlan] | None = None

    # ---- file level -------------------------------------------------------------------
    def plan(self, origin: str, schema: pa.Schema) -> ColumnPlan:
        if self.builtin:
            self.shape = shape_of(schema)
            self.num_classes = classes_of(schema)
            return ColumnPlan(LABEL, ROW_KEY, None, FEATURES, self.num_classes)
        cfg = self.cfg
        names = schema.names
        problems: list[str] = []
        wanted = [cfg.label_column] + ([cfg.key_column] if cfg.key_column else [])
        if cfg.tensor_column:
            wanted.append(cfg.tensor_column)
        if cfg.feature_columns:
            wanted.extend(cfg.feature_columns)
        missing = [c for c in wanted if c not in names]
        if missing:
            problems.append(
                f"missing column(s) {', '.join(map(repr, missing))}; the file has "
                f"{', '.join(names)} (set data.label_column / data.feature_columns / "
                "data.tensor_column / data.key_column to match)"
            )
        elif not pa.types.is_integer(schema.field(cfg.label_column).type):
            problems.append(
                f"label column {cfg.label_column!r} has type "
                f"{schema.field(cfg.label_column).type}; labels must be integers"
            )
        used = {cfg.label_column, cfg.key_column}
        features: tuple[str, ...] | None = None
        if cfg.tensor_column:
            used.add(cfg.tensor_column)
            if cfg.tensor_column in names:
                dtype = schema.field(cfg.tensor_column).type
                list_like = pa.types.is_list(dtype) or pa.types.is_large_list(dtype)
                list_like = list_like or pa.types.is_fixed_size_list(dtype)
                if not (list_like and _is_numeric(dtype.value_type)):
                    problems.append(
                        f"tensor column {cfg.tensor_column!r} has type {dtype}; "
                        "it must be a list of numbers"
                    )
        else:
            features = tuple(cfg.feature_columns or [c for c in names if c not in used])
            used.update(features)
            wrong = [
                f"{c} ({schema.field(c).type})"
                for c in features
                if c in names and not _is_numeric(schema.field(c).type)
            ]
            if wrong:
                problems.append(
                    f"feature column(s) not numeric: {', '.join(wrong)}; "
                    "every feature value must be a number"
                )
            if not features:
                problems.append("no feature columns; set data.feature_columns")
        extra = [c for c in names if c not in used]
        if extra:
            problems.append(
                f"unexpected column(s) {', '.join(map(repr, extra))}; list them in "
                "data.feature_columns or remove them from the file"
            )
        if problems:
            raise DataError(f"{origin}: " + "; ".join(problems))
        plan = ColumnPlan(cfg.label_column, cfg.key_column, features, cfg.tensor_column,
                          cfg.num_classes or 0)
        if self._first_plan is None:
            self._first_plan = (origin, plan)
        elif self._first_plan[1] != plan:
            raise DataError(
                f"{origin}: columns differ from {self._first_plan[0]}; every file of the "
                "table needs the same columns"
            )
        return plan

    # ---- row level --------------------------------------------------------------------
    def _features(self, table: pa.Table, plan: ColumnPlan, bad: np.ndarray, reason: list):
        n = table.num_rows
        if plan.feature_columns is not None:
            columns = [table.column(c) for c in plan.feature_columns]
            self.shape = self.shape or (len(columns),)
            null = np.zeros(n, dtype=bool)
            for column in columns:
                null |= column.is_null().to_numpy(zero_copy_only=False)
            _mark(bad, reason, null, "null value")
            matrix = np.column_stack(
                [c.to_numpy(zero_copy_only=False).astype(np.float32) for c in columns]
            )
            return matrix
        column = table.column(plan.tensor).combine_chunks()
        fixed = pa.types.is_fixed_size_list(column.type)
        if fixed and self.shape and column.type.list_size == math.prod(self.shape):
            values = column.flatten()
            if column.null_count == 0 and values.null_count == 0:
                # Already the right shape and complete: view it, no per-row work.
                return values.to_numpy(zero_copy_only=False).reshape(n, -1).astype(
                    np.float32, copy=False
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
            matrix[good] = values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(
                -1, width
            )
            null_rows = np.zeros(n, dtype=bool)
            null_rows[good] = inner_null.any(axis=1)
            _mark(bad, reason, null_rows, "null value")
        return matrix

    def process(self, chunk: SourceChunk) -> tuple[pa.Table, pa.Table]:
        """Split one chunk into (normalized accepted rows, quarantine rows)."""
        table = chunk.table
        plan = self.plan(chunk.origin, table.schema)
        n = table.num_rows
        bad = np.zeros(n, dtype=bool)
        reason: list[str | None] = [None] * n
        features = self._features(table, plan, bad, reason)
        label_col = table.column(plan.label)
        _mark(bad, reason, label_col.is_null().to_numpy(zero_copy_only=False), "null value")
        labels = pc.fill_null(label_col, -1).to_numpy().astype(np.int64)
        _mark(bad, reason, ~np.isfinite(features).all(axis=1), "NaN or Inf")
        classes = plan.num_classes or self.num_classes
        _mark(bad, reason, (labels < 0) | (labels >= classes), "label out of range")
        if plan.key:
            key_col = table.column(plan.key).combine_chunks()
            _mark(bad, reason, key_col.is_null().to_numpy(zero_copy_only=False), "null value")
            keys = keys_from_column(pc.fill_null(key_col, 0) if key_col.null_count else key_col)
        else:
            keys = content_keys(np.nan_to_num(features), labels)
        if self.cfg.duplicates == "reject":
            dup = np.zeros(n, dtype=bool)
            for i, key in enumerate(keys.tolist()):
                if not bad[i]:
                    dup[i] = key in self._seen
                    self._seen.add(key)
            _mark(bad, reason, dup, "duplicate")

        self.report.rows_in += n
        good = ~bad
        self.report.rows_accepted += int(good.sum())
        if bad.any():
            keys, features, labels = keys[good], features[good], labels[good]
        accepted = normalized_table(keys, features.reshape(-1, *self.shape), labels, classes)
        bad_rows = np.flatnonzero(bad)
        quarantined = self._quarantine(chunk, bad_rows, reason, table)
        return accepted, quarantined

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
