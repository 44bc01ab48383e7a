"""Ingest under generated input: whatever table or corruption arrives, ingest either
accepts it with counts that add up, or fails with a DataError that names the file and
leaves data/raw/ and data/quarantine/ exactly as they were. Nothing else escapes."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from training.config import DataConfig
from training.data.ingest import QUARANTINE_FILE, ingest
from training.errors import USER_ERROR_EXIT_CODE, DataError, is_retryable_exit
from training.objectives import TASKS

from .conftest import copy_project

QUICK = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ["a", "b", "c", "d"]
NUM_CLASSES = 3

# ---- generated tables -----------------------------------------------------------------

finite = st.floats(-1e6, 1e6)
special = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e300, -0.0])
ints = st.integers(-(2**40), 2**40)
floats = st.one_of(finite, finite, finite, special)  # mostly plain numbers
class_ints = st.integers(0, NUM_CLASSES - 1) | st.sampled_from([-1, NUM_CLASSES, 2**40])
class_floats = class_ints.map(float) | st.sampled_from([0.5, 2.25, float("nan"), 1e30])


@st.composite
def columns(draw, values: st.SearchStrategy, n: int) -> list:
    """One column of n values; in some columns some values are missing."""
    if draw(st.sampled_from([False, False, True])):
        values = st.one_of(st.none(), values, values, values)
    return draw(st.lists(values, min_size=n, max_size=n))


@st.composite
def tables(draw) -> dict[str, list]:
    """A table as a user might hand it over: numbers of either kind, missing values,
    sometimes a text column, now and then no label."""
    n = draw(st.integers(1, 12))
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    table = {name: draw(columns(draw(st.sampled_from([ints, floats])), n)) for name in names}
    if draw(st.sampled_from([True] * 9 + [False])):  # now and then no label
        table["label"] = draw(columns(draw(st.sampled_from([class_ints, class_floats])), n))
    if draw(st.sampled_from([False] * 4 + [True])):
        table["note"] = draw(columns(st.text(max_size=6), n))
    return table


@st.composite
def options(draw, names: list[str]) -> dict:
    """How ingest is configured for a table with these columns."""
    numeric = [c for c in names if c in NAMES]
    listing = draw(st.sampled_from(range(10)))
    if listing < 5 or not numeric:
        feature_columns = None  # inferred: all but label and key
    else:
        chosen = draw(st.lists(st.sampled_from(numeric), min_size=1, unique=True))
        feature_columns = chosen + (["z"] if listing == 9 else [])  # z: not in the file
    return {
        "task": draw(st.sampled_from(["classification", "regression"])),
        "on_invalid": draw(st.sampled_from(["fail", "quarantine"])),
        "duplicates": draw(st.sampled_from(["keep", "reject"])),
        "feature_columns": feature_columns,
        "previous": draw(st.sampled_from(["none", "none", "garbage", "snapshot"])),
    }


def _arrow(table: dict[str, list]) -> pa.Table:
    """Each column typed by its values (all missing: Arrow's null type)."""
    arrays = {}
    for name, values in table.items():
        present = [v for v in values if v is not None]
        if not present:
            arrays[name] = pa.array(values, pa.null())
        elif isinstance(present[0], str):
            arrays[name] = pa.array(values, pa.string())
        elif all(isinstance(v, int) for v in present):
            arrays[name] = pa.array(values, pa.int64())
        else:
            arrays[name] = pa.array([None if v is None else float(v) for v in values])
    return pa.table(arrays)


def _csv_bytes(table: dict[str, list]) -> bytes:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(table)
    for row in zip(*table.values(), strict=True):
        writer.writerow(["" if v is None else repr(v) if isinstance(v, float) else v for v in row])
    return buffer.getvalue().encode()


def _parquet_bytes(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


# ---- the property ---------------------------------------------------------------------


def _tree(folder: Path) -> dict[str, bytes]:
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@contextmanager
def _project(name: str, content: bytes, previous: str) -> Iterator[Path]:
    """A project folder holding the input file and, in data/raw, a previous version."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "incoming").mkdir()
        if previous == "snapshot":  # what the last good ingest of a table left
            pq.write_table(
                pa.table({"a": [0.5, 1.5], "b": [1, 2], "label": [0, 1]}), root / "p.parquet"
            )
            cfg = DataConfig(source="parquet", path="p.parquet", num_classes=NUM_CLASSES)
            ingest(cfg, root, root / "raw", root / "quarantine", root / "report.json")
            (root / "report.json").unlink()
        elif previous == "garbage":
            (root / "raw").mkdir()
            (root / "raw" / "previous.parquet").write_bytes(b"previous snapshot")
            (root / "quarantine").mkdir()
            (root / "quarantine" / QUARANTINE_FILE).write_bytes(b"previous quarantine")
        (root / "incoming" / name).write_bytes(content)
        yield root


def ingest_holds_its_promise(content: bytes, fmt: str, options: dict) -> DataError | None:
    """Ingest `content`; check the promise either way. Returns the error, if it failed."""
    name = f"t.{fmt}"
    task = options["task"]
    cfg = DataConfig(
        source=fmt,
        path=f"incoming/{name}",
        num_classes=NUM_CLASSES if task == "classification" else None,
        on_invalid=options["on_invalid"],
        duplicates=options["duplicates"],
        feature_columns=options["feature_columns"],
    )
    with _project(name, content, options["previous"]) as root:
        raw, quarantine, report_path = root / "raw", root / "quarantine", root / "report.json"
        before = (_tree(raw), _tree(quarantine))
        try:
            report = ingest(cfg, root, raw, quarantine, report_path, labels=TASKS[task].labels)
        except DataError as exc:
            assert f"incoming/{name}" in str(exc), str(exc)
            assert (_tree(raw), _tree(quarantine)) == before
            assert not report_path.exists()
            staged = [p.name for p in root.iterdir() if p.name.startswith(".")]
            assert not staged, staged  # nothing half-written left beside the outputs
            event(f"refused: {str(exc).partition(': ')[2][:30]}")
            return exc
        assert report.rows_in == report.rows_accepted + report.rows_quarantined
        accepted = pq.read_table(raw)
        assert accepted.num_rows == report.rows_accepted > 0
        label_type = pa.int64() if task == "classification" else pa.float32()
        assert accepted.schema.field("label").type == label_type
        assert pq.read_table(quarantine / QUARANTINE_FILE).num_rows == report.rows_quarantined
        assert json.loads(report_path.read_text()) == report.to_dict()
        if options["on_invalid"] == "fail":
            assert report.rows_quarantined == 0
        event("accepted" + (" with quarantine" if report.rows_quarantined else ""))
        return None


@QUICK
@given(table=tables(), fmt=st.sampled_from(["csv", "parquet"]), data=st.data())
def test_generated_tables_are_accepted_or_refused_cleanly(table, fmt, data) -> None:
    content = _csv_bytes(table) if fmt == "csv" else _parquet_bytes(_arrow(table))
    ingest_holds_its_promise(content, fmt, data.draw(options(list(table))))


# ---- generated corruptions of a good table --------------------------------------------


@st.composite
def good_tables(draw, note: bool | None = None) -> dict[str, list]:
    """Two features, a label and (by `note`, or by chance) a text column."""
    n = draw(st.integers(1, 8))
    table = {
        "a": draw(st.lists(finite, min_size=n, max_size=n)),
        "b": draw(st.lists(st.integers(-100, 100), min_size=n, max_size=n)),
        "label": draw(st.lists(st.integers(0, NUM_CLASSES - 1), min_size=n, max_size=n)),
    }
    if note or (note is None and draw(st.booleans())):
        text = st.text('xyz, "é', min_size=1, max_size=4)
        table["note"] = draw(st.lists(text, min_size=n, max_size=n))
    return table


INVALID_UTF8 = [b"\xff", b"\xfe", b"\x80", b"\xc3(", b"\xed\xa0\x80", b"\xf0\x28\x8c\x28"]


def _lines(content: bytes) -> list[bytes]:
    return content.split(b"\n")


@QUICK
@given(
    table=good_tables(note=True),
    where=st.sampled_from(["header", "first row", "last row", "quoted field"]),
    bad=st.sampled_from(INVALID_UTF8),
    at=st.integers(0, 7),
    data=st.data(),
)
def test_invalid_utf8_anywhere_is_refused_naming_file_and_line(table, where, bad, at, data):
    rows = len(table["a"])
    if where == "quoted field":
        table["note"] = ['"' + v for v in table["note"]]  # a quote: the field gets quoted
    lines = _lines(_csv_bytes(table))
    index = {"header": 0, "first row": 1, "last row": rows}.get(where, 1 + at % rows)
    line = lines[index]
    cut = line.index(b',"') + 2 if where == "quoted field" else min(at, len(line))
    lines[index] = line[:cut] + bad + line[cut:]
    error = ingest_holds_its_promise(b"\n".join(lines), "csv", data.draw(options(list(table))))
    assert error is not None
    assert "not UTF-8" in str(error) and f"line {index + 1}" in str(error), str(error)


@st.composite
def corrupted_csv(draw) -> tuple[dict[str, list], bytes]:
    """A good table as CSV, then one thing done to it."""
    table = draw(good_tables())
    rows = len(table["a"])
    row = draw(st.integers(0, rows - 1))
    kind = draw(st.sampled_from(["truncate", "value", "label", "fields", "header"]))
    if kind == "value":  # a wrong type, a non-finite or missing value in a feature
        bad = ["abc", "nan", "inf", "-inf", "1e400", "", "1,5", "true", "0x1F"]
        table[draw(st.sampled_from(["a", "b"]))][row] = draw(st.sampled_from(bad))
    elif kind == "label":  # out of range, not an integer, missing, not a number
        bad = ["-1", "3", "2.5", "1e30", "", "nan", "x", "1.0", "inf"]
        table["label"][row] = draw(st.sampled_from(bad))
    content = _csv_bytes(table)
    lines = _lines(content)
    if kind == "truncate":
        content = content[: draw(st.integers(0, len(content) - 1))]
    elif kind == "fields":  # one row with a field too many or too few
        lines[1 + row] = draw(st.sampled_from([lines[1 + row] + b",9", b"0.5,1"]))
        content = b"\n".join(lines)
    elif kind == "header":  # a repeated, a missing or an extra column name
        names = list(table)
        headers = [["a", *names[1:]], ["a", "b", "label2", *names[3:]], names[1:], [*names, "x"]]
        lines[0] = ",".join(draw(st.sampled_from(headers))).encode()
        content = b"\n".join(lines)
    return table, content


@QUICK
@given(case=corrupted_csv(), data=st.data())
def test_corrupted_csv_is_accepted_or_refused_cleanly(case, data) -> None:
    table, content = case
    ingest_holds_its_promise(content, "csv", data.draw(options(list(table))))


@QUICK
@given(
    table=good_tables(),
    cut=st.sampled_from([None, None, None]) | st.integers(0, 10**6),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=2),
    data=st.data(),
)
def test_corrupted_parquet_is_accepted_or_refused_cleanly(table, cut, flips, data) -> None:
    content = bytearray(_parquet_bytes(_arrow(table)))
    for where, xor in flips:
        content[where % len(content)] ^= xor
    if cut is not None:
        content = content[: cut % len(content)]
    ingest_holds_its_promise(bytes(content), "parquet", data.draw(options(list(table))))


# ---- through the CLI, as dvc.yaml runs it ---------------------------------------------


@pytest.mark.timeout(120)
def test_stage_ingest_exits_2_on_a_bad_csv_header_and_is_not_retried(tmp_path) -> None:
    root = copy_project(tmp_path / "gradline")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["data"].update(source="csv", path="data/incoming/t.csv", num_classes=NUM_CLASSES)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "data" / "incoming").mkdir(parents=True, exist_ok=True)
    (root / "data" / "incoming" / "t.csv").write_bytes(b"a\xe9,b,label\n0.1,1,0\n")
    error_file = tmp_path / "error.json"
    env = {**os.environ, "GRADLINE_ERROR_FILE": str(error_file), "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "stage",
            "ingest",
            "--out",
            "data/raw",
            "--quarantine",
            "data/quarantine",
            "--report",
            "data/ingest.json",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == USER_ERROR_EXIT_CODE, proc.stderr[-3000:]
    assert not is_retryable_exit(proc.returncode)
    assert "Traceback" not in proc.stderr
    assert "data/incoming/t.csv: not UTF-8 (first bad byte at line 1 (the header)" in proc.stderr
    assert json.loads(error_file.read_text())["type"] == "DataError"
    assert not (root / "data" / "raw").exists() and not (root / "data" / "ingest.json").exists()
