"""Ingest: validate the source and snapshot it into data/raw/ as Parquet (DVC tracks it).

Streams chunk by chunk. Outputs are written aside and swapped in only when the whole
input has been read and accepted, so on any failure data/raw/ and data/quarantine/ stay
exactly as they were. Until then data/raw/ still holds the previous version, whose schema
metadata tells validation what the features were (to report a change of them).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from training.atomic import atomic_dir, write_json
from training.data.options import DataConfig, LabelKind
from training.data.sources import RawLayout, open_chunks
from training.data.text import TextReport, ingest_text
from training.data.validate import QUARANTINE_SCHEMA, ValidationReport, Validator
from training.errors import ConfigError, DataError
from training.progress import Progress

ROWS_PER_RAW_FILE = 1_000_000
QUARANTINE_FILE = "quarantine.parquet"


class _RollingParquet:
    """Parquet parts of at most `rows_per_file` rows: part-00000.parquet, ..."""

    def __init__(self, folder: Path, rows_per_file: int) -> None:
        self.folder, self.rows_per_file = folder, rows_per_file
        self._writer: pq.ParquetWriter | None = None
        self._rows = 0
        self._parts = 0

    def write(self, table: pa.Table) -> None:
        while table.num_rows:
            if self._writer is None or self._rows >= self.rows_per_file:
                self.close()
                path = self.folder / f"part-{self._parts:05d}.parquet"
                self._writer = pq.ParquetWriter(path, table.schema)
                self._parts, self._rows = self._parts + 1, 0
            take = min(table.num_rows, self.rows_per_file - self._rows)
            self._writer.write_table(table.slice(0, take))
            self._rows += take
            table = table.slice(take)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def previous_layout(raw_dir: Path) -> RawLayout | None:
    """The layout of the table snapshot in `raw_dir`, if it holds a readable one."""
    parts = sorted(raw_dir.glob("part-*.parquet"))
    if not parts:
        return None
    try:
        return RawLayout.of(pq.read_schema(parts[0]))
    except (pa.ArrowException, OSError, DataError, ValueError):
        return None  # not a table snapshot we wrote: nothing to compare with


def _expected_rows(cfg: DataConfig) -> int | None:
    """Rows the source will yield, where known without reading it (for progress only)."""
    if cfg.source != "synthetic":
        return None
    return min(cfg.synthetic_rows, cfg.max_rows or cfg.synthetic_rows)


def ingest(
    cfg: DataConfig,
    root: Path,
    raw_dir: Path,
    quarantine_dir: Path,
    report_path: Path,
    *,
    labels: LabelKind | None = "classes",
) -> ValidationReport | TextReport:
    """Validate the source and snapshot it into `raw_dir`. `labels` is what the task needs
    a table's label column to hold: integer classes or float values (text sources have
    none: documents and a tokenizer, not rows)."""
    if cfg.source_info.text:
        return ingest_text(cfg, root, raw_dir, quarantine_dir, report_path)
    # Read before anything is written: the snapshot this ingest replaces, to report a
    # change of the table's features between data versions.
    if labels is None:
        raise ConfigError(
            f"data.source {cfg.source} is a table, and the task reads no labels from a table: "
            "set a task.type that learns from tables, or a text source"
        )
    validator = Validator(cfg, labels, previous=previous_layout(raw_dir))
    progress = Progress(f"ingest {cfg.source}", _expected_rows(cfg), "rows")
    with progress, atomic_dir(raw_dir) as raw_stage, atomic_dir(quarantine_dir) as q_stage:
        raw = _RollingParquet(raw_stage, ROWS_PER_RAW_FILE)
        quarantine = pq.ParquetWriter(q_stage / QUARANTINE_FILE, QUARANTINE_SCHEMA)
        try:
            for chunk in open_chunks(cfg, root, labels):
                accepted, rejected = validator.process(chunk)
                if accepted.num_rows:
                    raw.write(accepted)
                if rejected.num_rows:
                    quarantine.write_table(rejected)
                progress.advance(chunk.table.num_rows)
        finally:
            raw.close()
            quarantine.close()
        report = validator.report
        report.rows_quarantined = sum(report.reasons.values())
        if report.rows_in == 0:
            raise DataError(
                f"the {cfg.source} source at {cfg.path!r} has no rows; add data or fix data.path"
            )
        if report.rows_quarantined and cfg.on_invalid == "fail":
            raise DataError(
                f"invalid input rows, nothing was written.\n{report.describe()}\n"
                "Fix the input, or set data.on_invalid: quarantine to set bad rows aside "
                "in data/quarantine/"
            )
        if report.rows_accepted == 0:
            raise DataError(f"no valid rows to train on.\n{report.describe()}")
        # The invariant the report promises; a mismatch is a bug in validation.
        if report.rows_in != report.rows_accepted + report.rows_quarantined:
            raise RuntimeError(f"row accounting broken: {report.to_dict()}")
    write_json(report_path, report.to_dict())
    return report
