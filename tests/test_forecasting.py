"""Forecasting: splits by time, windows, scaling, metrics, baselines, the registered
model's history frame, the config's errors (training.data.series,
training.objectives.forecasting)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.ipc as ipc
import pydantic
import pytest
import torch

from training.config import Config
from training.data.loader import open_reader
from training.data.manifest import read_manifest
from training.data.options import DataConfig, ShardConfig
from training.data.series import (
    CONTEXT_START,
    SERIES_INDEX,
    TARGET_END,
    TARGET_START,
    ingest_series,
    series_stats,
    series_windows,
    split_cutoffs,
    split_of,
    write_window_shards,
)
from training.data.spec import DataSpec
from training.errors import ConfigError
from training.models.options import ModelConfig
from training.models.registry import build_model
from training.objectives import objective_for


def _table(path: Path, lengths: dict[str, int], offset: dict[str, int] | None = None) -> Path:
    """A CSV of several series on whole-number steps: a seasonal wave, a trend and a
    covariate; series may start at different steps."""
    frames = []
    for name, n in lengths.items():
        t = np.arange(n) + (offset or {}).get(name, 0)
        y = 10 + 0.05 * t + np.sin(2 * np.pi * t / 12) + (1 if name == "b" else 0)
        frames.append(pd.DataFrame({"t": t, "shop": name, "sales": y, "price": np.cos(t)}))
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.concat(frames).sample(frac=1.0, random_state=0).to_csv(path, index=False)  # unsorted
    return path


def _data(**overrides) -> DataConfig:
    keys = dict(
        source="csv",
        path="incoming/series.csv",
        time_column="t",
        series_column="shop",
        label_column="sales",
        feature_columns=["price"],
    )
    return DataConfig(**{**keys, **overrides})


def _shards(tmp_path: Path, lengths, context=12, horizon=3, season=12, offset=None, **shard):
    _table(tmp_path / "incoming" / "series.csv", lengths, offset)
    data = _data()
    raw, shards = tmp_path / "raw", tmp_path / "shards"
    ingest_series(data, tmp_path, raw, tmp_path / "quarantine", tmp_path / "ingest.json")
    cfg = ShardConfig(**shard)
    return write_window_shards(data, cfg, context, horizon, season, raw, shards, "v1"), shards


def _split_columns(shards: Path, manifest: dict, split: str) -> pa.Table:
    tables = []
    for shard in manifest["splits"][split]["shards"]:
        with pa.memory_map(str(shards / shard["file"])) as source:
            tables.append(ipc.open_file(source).read_all())
    return pa.concat_tables(tables)


# ---- splits by time ---------------------------------------------------------------------


def test_cutoffs_cut_the_time_span_by_fraction_or_by_date() -> None:
    assert split_cutoffs(0, 100, 0.15, 0.15) == (70, 85)
    assert split_cutoffs(10, 110, 0.2, 0.1) == (80, 100)
    assert split_cutoffs(0, 100, 0.15, 0.15, ["40", "60"]) == (40, 60)
    day = 86_400 * 10**9
    val, test = split_cutoffs(0, 0, 0.1, 0.1, ["1970-01-11", "1970-01-21"], "datetime")
    assert (val, test) == (10 * day, 20 * day)
    with pytest.raises(ConfigError, match="validation start must not be after"):
        split_cutoffs(0, 100, 0.1, 0.1, ["60", "40"])
    assert split_of(np.array([69, 70, 84, 85]), 70, 85).tolist() == [0, 1, 1, 2]


def test_appended_data_moves_the_cutoffs_forward_and_no_later_point_enters_old_train() -> None:
    times = np.arange(0, 200)
    old = split_cutoffs(0, 119, 0.15, 0.15)
    for last in (120, 150, 199):
        new = split_cutoffs(0, last, 0.15, 0.15)
        assert new[0] >= old[0] and new[1] >= old[1]
        old_codes = split_of(times[times <= 119], *old)
        new_codes = split_of(times[times <= 119], *new)
        # Old train points are train in the newer split too: none of them is a
        # validation or test point there, so no model trained on the old split saw one.
        assert (new_codes[old_codes == 0] == 0).all()
        # And a point only moves to an earlier split, never to a later one.
        assert (new_codes <= old_codes).all()


def test_no_train_window_sees_a_time_at_or_after_any_validation_or_test_target(
    tmp_path: Path,
) -> None:
    manifest, shards = _shards(tmp_path, {"a": 120, "b": 90}, offset={"b": 25})
    val_start, test_start = manifest["forecast"]["val_start"], manifest["forecast"]["test_start"]
    train = _split_columns(shards, manifest, "train")
    val = _split_columns(shards, manifest, "val")
    test = _split_columns(shards, manifest, "test")
    later_targets = np.concatenate(
        [val.column(TARGET_START).to_numpy(), test.column(TARGET_START).to_numpy()]
    )
    # Real times: 70 % and 85 % of the span 0..119, rounded up to a step.
    assert (val_start, test_start) == (84, 102)
    train_end = train.column(TARGET_END).to_numpy()
    assert train_end.max() < later_targets.min() == val_start
    assert train_end.max() == val_start - 1  # the last train window ends right before it
    assert (train.column(CONTEXT_START).to_numpy() < val_start).all()
    assert (val.column(TARGET_END).to_numpy() < test_start).all()
    assert (test.column(TARGET_START).to_numpy() >= test_start).all()
    # Both series have windows in every split (b starts later and ends later).
    for split in (train, val, test):
        assert set(split.column(SERIES_INDEX).to_numpy().tolist()) == {0, 1}
    # Each train window's features are its own series' past, scaled by train-only stats.
    a = tmp_path / "incoming" / "series.csv"
    frame = pd.read_csv(a).sort_values(["shop", "t"])
    sales_a = frame[frame.shop == "a"].set_index("t")["sales"]
    stats = manifest["forecast"]["series"][0]
    assert stats["name"] == "a" and stats["train_points"] == val_start
    assert stats["mean"] == pytest.approx(sales_a.loc[: val_start - 1].mean())
    row = 0
    first_target = int(train.column(TARGET_START)[row].as_py())
    features = np.asarray(train.column("features")[row].as_py())
    expected = (sales_a.loc[first_target - 12 : first_target - 1] - stats["mean"]) / stats["std"]
    np.testing.assert_allclose(features[:12], expected.to_numpy(), rtol=1e-5, atol=1e-5)


def test_windows_lie_whole_in_one_split_and_straddling_ones_are_dropped() -> None:
    times = np.arange(10)
    values = times.astype(float) * 10
    cov = np.arange(10, dtype=float)[:, None] + 0.5
    features, targets, codes, spans = series_windows(times, values, cov, 3, 2, (6, 8))
    # First targets at 3, 4 (train), 6 (val), 8 (test); 5 and 7 straddle a cutoff.
    assert spans[:, 1].tolist() == [3, 4, 6, 8]
    assert codes.tolist() == [0, 0, 1, 2]
    assert features[0].tolist() == [0, 10, 20, 2.5]  # context 0..2, covariate at time 2
    assert targets[0].tolist() == [30, 40]
    assert targets[-1].tolist() == [80, 90]
    assert spans[0].tolist() == [0, 3, 4]


def test_scaling_and_the_mase_scale_come_from_the_train_span() -> None:
    stats = series_stats("s", np.array([1.0, 2, 3, 4, 5, 6]), season=2)
    assert stats.mean == 3.5
    assert stats.std == pytest.approx(math.sqrt(35 / 12))
    assert stats.mase_scale == 2.0  # |y_t - y_{t-2}| is 2 everywhere
    with pytest.raises(ConfigError, match=r"too few for task\.season 6"):
        series_stats("s", np.arange(6.0), season=6)


# ---- metrics and baselines ---------------------------------------------------------------


def _objective(context=4, horizon=2, season=2):
    forecast = {
        "context": context,
        "horizon": horizon,
        "season": season,
        "time_kind": "step",
        "time_column": "t",
        "series_column": "shop",
        "target": "sales",
        "covariates": [],
        "covariate_mean": [],
        "covariate_std": [],
        "val_start": 50,
        "test_start": 80,
        "time_step": 1,
        "series": [{"name": "a", "mean": 10.0, "std": 2.0, "mase_scale": 0.5, "train_points": 50}],
    }
    spec = DataSpec("series", feature_shape=(context,), forecast=forecast)
    return objective_for("forecasting", spec)


def test_metrics_match_hand_computed_values_in_the_targets_units() -> None:
    objective = _objective()
    # Two windows of mean 10, std 2, MASE scale 0.5 (then 20, 1, 1 for the second).
    output = torch.tensor([[0.0, 1.0], [1.0, -1.0]])
    target = torch.tensor([[0.5, 1.0, 10, 2, 0.5], [0.0, 0.0, 20, 1, 1.0]], dtype=torch.float64)
    # Units: predictions [10, 12], [21, 19]; actuals [11, 12], [20, 20].
    errors = np.array([1.0, 0.0, 1.0, 1.0])
    actual, predicted = np.array([11, 12, 20, 20.0]), np.array([10, 12, 21, 19.0])
    metrics = objective.metrics(objective.batch_stats(output, target), "test")
    assert metrics["test_mae"] == pytest.approx(errors.mean())
    assert metrics["test_rmse"] == pytest.approx(math.sqrt((errors**2).mean()))
    smape = 100 * np.mean(2 * errors / (np.abs(actual) + np.abs(predicted)))
    assert metrics["test_smape"] == pytest.approx(smape)
    assert metrics["test_mase"] == pytest.approx(np.mean([1 / 0.5, 0, 1 / 1, 1 / 1]))
    assert metrics["test_loss"] == pytest.approx(np.mean([0.25, 0, 1, 1]))
    # Statistics add up: scoring the rows one by one gives the same sums.
    rows = objective.row_stats(output, target).sum(0)
    torch.testing.assert_close(rows, objective.batch_stats(output, target))


def test_seasonal_naive_and_last_value_read_the_context() -> None:
    objective = _objective(context=4, horizon=3, season=2)
    window = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert objective.seasonal_naive(window).tolist() == [[3.0, 4.0, 3.0]]
    assert objective.last_value(window).tolist() == [[4.0, 4.0, 4.0]]


def test_baselines_are_scored_on_the_test_windows(tmp_path: Path) -> None:
    manifest, shards = _shards(tmp_path, {"a": 120, "b": 90}, offset={"b": 25})
    objective = objective_for("forecasting", DataSpec.from_manifest(manifest))
    test = open_reader(shards, manifest, "test")
    train = open_reader(shards, manifest, "train")
    scores = objective.baseline(train, test, 1000)
    assert set(scores) == {
        f"{prefix}test_{m}"
        for prefix in ("baseline_", "baseline_last_value_")
        for m in ("mase", "mae", "rmse", "smape", "loss")
    }
    # The series is a 12-step wave on a gentle trend: a season ago misses only the
    # trend's 12 steps (0.6); the last value misses the wave, computed here from the
    # raw series over the same test windows (first targets 102.. for both series).
    assert scores["baseline_test_mae"] == pytest.approx(0.6, abs=1e-4)
    errors = []
    for ends in (120, 115):  # a covers steps 0..119, b 25..114
        t = np.arange(ends)
        y = 10 + 0.05 * t + np.sin(2 * np.pi * t / 12)
        for start in range(102, ends - 2):
            errors += [abs(y[start + h] - y[start - 1]) for h in range(3)]
    expected = float(np.mean(errors))
    assert scores["baseline_last_value_test_mae"] == pytest.approx(expected, rel=1e-4)
    assert expected > scores["baseline_test_mae"]


# ---- the registered model ---------------------------------------------------------------


def test_the_model_forecasts_the_next_horizon_of_each_series_from_a_history_frame(
    tmp_path: Path,
) -> None:
    manifest, _ = _shards(tmp_path, {"a": 120, "b": 90}, offset={"b": 25})
    spec = DataSpec.from_manifest(manifest)
    objective = objective_for("forecasting", spec)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="tcn", channels=4, layers=2), "forecasting", spec)
    model.eval()
    history = pd.read_csv(tmp_path / "incoming" / "series.csv")
    out = objective.serve(model, history)
    assert list(out.columns) == ["series", "step", "prediction", "time"]
    assert out["series"].tolist() == ["a"] * 3 + ["b"] * 3
    assert out["step"].tolist() == [1, 2, 3] * 2
    assert out["time"].tolist() == [120, 121, 122, 115, 116, 117]  # last step + 1..3
    # The same numbers as the model on the scaled window, mapped back to units.
    a = history[history.shop == "a"].sort_values("t")
    stats = manifest["forecast"]["series"][0]
    cov = manifest["forecast"]
    window = np.concatenate(
        [
            (a.sales.to_numpy()[-12:] - stats["mean"]) / stats["std"],
            (a.price.to_numpy()[-1:] - cov["covariate_mean"]) / cov["covariate_std"],
        ]
    )
    with torch.no_grad():
        scaled = model(torch.tensor(window[None], dtype=torch.float32)).double().numpy()[0]
    np.testing.assert_allclose(
        out["prediction"][:3], scaled * stats["std"] + stats["mean"], rtol=1e-5
    )
    with pytest.raises(ValueError, match=r"has 5 points of history; .* task\.context = 12"):
        objective.serve(model, a.iloc[:5])
    with pytest.raises(ValueError, match="series 'z' was not in the training data"):
        objective.serve(model, a.assign(shop="z"))
    with pytest.raises(ConfigError, match="does not score rows one by one"):
        objective.features(history)


# ---- config errors -----------------------------------------------------------------------


def test_forecasting_a_table_needs_a_time_column() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"needs data\.time_column"):
        Config(data=DataConfig(source="csv"), task={"type": "forecasting"})
    with pytest.raises(pydantic.ValidationError, match=r"task.season \(60\) is longer"):
        Config(data=DataConfig(source="co2"), task={"type": "forecasting", "season": 60})
    with pytest.raises(pydantic.ValidationError, match=r"does not fit data\.source co2"):
        Config(data=DataConfig(source="co2"), task={"type": "regression"})


def test_a_context_longer_than_the_train_span_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no training window fits: task.context \(200\)"):
        _shards(tmp_path, {"a": 120}, context=200, season=12)
    assert not (tmp_path / "shards").exists()


def test_a_repeated_time_in_a_series_is_refused(tmp_path: Path) -> None:
    path = _table(tmp_path / "incoming" / "series.csv", {"a": 30})
    frame = pd.read_csv(path)
    pd.concat([frame, frame.iloc[:1]]).to_csv(path, index=False)
    from training.errors import DataError

    with pytest.raises(DataError, match="has two rows at time"):
        ingest_series(_data(), tmp_path, tmp_path / "raw", tmp_path / "q", tmp_path / "i.json")


def test_the_manifest_describes_windows_the_loader_reads(tmp_path: Path) -> None:
    manifest, shards = _shards(tmp_path, {"a": 120, "b": 90}, offset={"b": 25})
    assert read_manifest(shards)["kind"] == "series"
    assert manifest["feature_shape"] == [13]  # 12 past values and the price
    x, y = open_reader(shards, manifest, "train").gather(np.arange(4))
    assert x.shape == (4, 13) and x.dtype == np.float32
    assert y.shape == (4, 3 + 3) and y.dtype == np.float64  # horizon, then mean, std, scale


def test_the_tcn_is_causal_and_reads_covariates_after_the_context() -> None:
    from training.models.tcn import TCN

    torch.manual_seed(0)
    model = TCN(16, 2, 3, channels=4, layers=3, kernel_size=3, dropout=0.0)
    torch.nn.init.normal_(model.head.weight)  # let the convolutions reach the output
    x = torch.randn(2, 18)
    assert model(x).shape == (2, 3)
    # Inside the stack, the output at time t does not move when a later value does.
    embed = model.embed(x[:, :16].unsqueeze(1))
    changed = x.clone()
    changed[:, 10] += 5.0
    before = model.blocks(embed)
    after = model.blocks(model.embed(changed[:, :16].unsqueeze(1)))
    torch.testing.assert_close(after[:, :, :10], before[:, :, :10])
    assert not torch.allclose(after[:, :, 10:], before[:, :, 10:])
    # The covariates (the last 2 features) reach the forecast through the head.
    moved = x.clone()
    moved[:, 16:] += 1.0
    assert not torch.allclose(model(moved), model(x))


def test_a_champion_forecasting_another_horizon_cannot_score_the_new_windows() -> None:
    from training.data.spec import incompatibility

    def spec(horizon: int) -> DataSpec:
        return DataSpec("series", feature_shape=(12,), forecast={"horizon": horizon})

    assert incompatibility(spec(3), "forecasting", spec(3), "forecasting") is None
    assert incompatibility(spec(3), "forecasting", spec(4), "forecasting") == (
        "it forecasts 3 steps, the windows now hold 4"
    )


def test_windows_are_seen_relative_to_their_last_value() -> None:
    """A level shift of the past values shifts every predicted step by the same amount,
    and a model that outputs zeros forecasts the last value (the naive baseline)."""
    import torch
    from torch import nn

    from training.models.level import LevelRelative

    context, covariates, horizon = 5, 2, 3
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(context + covariates, 16), nn.GELU(), nn.Linear(16, horizon))
    model = LevelRelative(inner, context)
    x = torch.randn(4, context + covariates)
    shifted = x.clone()
    shifted[:, :context] += 7.5  # the series moved up; covariates did not
    torch.testing.assert_close(model(shifted), model(x) + 7.5)

    class Zero(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(x.shape[0], horizon)

    naive = LevelRelative(Zero(), context)(x)
    torch.testing.assert_close(naive, x[:, context - 1 : context].expand(-1, horizon))
