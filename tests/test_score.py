"""`gradline score`: a registered version's predictions on new rows.

End to end (the real CLI, DVC, MLflow's SQLite store, Prefect): one tiny model trained
and registered by `gradline run` in a fresh copy of the project, then new digits scored
with a bad row quarantined, predictions equal to `mlflow.pyfunc`'s on the same rows, the
output DVC-tracked and pushed, the MLflow run linked to the version; fail mode writing
nothing; the Prefect flow. In-process, against a real MLflow store: named table columns
read in small batches, prompts for a language model.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from training.config import Config, ModelConfig
from training.data.score_input import FILE_KEY, ROW_KEY
from training.data.spec import DataSpec
from training.data.tokenizer import ByteTokenizer
from training.errors import DataError
from training.mlops.registry import register_version
from training.mlops.scoring import ScoreRequest, score_new_rows
from training.mlops.serving import log_pyfunc_model
from training.mlops.tracking import client, ensure_experiment
from training.models.folder import ModelSpec, save_model_dir
from training.models.registry import build_model

from .conftest import _gradline, _run, copy_project

MODEL = "gradline-digits"
PIXELS = [f"f{i}" for i in range(64)]
TINY = ["data.max_rows=400", "train.epochs=10", "runtime.procs_per_node=1", "model.hidden=32"]


def _store(root: Path) -> str:
    return f"sqlite:///{root / 'mlflow' / 'mlflow.db'}"


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _digits(count: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    rows = slice(start, start + count)
    return (bunch.data[rows] / 16.0).astype(np.float32), bunch.target[rows]


def _pixels_table(ids: list[str], pixels: np.ndarray, labels: np.ndarray) -> pa.Table:
    columns = {name: pa.array(pixels[:, i]) for i, name in enumerate(PIXELS)}
    return pa.table({"id": ids, **columns, "label": labels})


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project whose `gradline run` registered a tiny digits model as version 1, and two
    files of new rows under data/new: 50 digits with ids, one row with a NaN pixel and
    one with a missing pixel."""
    root = copy_project(tmp_path_factory.mktemp("score") / "gradline")
    proc = _gradline(root, "run", *(arg for key in TINY for arg in ("--set", key)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mlflow_client = client(_store(root))
    # `gradline score` scores with the champion by default; whether this tiny model beat
    # its baseline is not what these tests are about, so it is made champion here.
    mlflow_client.set_registered_model_alias(MODEL, "champion", "1")
    pixels, labels = _digits(50, start=1000)
    pixels[3, 5] = np.nan  # part-0 row 3: "NaN or Inf"
    first = _pixels_table([f"a-{i}" for i in range(30)], pixels[:30], labels[:30])
    second = _pixels_table([f"b-{i}" for i in range(20)], pixels[30:], labels[30:])
    column = second.column("f0").to_pylist()
    column[7] = None  # part-1 row 7: "null value"
    second = second.set_column(second.schema.get_field_index("f0"), "f0", pa.array(column))
    (root / "data" / "new").mkdir(parents=True)
    pq.write_table(first, root / "data" / "new" / "part-0.parquet")
    pq.write_table(second, root / "data" / "new" / "part-1.parquet")
    return root


def _score_runs(root: Path, output: str | None = None) -> list:
    """The scoring runs of version 1 (that wrote `output`), in its training run's
    experiment."""
    mlflow_client = client(_store(root))
    training_run = mlflow_client.get_model_version(MODEL, "1").run_id
    experiment = mlflow_client.get_run(training_run).info.experiment_id
    query = "tags.`gradline.score.model_name` = 'gradline-digits'"
    if output:
        query += f" and tags.`gradline.score.output` = '{output}'"
    return mlflow_client.search_runs([experiment], query)


def _pyfunc(root: Path, version: str = "1"):
    import mlflow

    mlflow.set_tracking_uri(_store(root))
    mlflow.set_registry_uri(_store(root))
    return mlflow.pyfunc.load_model(f"models:/{MODEL}/{version}")


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_score_quarantines_bad_rows_and_predicts_as_the_registered_model(project: Path) -> None:
    proc = _gradline(project, "score", "--on-bad-rows", "quarantine")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "48 scored, 2 quarantined" in proc.stdout

    output = project / "data" / "scores" / "predictions.parquet"
    table = pq.read_table(output)
    assert table.column_names == ["id", "prediction"] + [f"prob_{k}" for k in range(10)]
    assert table.num_rows == 48
    quarantined = pq.read_table(output.with_name("predictions.quarantine.parquet")).to_pylist()
    assert [(q["origin"], q["source_row"], q["reason"]) for q in quarantined] == [
        ("data/new/part-0.parquet", 3, "NaN or Inf"),
        ("data/new/part-1.parquet", 7, "null value"),
    ]
    assert json.loads(quarantined[1]["row"])["id"] == "b-7"  # the row as the input had it

    # The registered model, loaded as any MLflow user loads it, on the same good rows.
    new_rows = pd.concat(
        pq.read_table(project / "data" / "new" / f"part-{i}.parquet").to_pandas() for i in (0, 1)
    )
    scored = table.to_pandas()
    assert sorted(set(new_rows["id"]) - set(scored["id"])) == ["a-3", "b-7"]
    good = new_rows.set_index("id").loc[scored["id"], PIXELS].to_numpy(np.float32)
    expected = np.asarray(_pyfunc(project).predict(good.reshape(-1, 8, 8)))
    assert np.array_equal(scored["prediction"].to_numpy(), expected)
    probabilities = scored[[f"prob_{k}" for k in range(10)]].to_numpy()
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    assert np.array_equal(probabilities.argmax(axis=1), expected)

    # DVC tracks both files and pushed them to the project's remote.
    tracked = {}
    for path in (output, output.with_name("predictions.quarantine.parquet")):
        outs = yaml.safe_load(path.with_name(path.name + ".dvc").read_text())["outs"]
        tracked[path] = outs[0]["md5"]
        assert tracked[path] == _md5(path)
        remote = project / ".dvcstore" / "files" / "md5" / tracked[path][:2] / tracked[path][2:]
        assert remote.is_file(), remote
    status = _run(project, sys.executable, "-m", "dvc", "status", f"{output}.dvc")
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout

    # The MLflow run links the predictions to the model version.
    (run,) = _score_runs(project, "data/scores/predictions.parquet")
    version = client(_store(project)).get_model_version(MODEL, "1")
    tags = run.data.tags
    assert (tags["gradline.score.model_version"], tags["gradline.score.model_alias"]) == (
        "1",
        "champion",
    )
    assert tags["gradline.score.model_run_id"] == version.run_id
    assert (
        tags["gradline.score.input_md5"]
        == pq.ParquetFile(output).metadata.metadata[b"gradline.score.input_md5"].decode()
    )
    assert tags["gradline.score.output_md5"] == tracked[output]
    assert (tags["gradline.score.rows_scored"], tags["gradline.score.rows_quarantined"]) == (
        "48",
        "2",
    )
    assert run.data.metrics["rows_scored"] == 48 and run.info.status == "FINISHED"
    (dataset,) = run.inputs.dataset_inputs
    assert dataset.dataset.digest == tags["gradline.score.input_md5"]
    artifacts = {a.path for a in client(_store(project)).list_artifacts(run.info.run_id, "score")}
    assert "score/predictions.parquet" in artifacts and "score/summary.json" in artifacts


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_fail_mode_names_the_bad_rows_and_writes_nothing(project: Path) -> None:
    runs_before = len(_score_runs(project))
    proc = _gradline(project, "score", "--model", f"{MODEL}/1", "--output", "data/failed/p.parquet")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "invalid rows in 'data/new', nothing was written" in proc.stderr
    assert "NaN or Inf: 1 rows, e.g. data/new/part-0.parquet row 3" in proc.stderr
    assert "null value: 1 rows, e.g. data/new/part-1.parquet row 7" in proc.stderr
    assert "--on-bad-rows quarantine" in proc.stderr
    assert not (project / "data" / "failed").exists()
    assert len(_score_runs(project)) == runs_before


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_csv_without_ids_is_keyed_by_file_and_row(project: Path) -> None:
    pixels, _ = _digits(12, start=1200)
    frame = pd.DataFrame(pixels, columns=PIXELS)
    csv = project / "data" / "csv-in" / "today.csv"
    csv.parent.mkdir(parents=True)
    frame.to_csv(csv, index=False)
    proc = _gradline(
        project, "score", "--input", "data/csv-in/today.csv", "--output", "data/csv-out/p.parquet"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = pq.read_table(project / "data" / "csv-out" / "p.parquet").to_pandas()
    assert list(table.columns[:3]) == [FILE_KEY, ROW_KEY, "prediction"]
    assert table[ROW_KEY].tolist() == list(range(12))
    assert set(table[FILE_KEY]) == {"data/csv-in/today.csv"}
    expected = np.asarray(_pyfunc(project).predict(pixels.reshape(-1, 8, 8)))
    assert np.array_equal(table["prediction"].to_numpy(), expected)
    (run,) = _score_runs(project, "data/csv-out/p.parquet")
    assert run.data.tags["gradline.score.input_md5"] == _md5(csv)  # one file: its own md5
    assert run.data.tags["gradline.score.rows_quarantined"] == "0"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_prefect_flow_scores_and_records_its_flow_run(project: Path) -> None:
    code = (
        "from flows.score import score; "
        "print(score(input='data/new', output='data/flow/p.parquet', on_bad_rows='quarantine'))"
    )
    proc = _run(project, sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "48 scored, 2 quarantined" in proc.stdout
    assert (project / "data" / "flow" / "p.parquet.dvc").is_file()
    (run,) = _score_runs(project, "data/flow/p.parquet")
    assert run.data.tags.get("gradline.prefect_flow_run_id")


# ---- in-process, against a real MLflow store ---------------------------------------------


def _registered(tmp_path: Path, name: str, task: str, data: DataSpec, cfg: ModelConfig) -> str:
    """A (randomly initialised) model logged from code and registered as `name` v1, the
    champion."""
    import torch

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = ensure_experiment(uri, "score", (tmp_path / "artifacts").as_uri())
    mlflow_client = client(uri)
    run_id = mlflow_client.create_run(experiment).info.run_id
    torch.manual_seed(0)
    tokenizer = None
    if data.kind == "tokens":
        tokenizer = tmp_path / "tokenizer.json"
        ByteTokenizer().save(tokenizer)
    folder = tmp_path / "model"
    spec = ModelSpec.create(task, cfg, data)
    save_model_dir(build_model(cfg, task, data), spec, folder, tokenizer)
    generation = Config().generation()
    model_uri = log_pyfunc_model(uri, run_id, folder, generation)
    register_version(uri, name, model_uri)
    mlflow_client.set_registered_model_alias(name, "champion", "1")
    return uri


def _request(cfg: Config, **changes) -> ScoreRequest:
    score = cfg.score.model_copy(update=changes)
    return ScoreRequest.from_config(cfg.model_copy(update={"score": score}))


def test_named_columns_stream_in_small_batches_and_match_the_pyfunc_model(tmp_path) -> None:
    import mlflow

    names = ("age", "height", "weight", "pulse")
    data = DataSpec(
        "table", (4,), 3, feature_mean=(40.0, 170, 70, 60), feature_std=(10.0, 10, 10, 5),
        feature_names=names,
    )  # fmt: skip
    uri = _registered(tmp_path, "vitals", "classification", data, ModelConfig(name="mlp", hidden=8))
    rng = np.random.default_rng(0)
    folder = tmp_path / "new"
    folder.mkdir()
    frames = []
    for part in range(3):  # columns in another order than the model's, and one extra
        frame = pd.DataFrame(rng.normal(60, 20, (9, 4)), columns=names)[list(reversed(names))]
        frame.insert(0, "patient", [f"p{part}-{i}" for i in range(9)])
        frame["note"] = "x"
        frames.append(frame)
        frame.to_csv(folder / f"day-{part}.csv", index=False)
    frames[1].loc[4, "pulse"] = np.inf
    frames[1].to_csv(folder / "day-1.csv", index=False)
    cfg = Config.model_validate({"registry": {"model_name": "vitals"}})
    request = _request(cfg, input="new", output="out/p.parquet", key_column="patient",
                       batch_rows=4, on_bad_rows="quarantine")  # fmt: skip
    outcome = score_new_rows(tmp_path, cfg, request, uri)
    assert (outcome.rows_scored, outcome.rows_quarantined) == (26, 1)
    assert outcome.report["ignored_columns"] == ["note"]
    parquet = pq.ParquetFile(tmp_path / "out" / "p.parquet")
    # Written batch by batch as read: no row group holds more than one batch.
    sizes = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
    assert max(sizes) <= 4 and sum(sizes) == 26
    scored = parquet.read().to_pandas()
    rows = pd.concat(frames).set_index("patient").loc[scored["patient"]]
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    expected = mlflow.pyfunc.load_model("models:/vitals/1").predict(rows[list(names)])
    assert np.array_equal(scored["prediction"].to_numpy(), np.asarray(expected))


def test_a_missing_feature_column_names_what_the_model_takes(tmp_path) -> None:
    data = DataSpec("table", (2,), 2, feature_mean=(0.0, 0), feature_std=(1.0, 1),
                    feature_names=("a", "b"))  # fmt: skip
    uri = _registered(tmp_path, "ab", "classification", data, ModelConfig(name="mlp", hidden=4))
    (tmp_path / "new").mkdir()
    pq.write_table(pa.table({"a": [1.0], "c": [2.0]}), tmp_path / "new" / "x.parquet")
    cfg = Config.model_validate({"registry": {"model_name": "ab"}})
    with pytest.raises(DataError, match=r"missing column.*'b'.*model's feature columns a, b"):
        score_new_rows(tmp_path, cfg, _request(cfg, input="new", output="o.parquet"), uri)
    assert not (tmp_path / "o.parquet").exists()


def test_a_language_model_continues_prompts_as_the_pyfunc_model_does(tmp_path) -> None:
    import mlflow

    data = DataSpec("tokens", vocab_size=257)
    cfg_model = ModelConfig(name="gpt", layers=1, heads=2, width=16, context=16)
    uri = _registered(tmp_path, "lm", "language_modeling", data, cfg_model)
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "a.txt").write_text("def main(")
    (folder / "b.txt").write_bytes(b"\xff\xfe not utf-8")  # quarantined as ingest would
    (folder / "c.txt").write_text("import ")
    cfg = Config.model_validate({"registry": {"model_name": "lm"}})
    request = _request(cfg, input="prompts", output="o.parquet", on_bad_rows="quarantine",
                       max_new_tokens=8)  # fmt: skip
    outcome = score_new_rows(tmp_path, cfg, request, uri)
    assert (outcome.rows_scored, outcome.rows_quarantined) == (2, 1)
    assert outcome.report["invalid_by_reason"] == {"not UTF-8": 1}
    scored = pq.read_table(tmp_path / "o.parquet").to_pandas()
    assert scored[FILE_KEY].tolist() == ["prompts/a.txt", "prompts/c.txt"]
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    expected = mlflow.pyfunc.load_model("models:/lm/1").predict(
        pd.DataFrame({"prompt": ["def main(", "import "]}), params={"max_new_tokens": 8}
    )
    assert scored["prediction"].tolist() == expected["text"].tolist()
