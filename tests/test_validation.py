"""Every class of bad input is rejected with a clear message (or quarantined), the counts
add up, and nothing partial is left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.config import DataConfig
from training.data.ingest import QUARANTINE_FILE, ingest
from training.errors import ConfigError, DataError
from training.objectives import TASKS

GOOD = {"a": [0.1, 0.2, 0.3, 0.4], "b": [1.0, 2.0, 3.0, 4.0], "label": [0, 1, 2, 1]}


def _cfg(source: str = "parquet", **kw) -> DataConfig:
    return DataConfig(**{"source": source, "path": "incoming", "num_classes": 3, **kw})


def _project(tmp_path: Path, tables: dict[str, pa.Table | bytes]) -> Path:
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    for name, content in tables.items():
        if isinstance(content, bytes):
            (incoming / name).write_bytes(content)
        elif name.endswith(".csv"):
            import pyarrow.csv as pcsv

            pcsv.write_csv(content, incoming / name)
        else:
            pq.write_table(content, incoming / name)
    # A previous snapshot that a failed ingest must leave untouched.
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "previous.parquet").write_bytes(b"previous snapshot")
    return tmp_path


def _ingest(root: Path, cfg: DataConfig, task: str = "classification"):
    labels = TASKS[task].labels  # what the task needs the label column to hold
    return ingest(cfg, root, root / "raw", root / "quarantine", root / "report.json", labels=labels)


def _assert_untouched(root: Path) -> None:
    assert [p.name for p in (root / "raw").iterdir()] == ["previous.parquet"]
    assert not (root / "quarantine").exists() and not (root / "report.json").exists()
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers


def _table(**columns) -> pa.Table:
    return pa.table({**GOOD, **columns})


def test_clean_table_is_accepted(tmp_path) -> None:
    root = _project(tmp_path, {"part1.parquet": _table(), "part2.parquet": _table()})
    report = _ingest(root, _cfg())
    assert (report.rows_in, report.rows_accepted, report.rows_quarantined) == (8, 8, 0)
    raw = pq.read_table(root / "raw")
    assert raw.schema.names == ["row_id", "features", "label"] and raw.num_rows == 8
    assert json.loads((root / "report.json").read_text())["rows_accepted"] == 8


@pytest.mark.parametrize(
    ("table", "cfg", "message"),
    [
        (
            pa.table({"a": [0.1], "label": [0]}),
            {"feature_columns": ["a", "b"]},
            r"missing column\(s\) 'b'",
        ),
        (pa.table({**GOOD, "a": ["x", "y", "z", "w"]}), {}, r"not numeric: a \(string\)"),
        (
            pa.table({**GOOD, "label": ["0", "1", "2", "1"]}),
            {},
            r"label column 'label' has type string",
        ),
        (
            pa.table([[0.1], [0.2], [0]], names=["a", "a", "label"]),
            {},
            r"column name\(s\) repeated: 'a'",
        ),
    ],
)
def test_column_problems_fail_naming_file_and_column(tmp_path, table, cfg, message) -> None:
    root = _project(tmp_path, {"t.parquet": table})
    for on_invalid in ("fail", "quarantine"):  # never quarantinable: the file is wrong
        with pytest.raises(DataError, match=r"incoming/t\.parquet: .*" + message):
            _ingest(root, _cfg(on_invalid=on_invalid, **cfg))
        _assert_untouched(root)


ROW_PROBLEMS = [
    ("null value", _table(a=[0.1, None, 0.3, 0.4]), {}),
    ("null value", _table(label=pa.array([0, 1, None, 1], pa.int64())), {}),
    ("NaN or Inf", _table(b=[1.0, float("nan"), float("inf"), 4.0]), {}),
    ("label out of range", _table(label=[0, 3, -1, 1]), {}),
    ("label out of range", _table(label=[0.0, 3.0, 1e300, 1.0]), {}),
    ("label not an integer", _table(label=[0.0, 1.5, 2.0, float("inf")]), {}),
    ("duplicate", pa.table({k: v + v[:1] for k, v in GOOD.items()}), {"duplicates": "reject"}),
    (
        "ragged tensor shape",
        pa.table({"x": [[1.0, 2.0], [1.0], [3.0, 4.0], [1.0, 2.0, 3.0]], "label": [0, 1, 2, 1]}),
        {"tensor_column": "x", "feature_shape": [2]},
    ),
]


@pytest.mark.parametrize(("reason", "table", "cfg"), ROW_PROBLEMS)
def test_bad_rows_fail_with_counts_examples_and_hint(tmp_path, reason, table, cfg) -> None:
    root = _project(tmp_path, {"t.parquet": table})
    with pytest.raises(DataError) as err:
        _ingest(root, _cfg(**cfg))
    text = str(err.value)
    assert f"{reason}: " in text and "incoming/t.parquet row " in text
    assert "data.on_invalid: quarantine" in text and "nothing was written" in text
    _assert_untouched(root)


@pytest.mark.parametrize(("reason", "table", "cfg"), ROW_PROBLEMS)
def test_bad_rows_are_quarantined_and_counts_add_up(tmp_path, reason, table, cfg) -> None:
    root = _project(tmp_path, {"t.parquet": table})
    report = _ingest(root, _cfg(on_invalid="quarantine", **cfg))
    quarantined = pq.read_table(root / "quarantine" / QUARANTINE_FILE)
    accepted = pq.read_table(root / "raw")
    assert report.rows_in == table.num_rows
    assert report.rows_in == accepted.num_rows + quarantined.num_rows
    assert report.rows_quarantined == quarantined.num_rows > 0
    assert set(quarantined.column("reason").to_pylist()) == {reason}
    # The original row is kept, as JSON, so it can be fixed and fed back.
    first = json.loads(quarantined.column("row")[0].as_py())
    assert "label" in first


def test_empty_input_fails(tmp_path) -> None:
    root = _project(tmp_path, {"t.parquet": _table().slice(0, 0)})
    with pytest.raises(DataError, match="has no rows"):
        _ingest(root, _cfg())
    _assert_untouched(root)


def test_truncated_parquet_fails_naming_the_file(tmp_path) -> None:
    import io

    buffer = io.BytesIO()
    pq.write_table(_table(), buffer)
    root = _project(tmp_path, {"good.parquet": _table(), "zbad.parquet": buffer.getvalue()[:-40]})
    with pytest.raises(DataError, match=r"incoming/zbad\.parquet: not a readable Parquet"):
        _ingest(root, _cfg())
    _assert_untouched(root)


def test_non_utf8_csv_fails_with_line_and_fix(tmp_path) -> None:
    content = b"a,b,label\n0.1,1.0,0\n" + b"0.2,2.0,1\n\xff\xfe,3.0,2\n"
    root = _project(tmp_path, {"t.csv": content})
    with pytest.raises(DataError, match=r"incoming/t\.csv: not UTF-8 .*line 4.*iconv"):
        _ingest(root, _cfg(source="csv"))
    _assert_untouched(root)


def test_csv_source_reads_a_folder(tmp_path) -> None:
    root = _project(tmp_path, {"1.csv": _table(), "2.csv": _table(label=[2, 2, 2, 2])})
    report = _ingest(root, _cfg(source="csv"))
    assert report.rows_accepted == 8


def test_missing_path_is_named(tmp_path) -> None:
    with pytest.raises(DataError, match=r"data\.path 'nowhere' does not exist"):
        ingest(
            DataConfig(source="csv", path="nowhere", num_classes=2),
            tmp_path,
            tmp_path / "raw",
            tmp_path / "q",
            tmp_path / "r.json",
        )


def test_tensor_column_keeps_its_shape(tmp_path) -> None:
    values = np.arange(4 * 6, dtype=np.float32).reshape(4, 6).tolist()
    root = _project(tmp_path, {"t.parquet": pa.table({"x": values, "label": [0, 1, 2, 0]})})
    _ingest(root, _cfg(tensor_column="x", feature_shape=[2, 3]))
    raw = pq.read_table(root / "raw")
    assert raw.schema.metadata[b"gradline.feature_shape"] == b"2,3"
    assert raw.column("features").type.list_size == 6


def test_synthetic_source_is_deterministic_and_streams(tmp_path) -> None:
    cfg = DataConfig(source="synthetic", synthetic_rows=70_000, synthetic_shape=[4, 4], seed=3)
    a = tmp_path / "a"
    b = tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _ingest(a, cfg)
    _ingest(b, cfg.model_copy(update={"read_batch_rows": 1000}))
    ta, tb = pq.read_table(a / "raw"), pq.read_table(b / "raw")
    assert ta.num_rows == 70_000 and ta.equals(tb)
    labels = ta.column("label").to_numpy()
    assert set(np.unique(labels)) == set(range(10))


# ---- labels follow the task -----------------------------------------------------------


def _pandas_labels_with_a_gap(root: Path, fmt: str) -> None:
    """What pandas writes for an integer label column with a missing value: floats."""
    import pandas as pd

    frame = pd.DataFrame({"a": [0.1, 0.2, 0.3, 0.4], "label": [0, 1, None, 2]})
    assert frame["label"].dtype == "float64"
    (root / "incoming").mkdir()
    if fmt == "csv":
        frame.to_csv(root / "incoming" / "t.csv", index=False)
    else:
        frame.to_parquet(root / "incoming" / "t.parquet", index=False)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_integer_labels_that_pandas_wrote_as_floats_are_classes(tmp_path, fmt) -> None:
    _pandas_labels_with_a_gap(tmp_path, fmt)
    report = _ingest(tmp_path, _cfg(source=fmt, on_invalid="quarantine"))
    assert (report.rows_accepted, report.rows_quarantined) == (3, 1)
    raw = pq.read_table(tmp_path / "raw")
    assert raw.schema.field("label").type == pa.int64()
    assert sorted(raw.column("label").to_pylist()) == [0, 1, 2]
    quarantined = pq.read_table(tmp_path / "quarantine" / QUARANTINE_FILE)
    assert quarantined.column("reason").to_pylist() == ["null value"]


def test_fractional_labels_of_a_classification_are_named_with_a_hint(tmp_path) -> None:
    root = _project(tmp_path, {"t.parquet": _table(label=[0.0, 1.5, 2.0, 1.0])})
    with pytest.raises(DataError) as err:
        _ingest(root, _cfg())
    text = str(err.value)
    assert "label not an integer: 1 rows, e.g. incoming/t.parquet row 1" in text
    assert "task.type: regression" in text
    _assert_untouched(root)


def test_regression_labels_are_floats_and_bad_ones_are_set_aside(tmp_path) -> None:
    labels = pa.array([1.5, None, float("nan"), 2.0**70], pa.float64())
    table = pa.table({"a": [0.1, 0.2, 0.3, 0.4], "label": labels})
    root = _project(
        tmp_path,
        {"t.parquet": table, "u.parquet": pa.table({"a": GOOD["a"], "label": [7, 8, 9, -1]})},
    )
    report = _ingest(root, _cfg(on_invalid="quarantine", num_classes=None), task="regression")
    reasons = pq.read_table(root / "quarantine" / QUARANTINE_FILE).column("reason").to_pylist()
    assert reasons == ["null value", "NaN or Inf"]
    raw = pq.read_table(root / "raw")
    assert raw.schema.field("label").type == pa.float32()
    assert report.rows_accepted == 6
    assert raw.column("label").to_pylist() == [1.5, 2.0**70, 7, 8, 9, -1]


def test_raw_schema_records_label_type_and_feature_names(tmp_path) -> None:
    root = _project(tmp_path, {"t.parquet": _table()})
    _ingest(root, _cfg())
    meta = pq.read_schema(next((root / "raw").glob("*.parquet"))).metadata
    assert meta[b"gradline.label_type"] == b"int64"
    assert json.loads(meta[b"gradline.feature_names"]) == ["a", "b"]
    assert meta[b"gradline.num_classes"] == b"3"


def test_classifying_a_table_needs_the_number_of_classes(tmp_path) -> None:
    root = _project(tmp_path, {"t.parquet": _table()})
    with pytest.raises(ConfigError, match=r"data\.num_classes is required"):
        _ingest(root, _cfg(num_classes=None))
    _assert_untouched(root)


def test_diabetes_is_a_bundled_regression_table(tmp_path) -> None:
    report = _ingest(tmp_path, DataConfig(source="diabetes"), task="regression")
    assert (report.rows_in, report.rows_accepted) == (442, 442)
    raw = pq.read_table(tmp_path / "raw")
    assert raw.schema.field("label").type == pa.float32()
    assert raw.column("features").type.list_size == 10
    assert raw.column("row_id").to_pylist() == list(range(442))
    meta = raw.schema.metadata
    assert json.loads(meta[b"gradline.feature_names"])[:3] == ["age", "sex", "bmi"]
    assert meta[b"gradline.feature_shape"] == b"10"


@pytest.mark.parametrize(
    ("source", "task"), [("digits", "regression"), ("diabetes", "classification")]
)
def test_a_builtin_data_set_fits_one_task(tmp_path, source, task) -> None:
    with pytest.raises(ConfigError, match=f"data.source {source} is a data set labelled with"):
        _ingest(tmp_path, DataConfig(source=source), task=task)
    assert not (tmp_path / "raw").exists()


def test_synthetic_regression_has_a_learnable_float_target(tmp_path) -> None:
    cfg = DataConfig(source="synthetic", synthetic_rows=2000, synthetic_shape=[4])
    _ingest(tmp_path, cfg, task="regression")
    raw = pq.read_table(tmp_path / "raw")
    x = raw.column("features").combine_chunks().flatten().to_numpy().reshape(-1, 4)
    y = raw.column("label").to_numpy()
    assert y.dtype == np.float32
    fitted = np.linalg.lstsq(np.c_[x, np.ones(len(x))], y, rcond=None)[1][0]
    assert fitted / len(y) < 0.05 * y.var()  # nearly linear: a model can learn it


# ---- columns: explicit features ignore the rest, inferred ones are compared ------------


def test_columns_not_listed_as_features_are_ignored_and_reported(tmp_path) -> None:
    table = pa.table({**GOOD, "note": ["x"] * 4, "c": [9.0] * 4})
    root = _project(tmp_path, {"t.parquet": table})
    report = _ingest(root, _cfg(feature_columns=["b", "a"]))
    assert report.rows_accepted == 4
    assert json.loads((root / "report.json").read_text())["ignored_columns"] == ["note", "c"]
    raw = pq.read_table(root / "raw")
    assert raw.column("features").to_pylist()[0] == [1.0, pytest.approx(0.1)]


def _next_version(root: Path, table: pa.Table) -> None:
    """Replace the input with a new version of the table (data/raw keeps the previous)."""
    for old in (root / "incoming").iterdir():
        old.unlink()
    pq.write_table(table, root / "incoming" / "t.parquet")


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "raw").iterdir())}


def test_a_new_column_between_data_versions_fails_with_how_to_accept_it(tmp_path) -> None:
    root = _project(tmp_path, {"t.parquet": _table()})
    shutil.rmtree(root / "raw")
    _ingest(root, _cfg())
    before = _snapshot(root)
    _next_version(root, pa.table({**GOOD, "c": [5.0, 6.0, 7.0, 8.0]}))
    with pytest.raises(DataError) as err:
        _ingest(root, _cfg(on_invalid="quarantine"))
    text = str(err.value)
    assert text.startswith("incoming/t.parquet: the features changed")
    assert "column(s) added: 'c'" in text
    assert 'data.feature_columns to ["a", "b", "c"]' in text and '["a", "b"]' in text
    assert _snapshot(root) == before
    # Accepted either way: the previous features (c is then ignored) or the new ones.
    report = _ingest(root, _cfg(feature_columns=["a", "b"]))
    assert report.ignored_columns == ["c"]
    assert (
        pq.read_schema(next((root / "raw").glob("*.parquet"))).metadata[b"gradline.feature_shape"]
        == b"2"
    )
    _ingest(root, _cfg(feature_columns=["a", "b", "c"]))
    assert pq.read_table(root / "raw").column("features").type.list_size == 3


@pytest.mark.parametrize(
    ("table", "task", "change"),
    [
        (pa.table({"a": GOOD["a"], "label": GOOD["label"]}), "classification", "removed: 'b'"),
        (pa.table({"b": GOOD["b"], **GOOD}), "classification", "columns reordered"),
        (_table(), "regression", "label type int64 -> float32"),
    ],
)
def test_other_schema_changes_are_reported(tmp_path, table, task, change) -> None:
    root = _project(tmp_path, {"t.parquet": _table()})
    shutil.rmtree(root / "raw")
    _ingest(root, _cfg())
    before = _snapshot(root)
    _next_version(root, table)
    with pytest.raises(DataError, match=change) as err:
        _ingest(root, _cfg(), task=task)
    assert "data.feature_columns to" in str(err.value)
    assert _snapshot(root) == before


def test_an_unchanged_schema_or_another_source_before_is_not_a_change(tmp_path) -> None:
    _ingest(tmp_path, DataConfig(source="digits", max_rows=50))  # a snapshot of images
    (tmp_path / "incoming").mkdir()
    pq.write_table(_table(), tmp_path / "incoming" / "t.parquet")
    _ingest(tmp_path, _cfg())
    _next_version(tmp_path, _table(label=[2, 2, 1, 0]))
    assert _ingest(tmp_path, _cfg()).rows_accepted == 4


# ---- CSV faults anywhere in the file are DataErrors that say where ---------------------

CSV_GOOD = b'a,b,label,note\n0.1,1.0,0,"x"\n0.2,2.0,1,"y"\n0.3,3.0,2,"z"\n'


@pytest.mark.parametrize(
    ("content", "where"),
    [
        (CSV_GOOD.replace(b"a,b", b"a\xff,b"), r"line 1 \(the header\)"),
        (CSV_GOOD.replace(b"0.1,", b"0.1\xe9,"), "line 2"),
        (CSV_GOOD.replace(b'2,"z"', b'2\xff,"z"'), "line 4"),
        (CSV_GOOD.replace(b'"y"', b'"\xc3(y"'), "line 3"),
        (CSV_GOOD[:-3] + "é".encode()[:1], "line 4"),
    ],
    ids=["header", "first row", "last row", "quoted field", "cut in a character"],
)
def test_non_utf8_bytes_anywhere_name_file_and_line(tmp_path, content, where) -> None:
    root = _project(tmp_path, {"t.csv": content})
    for on_invalid in ("fail", "quarantine"):
        with pytest.raises(DataError, match=r"incoming/t\.csv: not UTF-8 .*" + where):
            _ingest(root, _cfg(source="csv", on_invalid=on_invalid, feature_columns=["a", "b"]))
        _assert_untouched(root)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (CSV_GOOD[:-8], r"line 4 has 2 fields, the header has 4"),
        (CSV_GOOD + b"0.4,4.0\n", r"line 5 has 2 fields, the header has 4"),
        (b"", r"empty, or a header cut short"),
        (b"a,b,label,", r"empty, or a header cut short"),
    ],
    ids=["truncated", "short last row", "empty", "header cut"],
)
def test_malformed_csv_names_file_and_line(tmp_path, content, message) -> None:
    root = _project(tmp_path, {"t.csv": content})
    with pytest.raises(DataError, match=r"incoming/t\.csv: " + message):
        _ingest(root, _cfg(source="csv", feature_columns=["a", "b"]))
    _assert_untouched(root)


def _long_csv(rows: int, late: bytes) -> bytes:
    body = b"".join(b"%d,%d.5,%d\n" % (i, i, i % 3) for i in range(rows))
    return b"a,b,label\n" + body + late


def test_csv_types_are_not_decided_by_the_first_block_alone(tmp_path, monkeypatch) -> None:
    from training.data import sources

    monkeypatch.setattr(sources, "_CSV_BLOCK_BYTES", 256)  # many blocks from a small file
    # Whole numbers early, a decimal feature and a missing label (pandas: 1.0) far below.
    content = _long_csv(200, b"0.5,1.5,1.0\n7,1,\n")
    root = _project(tmp_path, {"t.csv": content})
    report = _ingest(root, _cfg(source="csv", on_invalid="quarantine"))
    assert (report.rows_accepted, report.rows_quarantined) == (201, 1)


def test_a_word_in_a_number_column_far_down_names_line_and_column(tmp_path, monkeypatch) -> None:
    from training.data import sources

    monkeypatch.setattr(sources, "_CSV_BLOCK_BYTES", 256)
    root = _project(tmp_path, {"t.csv": _long_csv(200, b"0.5,oops,1\n")})
    with pytest.raises(DataError, match=r"incoming/t\.csv: line 202, column 'b': 'oops' is not"):
        _ingest(root, _cfg(source="csv"))
    _assert_untouched(root)
