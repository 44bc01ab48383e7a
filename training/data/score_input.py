"""New rows to score: a folder of tables (or prompts) read batch by batch and checked by
the same validation as ingest, without labels.

What the rows must hold comes from the model, not from the data section: the feature
columns it was trained on (`DataSpec.column_names`: the source's names, f0..fN-1 for
images and unnamed tables) or one list column of its feature shape; a language model
takes prompts, from a table's prompt column or one per `*.txt` file (checked as ingest
checks text files: UTF-8, not empty, not binary). Each good row keeps its key: the id
column when the input has one, else the file and the row's number in it.

Nothing here holds more than one batch: files are read with pyarrow in record batches
of `batch_rows`, and each batch is checked and handed on before the next is read.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from training.data import text, validate
from training.data.options import DataConfig
from training.data.sources import SourceChunk, open_chunks, table_files
from training.data.spec import DataSpec
from training.data.validate import QUARANTINE_SCHEMA, Validator
from training.errors import DataError

FILE_KEY, ROW_KEY = "file", "row"  # the key of rows whose input has no id column
DEFAULT_ID = "id"
TABLE_FORMATS = ("parquet", "csv")
TEXT_GLOB = "*.txt"
_HASH_BLOCK = 1 << 20


@dataclass(frozen=True)
class InputOptions:
    """Where the new rows are and how to read them (the `score` section, resolved)."""

    path: str  # a folder or a file, relative to the project (or absolute)
    format: str = "auto"  # auto | parquet | csv | text
    key_column: str | None = None
    tensor_column: str | None = None
    prompt_column: str = "prompt"
    batch_rows: int = 8192


@dataclass(frozen=True)
class InputBatch:
    """The good rows of one batch and the bad ones set aside."""

    keys: dict[str, pa.Array]  # the row key columns, one value per good row
    features: np.ndarray | None  # (good rows, *feature_shape) float32; None for prompts
    prompts: list[str] | None  # language models: one prompt per good row
    quarantined: pa.Table  # QUARANTINE_SCHEMA: origin, source_row, reason, row

    @property
    def rows(self) -> int:
        return len(self.prompts) if self.prompts is not None else len(self.features)


@dataclass
class InputReport:
    """Rows read = rows good + rows bad, with the reasons and a few examples of each."""

    rows_in: int = 0
    rows_bad: int = 0
    reasons: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    ignored_columns: list[str] = field(default_factory=list)

    def add(self, quarantined: pa.Table, rows: int) -> None:
        self.rows_in += rows
        self.rows_bad += quarantined.num_rows
        for origin, row, reason in zip(
            quarantined.column("origin").to_pylist(),
            quarantined.column("source_row").to_pylist(),
            quarantined.column("reason").to_pylist(),
            strict=True,
        ):
            self.reasons[reason] += 1
            shown = self.examples.setdefault(reason, [])
            if len(shown) < 3:
                shown.append(f"{origin} row {row}")

    def describe(self) -> str:
        lines = [f"{self.rows_in} rows read, {self.rows_bad} invalid:"]
        for reason, count in self.reasons.most_common():
            hint = validate.HINTS.get(reason) or text.HINTS.get(reason, "")
            hint = f" ({hint})" if hint else ""
            lines.append(f"  {reason}: {count} rows, e.g. {'; '.join(self.examples[reason])}{hint}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "rows_in": self.rows_in,
            "rows_bad": self.rows_bad,
            "invalid_by_reason": dict(sorted(self.reasons.items())),
            "ignored_columns": list(self.ignored_columns),
        }


class NewRows:
    """The new rows under `options.path` for a model trained on `spec` data (`data`: the
    training data's section, for its key and tensor column names)."""

    def __init__(self, root: Path, options: InputOptions, spec: DataSpec, data: DataConfig) -> None:
        self.root, self.options, self.spec, self.data = root, options, spec, data
        self.location = self._location()
        self.format = self._format()
        self.files = self._files()
        self.report = InputReport()

    # ---- what the input is --------------------------------------------------------------

    def _location(self) -> Path:
        location = (self.root / self.options.path).resolve()
        if not location.exists():
            raise DataError(
                f"the input {self.options.path!r} does not exist (looked in {location}); put "
                "the new rows there or pass --input / set score.input"
            )
        return location

    def _format(self) -> str:
        wanted = self.options.format
        prompts = self.spec.kind == "tokens"
        if wanted == "text" and not prompts:
            raise DataError(
                f"score.format text is for language models; this model takes {self.spec.kind} "
                "rows from Parquet or CSV tables"
            )
        if wanted != "auto":
            return wanted
        location = self.location
        kinds = [*TABLE_FORMATS, *(("text",) if prompts else ())]
        suffixes = {"parquet": ".parquet", "csv": ".csv", "text": ".txt"}
        if location.is_file():
            found = [k for k in kinds if location.suffix == suffixes[k]]
        else:
            found = [k for k in kinds if any(location.rglob(f"*{suffixes[k]}"))]
        if len(found) == 1:
            return found[0]
        listed = ", ".join(f"*{suffixes[k]}" for k in kinds)
        if not found:
            raise DataError(f"no input files in {self.options.path!r}: expected {listed} files")
        raise DataError(
            f"{self.options.path!r} holds both {' and '.join(found)} files; set score.format "
            f"to the one to score ({' or '.join(found)})"
        )

    def _table_config(self, source: str) -> DataConfig:
        """The data section that reads the input as ingest reads a table of this layout."""
        return DataConfig(
            source=source,
            path=str(self.options.path),
            read_batch_rows=self.options.batch_rows,
            on_invalid="quarantine",
        )

    def _files(self) -> list[Path]:
        if self.format == "text":
            cfg = self._table_config("text").model_copy(update={"text_glob": TEXT_GLOB})
            return [f.path for f in text.list_files(cfg, self.root)]
        return table_files(self._table_config(self.format), self.root)

    def md5(self) -> str:
        """The input's md5: the file's own for one file; for several, the md5 of their
        relative paths and md5s, sorted (so renaming or changing any file changes it)."""
        digests = [(self._shown(path), _file_md5(path)) for path in self.files]
        if self.location.is_file():
            return digests[0][1]
        listing = "".join(f"{name}\0{md5}\n" for name, md5 in sorted(digests))
        return hashlib.md5(listing.encode()).hexdigest()

    def _shown(self, path: Path) -> str:
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)

    # ---- reading ------------------------------------------------------------------------

    def batches(self) -> Iterator[InputBatch]:
        if self.format == "text":
            yield from self._prompt_files()
        elif self.spec.kind == "tokens":
            yield from self._prompt_tables()
        else:
            yield from self._feature_tables()

    def _key_column(self, names: list[str]) -> str | None:
        if self.options.key_column:
            return self.options.key_column  # named: missing from a file is an error there
        for candidate in (self.data.key_column, DEFAULT_ID):
            if candidate and candidate in names:
                return candidate
        return None

    def _first_names(self) -> list[str]:
        """The first file's columns (to find its id column); [] when it cannot be read, so
        that reading it fails with the sources' own message."""
        first = self.files[0]
        try:
            if self.format == "parquet":
                return pq.read_schema(first).names
            reader = pcsv.open_csv(first)
            names = reader.schema.names
            reader.close()
            return names
        except (pa.ArrowException, OSError, UnicodeDecodeError):
            return []

    def _feature_tables(self) -> Iterator[InputBatch]:
        spec, key = self.spec, self._key_column(self._first_names())
        tensor = self.options.tensor_column
        if tensor is None and self.data.source in TABLE_FORMATS:
            tensor = self.data.tensor_column  # new rows laid out like the training table
        cfg = self._table_config(self.format).model_copy(
            update={
                "feature_columns": None if tensor else spec.column_names,
                "tensor_column": tensor,
                "feature_shape": list(spec.feature_shape),
                "key_column": key,
                # Raw ids hashed as ingest hashed them (training.data.categorical).
                "categorical_columns": (
                    list(spec.categorical_columns) if spec.categorical_hashed else None
                ),
            }
        )
        validator = Validator(cfg, labels=None)
        for chunk in self._chunks(cfg):
            try:
                screened = validator.screen(chunk)
            except DataError as exc:
                raise DataError(f"{exc}. {self._wanted(tensor)}") from exc
            keys = self._keys(chunk, key, screened.good)
            features = screened.features.reshape(len(screened.features), *spec.feature_shape)
            yield self._counted(InputBatch(keys, features, None, screened.quarantined), chunk)
        self.report.ignored_columns = list(validator.report.ignored_columns)

    def _chunks(self, cfg: DataConfig) -> Iterator[SourceChunk]:
        """The sources' chunks cut to at most `batch_rows` rows (a CSV is read in blocks
        of bytes): zero-copy slices."""
        size = self.options.batch_rows
        for chunk in open_chunks(cfg, self.root):
            for start in range(0, chunk.table.num_rows, size):
                part = chunk.table.slice(start, size)
                yield SourceChunk(chunk.origin, chunk.first_row + start, part)

    def _wanted(self, tensor: str | None) -> str:
        if tensor:
            return (
                f"New rows need a list column {tensor!r} of {list(self.spec.feature_shape)} "
                "numbers per row, as the model was trained on"
            )
        names = self.spec.column_names
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} columns)" if len(names) > 6 else "")
        return (
            f"New rows need the model's feature columns {shown}, or one list column of "
            f"{list(self.spec.feature_shape)} numbers named by score.tensor_column"
        )

    def _keys(self, chunk: SourceChunk, key: str | None, good: np.ndarray) -> dict[str, pa.Array]:
        mask = pa.array(good)
        if key:
            return {key: chunk.table.column(key).combine_chunks().filter(mask)}
        rows = np.arange(chunk.first_row, chunk.first_row + chunk.table.num_rows)[good]
        return {
            FILE_KEY: pa.array([chunk.origin] * len(rows), pa.string()),
            ROW_KEY: pa.array(rows, pa.int64()),
        }

    def _counted(self, batch: InputBatch, chunk: SourceChunk | int) -> InputBatch:
        """`batch`, counted in the report (`chunk`: what it was read from, or its rows)."""
        rows = chunk if isinstance(chunk, int) else chunk.table.num_rows
        self.report.add(batch.quarantined, rows)
        return batch

    # ---- prompts --------------------------------------------------------------------------

    def _prompt_tables(self) -> Iterator[InputBatch]:
        column = self.options.prompt_column
        key = self._key_column(self._first_names())
        cfg = self._table_config(self.format).model_copy(update={"key_column": key})
        for chunk in self._chunks(cfg):
            table = chunk.table
            missing = [c for c in (column, key) if c and c not in table.column_names]
            if missing:
                raise DataError(
                    f"{chunk.origin}: missing column(s) {', '.join(map(repr, missing))}; the file "
                    f"has {', '.join(table.column_names)}. A language model scores prompts: "
                    "name their column with score.prompt_column"
                )
            values = table.column(column)
            if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
                raise DataError(
                    f"{chunk.origin}: prompt column {column!r} has type {values.type}; prompts "
                    "are text"
                )
            reasons = [_prompt_problem(v) for v in values.to_pylist()]
            if key:
                null_keys = table.column(key).is_null().to_pylist()
                reasons = [
                    r or ("null value" if null else None)
                    for r, null in zip(reasons, null_keys, strict=True)
                ]
            good = np.array([r is None for r in reasons], dtype=bool)
            prompts = [p for p, ok in zip(values.to_pylist(), good, strict=True) if ok]
            bad = _quarantine(chunk, reasons, table)
            yield self._counted(InputBatch(self._keys(chunk, key, good), None, prompts, bad), chunk)

    def _prompt_files(self) -> Iterator[InputBatch]:
        """One prompt per file, checked as ingest checks a text file."""
        for start in range(0, len(self.files), self.options.batch_rows):
            names, prompts, rejected = [], [], []
            for path in self.files[start : start + self.options.batch_rows]:
                shown = self._shown(path)
                prompt, reason, detail = text.decode_text(path.read_bytes())
                if prompt is None:
                    rejected.append((shown, reason, json.dumps({"detail": detail})))
                else:
                    names.append(shown)
                    prompts.append(prompt)
            bad = pa.Table.from_pydict(
                {
                    "origin": [r[0] for r in rejected],
                    "source_row": [0] * len(rejected),
                    "reason": [r[1] for r in rejected],
                    "row": [r[2] for r in rejected],
                },
                schema=QUARANTINE_SCHEMA,
            )
            keys = {
                FILE_KEY: pa.array(names, pa.string()),
                ROW_KEY: pa.array(np.zeros(len(names), dtype=np.int64)),
            }
            yield self._counted(InputBatch(keys, None, prompts, bad), len(names) + len(rejected))


def _prompt_problem(value: str | None) -> str | None:
    """Why a prompt cannot be scored (the text checks of ingest), or None."""
    if value is None:
        return "null value"
    usable, reason, _ = text.decode_text(value.encode("utf-8"))
    return None if usable is not None else reason


def _quarantine(chunk: SourceChunk, reasons: list[str | None], table: pa.Table) -> pa.Table:
    bad = [i for i, r in enumerate(reasons) if r is not None]
    rows = table.take(pa.array(bad, pa.int64())).to_pylist() if bad else []
    return pa.Table.from_pydict(
        {
            "origin": [chunk.origin] * len(bad),
            "source_row": [chunk.first_row + i for i in bad],
            "reason": [reasons[i] for i in bad],
            "row": [json.dumps(r, default=str) for r in rows],
        },
        schema=QUARANTINE_SCHEMA,
    )


def _file_md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(_HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()
