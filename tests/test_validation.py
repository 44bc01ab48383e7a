"""Every class of bad input is rejected with a clear message (or quarantined), the counts
add up, and nothing partial is left behind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.config import DataConfig
from training.data.ingest import QUARANTINE_FILE, ingest
from training.errors import DataError

GOOD = {"a": [0.1, 0.2, 0.3, 0.4], "b": [1.0, 2.0, 3.0, 4.0], "label": [0, 1, 2, 1]}


def _cfg(source: str = "parquet", **kw) -> DataConfig:
    return DataConfig(source=source, path="incoming", num_classes=3, **kw)


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


def _ingest(root: Path, cfg: DataConfig):
    return ingest(cfg, root, root / "raw", root / "quarantine", root / "report.json")


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
        (
            pa.table({**GOOD, "note": ["x"] * 4}),
            {"feature_columns": ["a", "b"]},
            r"unexpected column\(s\) 'note'",
        ),
        (pa.table({**GOOD, "a": ["x", "y", "z", "w"]}), {}, r"not numeric: a \(string\)"),
        (
            pa.table({**GOOD, "label": [0.0, 1.0, 2.0, 1.0]}),
            {},
            r"label column 'label' has type double",
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
