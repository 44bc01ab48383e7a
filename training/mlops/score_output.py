"""The streaming half of `gradline score`: new rows in, a Parquet file of predictions out.

Three stages overlap, each on its own thread, with at most two batches waiting between
them, so memory stays a few batches whatever the input's size:

    read + check (NewRows)  ->  the model (the calling thread)  ->  columns + write

Reading and checking (pyarrow, numpy), the model (torch) and the columns and Parquet
encoding (torch's softmax, pyarrow) all release the GIL, so on a machine with a second
core the model rarely waits for I/O. The predictions and the quarantine file are written
aside and renamed into place only when the whole input was read and accepted.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from training.atomic import atomic_file
from training.data.score_input import InputBatch, InputReport, NewRows
from training.data.validate import QUARANTINE_SCHEMA
from training.errors import DataError

QUARANTINE_SUFFIX = ".quarantine.parquet"
_DEPTH = 2  # batches waiting between two stages
_POLL_S = 0.1  # how often a blocked hand-over checks that the other side still lives


@dataclass(frozen=True)
class Prediction:
    """How a model predicts a batch: `run` on the calling thread (the model), `columns`
    on the writer's (what the output holds: the prediction and the task's extras)."""

    run: Callable[[InputBatch], Any]
    columns: Callable[[Any], dict[str, Any]]


def quarantine_path(output: Path) -> Path:
    """Where the bad rows of `output` go: beside it, `<name>.quarantine.parquet`."""
    return output.with_name(output.name.removesuffix(".parquet") + QUARANTINE_SUFFIX)


def write_predictions(
    rows: NewRows,
    prediction: Prediction,
    output: Path,
    fail_on_bad: bool,
    footer: Callable[[], dict[str, str]],
) -> list[str]:
    """Stream `rows` through `prediction` into `output` and its quarantine file; return the
    output's columns. `footer()` gives the output's key-value metadata, asked for once
    every row is written. On any failure nothing is written, not even a new folder."""
    quarantine = quarantine_path(output)
    made = [d for d in (output.parent, *output.parent.parents) if not d.exists()]
    try:
        return _write(rows, prediction, output, quarantine, fail_on_bad, footer)
    except BaseException:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _write(rows, prediction, output, quarantine, fail_on_bad, footer) -> list[str]:
    with atomic_file(output) as out_handle, atomic_file(quarantine) as bad_handle:
        bad_writer = pq.ParquetWriter(bad_handle, QUARANTINE_SCHEMA)
        behind = _WriteBehind(out_handle, prediction.columns)
        try:
            for batch in _read_ahead(rows.batches()):
                if batch.quarantined.num_rows:
                    bad_writer.write_table(batch.quarantined)
                # In fail mode the first bad row decides: the rest is only checked, so the
                # error can say how many rows failed and why, but no longer predicted.
                if not batch.rows or (fail_on_bad and rows.report.rows_bad):
                    continue
                behind.put(batch.keys, prediction.run(batch))
            behind.finish()
            _check_counts(rows.report, rows.options.path, fail_on_bad, quarantine)
            behind.writer.add_key_value_metadata(footer())
        finally:
            bad_writer.close()
            behind.close()
        return behind.writer.schema.names


def _parquet_writer(sink, schema: pa.Schema, keys: list[str]) -> pq.ParquetWriter:
    # Dictionary pages pay off for keys and classes, not for probabilities or values:
    # trying them on every float column made writing 4x slower.
    dictionary = [
        name for name in (*keys, "prediction") if not pa.types.is_floating(schema.field(name).type)
    ]
    return pq.ParquetWriter(sink, schema, use_dictionary=dictionary)


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Later batches in the first batch's schema (a key column typed differently in
    another file: a DataError naming it)."""
    if table.schema.equals(schema):
        return table
    try:
        return table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise DataError(
            f"the input's files do not agree on their columns' types ({table.schema.types} vs "
            f"{schema.types}): {exc}. Give every file the same key column type"
        ) from exc


def _check_counts(report: InputReport, where: str, fail_on_bad: bool, quarantine: Path) -> None:
    if report.rows_in == 0:
        raise DataError(f"the input {where!r} has no rows; add new rows or fix score.input")
    if report.rows_bad and fail_on_bad:
        raise DataError(
            f"invalid rows in {where!r}, nothing was written.\n{report.describe()}\nFix the "
            "input, or pass --on-bad-rows quarantine (score.on_bad_rows: quarantine) to "
            f"score the rest and set the bad rows aside in {quarantine.name}"
        )
    if report.rows_bad == report.rows_in:
        raise DataError(f"no valid rows to score in {where!r}.\n{report.describe()}")


# ---- the threads -------------------------------------------------------------------------


def _hand_over(to: queue.Queue, item: Any, other_side_alive: Callable[[], bool]) -> bool:
    """Put `item` into `to`, waiting while it is full; False if the other side is gone."""
    while other_side_alive():
        try:
            to.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


class Background:
    """`fn()` on a daemon thread; `result()` waits for it (and raises what it raised)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # raised again by result()
            self._error = exc

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


@dataclass(frozen=True)
class _Raised:
    error: BaseException


_DONE = object()


def _read_ahead(batches: Iterator[InputBatch]) -> Iterator[InputBatch]:
    """`batches`, read and checked up to `_DEPTH` ahead on a thread."""
    ahead: queue.Queue = queue.Queue(maxsize=_DEPTH)
    stop = threading.Event()

    def alive() -> bool:
        return not stop.is_set()

    def produce() -> None:
        try:
            for batch in batches:
                if not _hand_over(ahead, batch, alive):
                    return
            _hand_over(ahead, _DONE, alive)
        except BaseException as exc:  # raised again in the consumer, with its traceback
            _hand_over(ahead, _Raised(exc), alive)

    reader = threading.Thread(target=produce, name="gradline-score-reader", daemon=True)
    reader.start()
    try:
        while (item := ahead.get()) is not _DONE:
            if isinstance(item, _Raised):
                raise item.error
            yield item
    finally:
        stop.set()
        reader.join()


class _WriteBehind:
    """Each batch's output table built and written on a thread, while the model predicts
    the next batch. `writer` is the Parquet writer, once the first batch made it."""

    def __init__(self, sink, columns: Callable[[Any], dict[str, Any]]) -> None:
        self.sink, self.columns = sink, columns
        self.writer: pq.ParquetWriter | None = None
        self._pending: queue.Queue = queue.Queue(maxsize=_DEPTH)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gradline-score-writer")
        self._thread.daemon = True
        self._thread.start()

    def put(self, keys: dict[str, pa.Array], outputs: Any) -> None:
        if not _hand_over(self._pending, (keys, outputs), self._thread.is_alive):
            self._raise()
            raise RuntimeError("the score writer's thread stopped without an error")

    def finish(self) -> None:
        """Wait until every batch is written; raise what stopped the writer, if anything."""
        _hand_over(self._pending, _DONE, self._thread.is_alive)
        self._thread.join()
        self._raise()

    def close(self) -> None:
        """Stop the thread (after `finish`, or on an error) and close the file."""
        _hand_over(self._pending, _DONE, self._thread.is_alive)
        self._thread.join()
        if self.writer is not None:
            self.writer.close()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            while (item := self._pending.get()) is not _DONE:
                keys, outputs = item
                table = pa.table({**keys, **self.columns(outputs)})
                if self.writer is None:
                    self.writer = _parquet_writer(self.sink, table.schema, list(keys))
                self.writer.write_table(_conform(table, self.writer.schema))
        except BaseException as exc:  # raised again in the caller by put() or finish()
            self._error = exc
