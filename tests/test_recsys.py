"""Recommendation: the dlrm model, the click task, the clicks source, categorical columns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from training.config import ModelConfig
from training.data.spec import DataSpec
from training.errors import ConfigError
from training.models.dlrm import DLRM
from training.models.embedding_tables import EmbeddingTables
from training.models.registry import build_model, check_buildable
from training.models.standardize import Standardized

from . import test_models

tracking = test_models.tracking  # the MLflow store fixture, for the logged model's test

# Three id columns (user, item, category) then two dense features.
CLICK_DATA = DataSpec(
    "table",
    (5,),
    2,
    feature_mean=(0.0, 0.0, 0.0, 12.0, 3.0),
    feature_std=(1.0, 1.0, 1.0, 6.0, 2.0),
    feature_names=("user_id", "item_id", "category", "hour", "position"),
    categorical_columns=("user_id", "item_id", "category"),
    categorical_distinct=(90, 40, 5),
    categorical_bound=(100, 50, 5),
)


def dlrm_cfg(**options) -> ModelConfig:
    return ModelConfig(name="dlrm", embedding_dim=4, bottom=[8], top=[8], **options)


def rows(n: int = 6, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, [100, 50, 5], size=(n, 3))
    dense = rng.normal([12.0, 3.0], [6.0, 2.0], size=(n, 2))
    return torch.from_numpy(np.hstack([ids, dense]).astype(np.float32))


# --- the dlrm model --------------------------------------------------------------------


def test_dlrm_shapes_and_one_embedding_module():
    model = DLRM([100, 50, 5], 2, 1, embedding_dim=4, bottom=[8], top=[16, 8])
    out = model(rows())
    assert out.shape == (6, 1)
    # Every table lives in one EmbeddingTables submodule: the seam the sharding swaps.
    tables = [m for m in model.modules() if isinstance(m, EmbeddingTables)]
    assert len(tables) == 1 and tables[0].rows == (100, 50, 5)
    assert not [
        m
        for m in model.modules()
        if type(m) is torch.nn.Embedding and m not in set(tables[0].tables)
    ]
    # 4 vectors (dense + 3 ids): 6 pairwise dots + the bottom's 4 values into the top MLP.
    assert model.top[0].in_features == 6 + 4


def test_dlrm_without_dense_features_interacts_ids_only():
    model = DLRM([10, 7], 0, 1, embedding_dim=3, bottom=[4], top=[4])
    assert model.bottom is None and model.top[0].in_features == 1
    assert model(torch.tensor([[3.0, 5.0], [9.0, 6.0]])).shape == (2, 1)


def test_dlrm_output_depends_on_ids_and_gradients_reach_the_tables():
    # Seeded: with some initial weights every ReLU of the top MLP is off for a row, and
    # that row's ids get no gradient at all (the suite's earlier tests in the same process
    # decided the weights, and one order of them failed here).
    torch.manual_seed(0)
    model = DLRM([100, 50, 5], 2, 1, embedding_dim=4, bottom=[8], top=[8])
    x = rows()
    y = x.clone()
    y[:, 1] = (y[:, 1] + 1) % 50  # another item for every row
    assert not torch.allclose(model(x), model(y))
    model(x).sum().backward()
    item_grad = model.embeddings.tables[1].weight.grad
    touched = set(x[:, 1].long().tolist())
    assert {int(i) for i in item_grad.abs().sum(1).nonzero().flatten()} == touched


def test_build_dlrm_sizes_tables_from_data_and_leaves_ids_unscaled():
    model = build_model(dlrm_cfg(), "classification", CLICK_DATA)
    assert isinstance(model, Standardized)
    # Dense ids: a row each (bound <= 4x distinct).
    assert model.model.embeddings.rows == (100, 50, 5)
    assert model.feature_mean.tolist()[:3] == [0.0, 0.0, 0.0]
    assert model.feature_std.tolist()[:3] == [1.0, 1.0, 1.0]
    check_buildable(dlrm_cfg(), "classification", CLICK_DATA)


def test_table_rows_hash_into_fewer_rows():
    assert build_model(
        dlrm_cfg(table_rows=20), "classification", CLICK_DATA
    ).model.embeddings.rows == (20, 20, 5)
    sized = build_model(dlrm_cfg(table_rows=[30, 10, 2]), "classification", CLICK_DATA)
    assert sized.model.embeddings.rows == (30, 10, 2)


def test_hashed_ids_get_four_rows_per_distinct_value():
    hashed = DataSpec(
        "table", (2,), 2, categorical_columns=("a", "b"),
        categorical_distinct=(1000, 3), categorical_bound=(16_000_000, 15_000_000),
    )  # fmt: skip
    assert hashed.default_table_rows() == (4000, 12)


def test_wrong_table_rows_length_is_a_config_error():
    with pytest.raises(ConfigError, match=r"table_rows lists 2 sizes.*3 id columns"):
        build_model(dlrm_cfg(table_rows=[30, 10]), "classification", CLICK_DATA)


def test_dlrm_on_data_without_ids_is_a_config_error():
    plain = DataSpec("table", (5,), 2)
    with pytest.raises(ConfigError, match=r"data\.categorical_columns"):
        build_model(dlrm_cfg(), "classification", plain)


def test_dlrm_options_are_validated():
    with pytest.raises(ValueError, match="table_rows"):
        ModelConfig(name="dlrm", table_rows=[10, 0])
    with pytest.raises(ValueError, match="not a key of model dlrm"):
        ModelConfig(name="dlrm", hidden=3)


def test_data_spec_round_trips_categorical_fields():
    assert DataSpec.from_dict(CLICK_DATA.to_dict()) == CLICK_DATA
    example = CLICK_DATA.example(8)
    ids = example[:, :3]
    assert (ids == np.round(ids)).all() and (ids >= 0).all() and (ids < [100, 50, 5]).all()


# --- the clicks source -----------------------------------------------------------------


def clicks_rows(**overrides) -> tuple[np.ndarray, np.ndarray]:
    from training.data.options import DataConfig
    from training.data.sources import FEATURES, LABEL, open_chunks

    cfg = DataConfig(source="clicks", **{"clicks_rows": 70_000, **overrides})
    features, labels = [], []
    for chunk in open_chunks(cfg, Path("."), "classes"):
        flat = chunk.table.column(FEATURES).combine_chunks().flatten().to_numpy()
        features.append(flat.reshape(chunk.table.num_rows, -1))
        labels.append(chunk.table.column(LABEL).to_numpy())
    return np.concatenate(features), np.concatenate(labels)


def test_clicks_are_deterministic_by_seed_and_chunked():
    x, y = clicks_rows()
    assert x.shape == (70_000, 6) and y.shape == (70_000,)
    again_x, again_y = clicks_rows()
    assert np.array_equal(x, again_x) and np.array_equal(y, again_y)
    other_x, _ = clicks_rows(seed=1)
    assert not np.array_equal(x[:, 0], other_x[:, 0])
    # Chunk i depends on (seed, i) only: fewer rows are a prefix of more rows.
    fewer_x, fewer_y = clicks_rows(clicks_rows=1000)
    assert np.array_equal(fewer_x, x[:1000]) and np.array_equal(fewer_y, y[:1000])


def test_clicks_ids_follow_a_power_law_and_clicks_are_rare():
    x, y = clicks_rows(clicks_users=5000, clicks_items=2000)
    ids = x[:, :3]
    assert (ids == np.round(ids)).all() and ids.min() >= 0
    assert x[:, 0].max() < 5000 and x[:, 1].max() < 2000 and x[:, 2].max() < 80
    for column, exponent in ((0, 1.05), (1, 1.1)):
        counts = np.sort(np.bincount(x[:, column].astype(np.int64)))[::-1]
        # Zipf: the most frequent id about 2**s times the 2nd, 10**s times the 10th.
        slope = np.polyfit(np.log(np.arange(1, 101)), np.log(counts[:100]), 1)[0]
        assert -exponent - 0.25 < slope < -exponent + 0.25
        assert counts[:10].sum() > 0.1 * len(x)  # a few heavy hitters ...
        assert (counts <= 3).sum() > 0.1 * len(counts)  # ... and a long tail
    assert 0.04 < y.mean() < 0.2
    # A category is a property of its item.
    pairs = np.unique(x[:, 1:3], axis=0)
    assert len(pairs) == len(np.unique(x[:, 1]))


def test_clicks_follow_the_planted_model():
    from training.data.clicks import ClickWorld

    x, y = clicks_rows()
    world = ClickWorld.make(0, 5000, 2000)
    ids = x[:, :2].astype(np.int64)
    logit = world.click_logit(ids[:, 0], ids[:, 1], x[:, 3], x[:, 4])
    from sklearn.metrics import roc_auc_score

    # The planted probabilities rank the clicks far better than chance.
    assert roc_auc_score(y, logit) > 0.78
    predicted = 1 / (1 + np.exp(-logit))
    assert abs(predicted.mean() - y.mean()) < 0.005


def shard_clicks(root: Path, **overrides) -> dict:
    from training.data.ingest import ingest
    from training.data.options import DataConfig, ShardConfig
    from training.data.shards import write_shards

    cfg = DataConfig(source="clicks", **{"clicks_rows": 20_000, **overrides})
    ingest(cfg, root, root / "raw", root / "quarantine", root / "report.json", labels="classes")
    return write_shards(ShardConfig(), root / "raw", root / "shards", "v1")


def test_shards_record_id_columns_with_distinct_counts(tmp_path):
    manifest = shard_clicks(tmp_path, clicks_users=300, clicks_items=100)
    spec = DataSpec.from_manifest(manifest)
    assert spec.categorical_columns == ("user_id", "item_id", "category")
    assert spec.feature_names == ("user_id", "item_id", "category", "hour", "position", "price")
    assert spec.num_classes == 2 and spec.num_dense == 3
    x, _ = clicks_rows(clicks_rows=20_000, clicks_users=300, clicks_items=100)
    distinct = tuple(len(np.unique(x[:, c])) for c in range(3))
    assert spec.categorical_distinct == distinct
    assert spec.categorical_bound == tuple(int(x[:, c].max()) + 1 for c in range(3))
    assert spec.default_table_rows() == spec.categorical_bound  # dense ids: a row each


# --- the click task ----------------------------------------------------------------------


class ArrayReader:
    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    @property
    def num_rows(self) -> int:
        return len(self.y)

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.x[indices], self.y[indices]


def click_objective(data: DataSpec = CLICK_DATA):
    from training.objectives import objective_for

    return objective_for("click", data)


def scored_logits(n: int = 5000, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.15).astype(np.int64)
    logits = rng.normal(-1.8, 1.0, n) + 1.2 * y
    return torch.from_numpy(logits).float().reshape(-1, 1), torch.from_numpy(y)


def test_click_metrics_match_scikit_learn():
    from sklearn.metrics import log_loss, roc_auc_score

    objective = click_objective()
    output, target = scored_logits()
    metrics = objective.metrics(objective.batch_stats(output, target), "test")
    p = torch.sigmoid(output[:, 0]).double().numpy()
    y = target.numpy()
    # Histograms of 2048 bins: pairs within one bin count one half.
    assert metrics["test_auc"] == pytest.approx(roc_auc_score(y, p), abs=2e-4)
    assert metrics["test_log_loss"] == pytest.approx(log_loss(y, p), rel=1e-5)
    assert metrics["test_loss"] == metrics["test_log_loss"]
    rate = y.mean()
    entropy = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    assert metrics["test_normalized_entropy"] == pytest.approx(log_loss(y, p) / entropy, rel=1e-5)
    # Predicting the base rate everywhere: AUC 1/2, normalized entropy 1.
    flat = torch.full_like(output, float(np.log(rate / (1 - rate))))
    base = objective.metrics(objective.batch_stats(flat, target), "test")
    assert base["test_auc"] == pytest.approx(0.5)
    assert base["test_normalized_entropy"] == pytest.approx(1.0, abs=1e-6)


def test_auc_error_bound_covers_the_binning_error():
    from sklearn.metrics import roc_auc_score

    from training.objectives.click import HISTOGRAM_BINS, auc_from_histograms

    output, target = scored_logits(20_000, seed=9)
    p = torch.sigmoid(output[:, 0]).numpy()
    bins = np.minimum((p * HISTOGRAM_BINS).astype(np.int64), HISTOGRAM_BINS - 1)
    y = target.numpy()
    auc, bound = auc_from_histograms(
        np.bincount(bins[y == 1], minlength=HISTOGRAM_BINS),
        np.bincount(bins[y == 0], minlength=HISTOGRAM_BINS),
    )
    assert abs(auc - roc_auc_score(y, p)) <= bound < 1e-3


def test_click_statistics_are_additive_and_rows_sum_to_the_batch():
    objective = click_objective()
    output, target = scored_logits(301)
    whole = objective.batch_stats(output, target)
    halves = objective.batch_stats(output[:100], target[:100]) + objective.batch_stats(
        output[100:], target[100:]
    )
    assert torch.allclose(whole, halves)
    assert torch.allclose(objective.row_stats(output, target).to_dense().sum(0), whole)
    assert set(objective.metrics(whole, "val")) == {
        f"val_{name}" for name in objective.metric_names
    }


def test_click_gate_and_card():
    objective = click_objective()
    assert (objective.gate_metric, objective.higher_is_better) == ("test_auc", True)
    assert objective.card.validation_metric("") == ("val_auc", True)
    assert objective.card.validation_metric("log_loss") == ("val_log_loss", False)


def test_click_task_rejects_more_than_two_classes():
    from training.errors import DataError

    with pytest.raises(DataError, match=r"data\.num_classes: 2"):
        click_objective(DataSpec("table", (5,), 3))


def test_ranking_metrics_by_hand():
    from training.objectives.click import ranking_metrics

    users = np.array([1, 1, 1, 1, 2, 2, 2, 3, 3])
    clicked = np.array([1, 0, 1, 0, 0, 1, 0, 1, 1])
    scores = np.array([0.9, 0.8, 0.1, 0.2, 0.5, 0.4, 0.3, 0.2, 0.1])
    got = ranking_metrics(users, clicked, scores, 2, "test")
    # user 1: top 2 = rows (0.9 click, 0.8 no): recall 1/2, DCG 1, IDCG 1 + 1/log2(3)
    # user 2: top 2 = (0.5 no, 0.4 click): recall 1/1, DCG 1/log2(3), IDCG 1
    # user 3 has no non-click: not ranked.
    d = 1 / np.log2(3)
    assert got["test_recall_at_2"] == pytest.approx((0.5 + 1.0) / 2)
    assert got["test_ndcg_at_2"] == pytest.approx((1 / (1 + d) + d) / 2)


def test_click_baselines_popularity_and_hashed_lr():
    # Two id columns (user, item), one dense feature. Items 0..9 click at 5 %..50 %; the
    # dense feature adds to the log-odds: LR learns both, popularity only the items.
    rng = np.random.default_rng(0)
    n = 20_000
    user, item = rng.integers(0, 50, n), rng.integers(0, 10, n)
    dense = rng.normal(size=n)
    logit = np.log(0.05 + 0.05 * item) - np.log(0.95 - 0.05 * item) + 1.5 * dense
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    x = np.stack([user, item, dense], axis=1).astype(np.float32)
    data = DataSpec(
        "table", (3,), 2, feature_names=("user_id", "item_id", "x"),
        categorical_columns=("user_id", "item_id"), categorical_distinct=(50, 10),
        categorical_bound=(50, 10),
    )  # fmt: skip
    objective = click_objective(data)
    train, test = ArrayReader(x[:15000], y[:15000]), ArrayReader(x[15000:], y[15000:])
    got = objective.baseline(train, test, 50_000)
    assert got["popularity_baseline_test_auc"] > 0.6
    assert got["lr_baseline_test_auc"] > got["popularity_baseline_test_auc"] + 0.1
    # The main baseline is the stronger, with the ranking metrics of the user column.
    assert got["baseline_test_auc"] == got["lr_baseline_test_auc"]
    assert 0 < got["baseline_test_ndcg_at_10"] <= 1
    assert 0 < got["popularity_baseline_test_recall_at_10"] <= 1


# --- the example, end to end -------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_clicks_dlrm_example_beats_both_baselines_and_serves_raw_ids(tmp_path):
    import pandas as pd

    from training.data.clicks import COLUMNS

    from .conftest import _client, _gradline, assert_card_reports
    from .test_e2e import _example_project, _pyfunc

    project, run_id = _example_project(
        tmp_path,
        "clicks-dlrm",
        "data.clicks_rows=100000",
        "train.epochs=1",
        "evaluate.bootstrap_replicates=0",  # intervals are another test's subject
    )
    metrics = _client(project).get_run(run_id).data.metrics
    for name in ("auc", "log_loss", "normalized_entropy", "recall_at_10", "ndcg_at_10"):
        assert f"test_{name}" in metrics and f"baseline_test_{name}" in metrics
    stronger = max(metrics["lr_baseline_test_auc"], metrics["popularity_baseline_test_auc"])
    assert metrics["baseline_test_auc"] == stronger
    assert metrics["test_auc"] > stronger + 0.01
    assert metrics["test_normalized_entropy"] < 1.0
    assert_card_reports(project, run_id, "click", "test_auc", higher=True)
    # The registered model scores rows of ids and dense features by column name.
    x, _ = clicks_rows(clicks_rows=50, clicks_users=2000, clicks_items=1000)
    rows = pd.DataFrame(x.astype(np.float64), columns=list(COLUMNS))
    scores = np.asarray(_pyfunc(project, "gradline-clicks-dlrm").predict(rows)).ravel()
    assert scores.shape == (50,) and ((scores > 0) & (scores < 1)).all()
    assert 0.02 < scores.mean() < 0.3
    # `gradline score` on the same rows: the same probabilities, and a 0/1 decision.
    (project / "data" / "new").mkdir(parents=True)
    rows.assign(id=[f"r{i}" for i in range(50)]).to_parquet(project / "data" / "new" / "a.parquet")
    proc = _gradline(project, "score")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = pd.read_parquet(project / "data" / "scores" / "predictions.parquet")
    assert list(table.columns) == ["id", "prediction", "clicked"] and len(table) == 50
    np.testing.assert_allclose(table["prediction"].to_numpy(), scores, atol=1e-6)
    assert (table["clicked"] == (table["prediction"] > 0.5)).all()


# --- categorical columns of a user's table -------------------------------------------------


def test_id_codes_are_stable_24_bit_and_type_independent():
    import hashlib

    import pyarrow as pa

    from training.data.categorical import id_codes

    codes = id_codes(pa.array(["alice", "bob", "alice", None]))
    expected = int.from_bytes(hashlib.blake2b(b"alice", digest_size=3).digest(), "big")
    assert codes[0] == codes[2] == expected and codes[0] != codes[1]
    assert np.isnan(codes[3])
    # A whole number is one id whatever its type: Parquet int, float, CSV text.
    as_int = id_codes(pa.array([12, 7], pa.int64()))
    assert np.array_equal(as_int, id_codes(pa.array([12.0, 7.0])))
    assert np.array_equal(as_int, id_codes(pa.array(["12", "7"])))
    assert id_codes(pa.array([1.5]))[0] == id_codes(pa.array(["1.5"]))[0]
    big = id_codes(pa.array([f"user-{i}" for i in range(5000)]))
    assert big.dtype == np.float32 and big.max() < 2**24 and (big == np.round(big)).all()
    assert len(np.unique(big)) >= 4995  # collisions: about n^2 / 2^25


def write_click_table(path: Path, n: int, seed: int) -> None:
    import pandas as pd

    rng = np.random.default_rng(seed)
    users = np.array([f"u{i:03d}" for i in range(40)])
    frame = pd.DataFrame(
        {
            "user": users[rng.integers(0, 40, n)],
            "sku": rng.integers(1000, 1030, n),
            "price": rng.uniform(1, 50, n).round(2),
            "clicked": rng.integers(0, 2, n),
        }
    )
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path)


def ingest_table(root: Path, source: str, **overrides):
    from training.data.ingest import ingest
    from training.data.options import DataConfig, ShardConfig
    from training.data.shards import write_shards

    settings = {
        "source": source,
        "path": "incoming",
        "label_column": "clicked",
        "num_classes": 2,
        "categorical_columns": ["user", "sku"],
        **overrides,
    }
    cfg = DataConfig(**settings)
    ingest(cfg, root, root / "raw", root / "quarantine", root / "report.json", labels="classes")
    return write_shards(ShardConfig(), root / "raw", root / "shards", "v1")


def test_csv_and_parquet_id_columns_hash_alike_across_files(tmp_path):
    from training.data.categorical import id_codes
    from training.data.loader import open_reader

    codes = {}
    for source in ("csv", "parquet"):
        root = tmp_path / source
        (root / "incoming").mkdir(parents=True)
        write_click_table(root / "incoming" / f"a.{source}", 300, seed=1)
        write_click_table(root / "incoming" / f"b.{source}", 300, seed=2)
        manifest = ingest_table(root, source)
        spec = DataSpec.from_manifest(manifest)
        assert spec.categorical_columns == ("user", "sku") and spec.categorical_hashed
        assert spec.feature_names == ("user", "sku", "price")
        assert spec.categorical_distinct == (40, 30)
        assert spec.default_table_rows() == (160, 120)  # hashed: 4 rows per distinct id
        x = np.concatenate(
            [open_reader(root / "shards", manifest, s).gather(
                np.arange(manifest["splits"][s]["rows"]))[0] for s in ("train", "val", "test")]
        )  # fmt: skip
        codes[source] = (set(x[:, 0].tolist()), set(x[:, 1].tolist()))
    import pyarrow as pa

    users = set(id_codes(pa.array([f"u{i:03d}" for i in range(40)])).tolist())
    skus = set(id_codes(pa.array(list(range(1000, 1030)))).tolist())
    # "u007" in a CSV and in a Parquet file, 1012 as CSV text and as a Parquet int64:
    # one code each, the same in both files of each format.
    assert codes["csv"] == codes["parquet"] == (users, skus)


def test_missing_categorical_column_is_named(tmp_path):
    from training.errors import DataError

    (tmp_path / "incoming").mkdir()
    write_click_table(tmp_path / "incoming" / "a.csv", 50, seed=1)
    with pytest.raises(DataError, match=r"missing column\(s\) 'item'.*categorical_columns"):
        ingest_table(tmp_path, "csv", categorical_columns=["user", "item"])


def test_categorical_columns_need_named_columns():
    from pydantic import ValidationError

    from training.data.options import DataConfig

    with pytest.raises(ValidationError, match="categorical_columns needs features from named"):
        DataConfig(categorical_columns=["user"], tensor_column="pixels")


def test_registered_model_hashes_raw_ids_like_ingest(tmp_path):
    import pandas as pd

    from training.data.loader import open_reader
    from training.objectives import objective_for

    (tmp_path / "incoming").mkdir()
    write_click_table(tmp_path / "incoming" / "a.parquet", 200, seed=3)
    manifest = ingest_table(tmp_path, "parquet")
    spec = DataSpec.from_manifest(manifest)
    frame = pd.read_parquet(tmp_path / "incoming" / "a.parquet")
    objective = objective_for("click", spec)
    # Raw rows as a caller has them: user names, SKUs as strings (the signature's type).
    raw = frame[["price", "user", "sku"]].astype({"sku": str})
    rows = objective.features(raw)
    reader = open_reader(tmp_path / "shards", manifest, "train")
    ingested, _ = reader.gather(np.arange(reader.num_rows))
    assert {tuple(r) for r in ingested.tolist()} <= {tuple(r) for r in rows.tolist()}
    model = build_model(dlrm_cfg(), "click", spec)
    scores = objective.serve(model, raw)
    assert scores.shape == (200,) and ((scores > 0) & (scores < 1)).all()


def test_new_rows_to_score_hash_raw_ids_like_ingest(tmp_path):
    from training.data.loader import open_reader
    from training.data.options import DataConfig
    from training.data.score_input import InputOptions, NewRows

    (tmp_path / "incoming").mkdir()
    write_click_table(tmp_path / "incoming" / "a.csv", 200, seed=4)
    manifest = ingest_table(tmp_path, "csv")
    spec = DataSpec.from_manifest(manifest)
    # The rows to score: the same table without its label, as `gradline score` reads it.
    (tmp_path / "new").mkdir()
    import pandas as pd

    frame = pd.read_csv(tmp_path / "incoming" / "a.csv").drop(columns="clicked")
    frame.to_csv(tmp_path / "new" / "rows.csv", index=False)
    new = NewRows(tmp_path, InputOptions(path="new"), spec, DataConfig(source="csv"))
    scored = np.concatenate([batch.features for batch in new.batches()])
    reader = open_reader(tmp_path / "shards", manifest, "train")
    ingested, _ = reader.gather(np.arange(reader.num_rows))
    assert scored.shape == (200, 3)
    assert {tuple(r) for r in ingested.tolist()} <= {tuple(r) for r in scored.tolist()}


def test_logged_click_model_scores_raw_string_ids(tmp_path, tracking):
    import pandas as pd
    import pyarrow as pa

    from training.data.categorical import id_codes

    hashed = DataSpec(
        "table", (3,), 2, feature_mean=(0.0, 0.0, 20.0), feature_std=(1.0, 1.0, 10.0),
        feature_names=("user", "sku", "price"), categorical_columns=("user", "sku"),
        categorical_distinct=(40, 30), categorical_bound=(2**24 - 5, 2**24 - 9),
        categorical_hashed=True,
    )  # fmt: skip
    model, loaded, _ = test_models.log_and_load(tracking, tmp_path, dlrm_cfg(), "click", hashed)
    types = [str(t) for t in loaded.metadata.signature.inputs.input_types()]
    assert ["string" in t for t in types] == [True, True, False]
    raw = pd.DataFrame({"user": ["u001", "u002", "zoe"], "sku": ["1012", "77", "x"],
                        "price": [9.5, 20.0, 31.0]})  # fmt: skip
    scores = np.asarray(loaded.predict(raw)).ravel()
    codes = np.column_stack(
        [id_codes(pa.array(raw.user)), id_codes(pa.array(raw.sku)), raw.price.to_numpy()]
    ).astype(np.float32)
    with torch.no_grad():
        expected = torch.sigmoid(model(torch.from_numpy(codes))[:, 0]).numpy()
    assert np.allclose(scores, expected, atol=1e-6)


def test_wrong_table_rows_length_fails_at_config_validation():
    from pydantic import ValidationError

    from training.config.schema import Config

    base = {"task": {"type": "click"}, "model": {"name": "dlrm", "table_rows": [10, 20]}}
    with pytest.raises(ValidationError, match=r"table_rows lists 2 sizes.*3 id columns"):
        Config(**base, data={"source": "clicks"})
    csv = {"source": "csv", "num_classes": 2, "categorical_columns": ["user"]}
    with pytest.raises(ValidationError, match=r"table_rows lists 2 sizes.*1 id columns \(user\)"):
        Config(**base, data=csv)
    Config(**base, data={**csv, "categorical_columns": ["user", "sku"]})


def test_user_and_item_columns_are_found_by_name():
    def found(*names: str) -> tuple[int | None, int]:
        spec = DataSpec(
            "table", (len(names),), 2, categorical_columns=names,
            categorical_distinct=(1,) * len(names), categorical_bound=(1,) * len(names),
        )  # fmt: skip
        objective = click_objective(spec)
        return objective.user_column, objective.item_column

    assert found("user_id", "item_id") == (0, 1)
    assert found("sku", "User") == (1, 0)
    assert found("a", "b") == (None, 0)
