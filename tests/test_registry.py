"""The registry gate against a real MLflow SQLite store: on the task's metric, in its
direction, never champion without beating the baseline, the champion re-scored when the
test data changed, and a clear verdict when it cannot take the new data."""

from __future__ import annotations

import pytest
import torch
from mlflow.exceptions import MlflowException

from training.config import ModelConfig
from training.data.spec import DataSpec
from training.mlops.registry import (
    GATE_TAG,
    Incompatible,
    Score,
    is_gated,
    register_and_gate,
)
from training.mlops.serving import log_pyfunc_model
from training.mlops.tracking import TAG_TEST_DIGEST, client, ensure_experiment, fluent_store
from training.models.folder import ModelSpec, save_model_dir
from training.models.registry import build_model

NAME = "gate-test"
DATA = DataSpec("table", feature_shape=(4,), num_classes=2)
MLP = ModelConfig(name="mlp", hidden=8, depth=1)


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = ensure_experiment(uri, "registry", (tmp_path / "artifacts").as_uri())
    return uri, experiment, tmp_path


def _trained(store, accuracy: float, digest: str = "test-split-a") -> tuple[str, str]:
    """A logged model whose run says it scored `accuracy` on test split `digest`."""
    uri, experiment, tmp_path = store
    mlflow = client(uri)
    run_id = mlflow.create_run(experiment).info.run_id
    torch.manual_seed(int(accuracy * 1000))
    folder = tmp_path / f"model-{run_id}"
    model = build_model(MLP, "classification", DATA)
    save_model_dir(model, ModelSpec("classification", MLP.model_dump(), DATA.to_dict()), folder)
    model_uri = log_pyfunc_model(uri, run_id, folder, {})
    mlflow.log_metric(run_id, "test_accuracy", accuracy)
    mlflow.set_tag(run_id, TAG_TEST_DIGEST, digest)
    return run_id, model_uri


def _never(_uri: str) -> float:
    raise AssertionError("the champion was scored on the same data: no re-scoring")


def _gate(store, run, accuracy, baseline=0.5, digest="test-split-a", rescore=_never):
    score = Score("test_accuracy", True, accuracy, baseline)
    return register_and_gate(store[0], NAME, run[1], run[0], score, digest, rescore)


def _description(store, version: int) -> str:
    return client(store[0]).get_model_version(NAME, str(version)).description


def test_a_lone_champion_does_not_wait_to_settle_but_one_among_recent_versions_does(
    store, monkeypatch
) -> None:
    """A new champion waits SETTLE_S for registrations running beside it only when other
    versions were registered lately: the first registration of a name has nobody to wait
    for, a second right after it may."""
    from training.mlops import registry

    settles: list[float] = []
    sleep = registry.time.sleep

    def recorded(seconds: float) -> None:  # every sleep still sleeps; the settles are noted
        if seconds == registry.SETTLE_S:
            settles.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(registry.time, "sleep", recorded)
    assert _gate(store, _trained(store, 0.90), 0.90).alias == "champion"
    assert settles == []
    assert _gate(store, _trained(store, 0.95), 0.95).alias == "champion"
    assert settles == [registry.SETTLE_S]


def test_champion_moves_only_when_beaten(store) -> None:
    first = _gate(store, _trained(store, 0.90), 0.90)
    assert (first.version, first.alias, first.champion_score) == (1, "champion", None)
    worse = _gate(store, _trained(store, 0.85), 0.85)
    assert (worse.version, worse.alias, worse.champion_score) == (2, "challenger", 0.90)
    assert "not champion v1's 0.9000" in worse.verdict
    tie = _gate(store, _trained(store, 0.90), 0.90)
    assert tie.alias == "challenger"  # a tie does not beat the champion
    better = _gate(store, _trained(store, 0.95), 0.95)
    assert (better.version, better.alias) == (4, "champion")
    mlflow = client(store[0])
    assert int(mlflow.get_model_version_by_alias(NAME, "champion").version) == 4
    tags = mlflow.get_model_version(NAME, "4").tags
    assert (tags["test_accuracy"], tags["baseline_test_accuracy"]) == ("0.95", "0.5")


def test_lower_is_better_metrics_gate_the_other_way(store) -> None:
    def gate(run, rmse):
        score = Score("test_rmse", False, rmse, 60.0)
        return register_and_gate(store[0], NAME, run[1], run[0], score, "split", _never)

    def trained(rmse):  # the champion's recorded score on the same split
        run = _trained(store, 0.5, "split")
        client(store[0]).log_metric(run[0], "test_rmse", rmse)
        return run

    assert gate(trained(55.0), 55.0).alias == "champion"
    assert gate(trained(57.0), 57.0).alias == "challenger"
    assert gate(trained(50.0), 50.0).alias == "champion"


def test_a_model_that_does_not_beat_its_baseline_is_never_champion(store) -> None:
    result = _gate(store, _trained(store, 0.44), 0.44, baseline=0.95)
    assert (result.version, result.alias) == (1, "challenger")  # even with no champion yet
    assert "does not beat the baseline's 0.9500" in _description(store, 1)
    with pytest.raises(MlflowException, match="not found"):
        client(store[0]).get_model_version_by_alias(NAME, "champion")


def test_a_verdict_below_the_baseline_still_shows_the_champion(store) -> None:
    _gate(store, _trained(store, 0.99, digest="old-split"), 0.99, digest="old-split")
    run = _trained(store, 0.80, "new-split")
    result = _gate(store, run, 0.80, baseline=0.85, digest="new-split", rescore=lambda _: 0.90)
    assert result.alias == "challenger"
    assert "does not beat the baseline's 0.8500" in result.verdict
    assert "champion v1's 0.9000 on the same test data" in result.verdict


def test_champion_is_re_scored_on_new_test_data(store) -> None:
    _gate(store, _trained(store, 0.99, digest="old-split"), 0.99, digest="old-split")
    asked = []

    def rescore(model_uri: str) -> float:
        asked.append(model_uri)
        return 0.70

    run = _trained(store, 0.80, "new-split")
    result = _gate(store, run, 0.80, digest="new-split", rescore=rescore)
    assert asked == [f"models:/{NAME}/1"]
    assert (result.alias, result.champion_score) == ("champion", 0.70)
    assert "champion v1's 0.7000 on the same test data" in result.verdict
    assert "champion v1's 0.7000 on the same test data" in _description(store, 2)


def test_a_champion_that_cannot_take_the_new_data_gets_a_verdict_not_a_crash(store) -> None:
    _gate(store, _trained(store, 0.99, digest="old-split"), 0.99, digest="old-split")

    def rescore(_uri: str) -> float:
        raise Incompatible("it takes features of shape [30], the data now has [31]")

    result = _gate(store, _trained(store, 0.90, "new"), 0.90, digest="new", rescore=rescore)
    assert (result.alias, result.champion_score) == ("champion", None)
    assert "champion v1 cannot be compared (it takes features of shape [30]" in result.verdict
    assert "cannot be compared" in _description(store, 2)


def test_registering_the_same_run_twice_adds_no_version(store) -> None:
    run = _trained(store, 0.9)
    assert _gate(store, run, 0.9).version == _gate(store, run, 0.9).version == 1


def test_a_registration_cut_short_is_gated_on_the_next_run(store) -> None:
    import mlflow

    _gate(store, _trained(store, 0.80), 0.80)
    run = _trained(store, 0.90)
    with fluent_store(store[0]):
        mlflow.register_model(run[1], NAME, tags={"gradline.run_id": run[0]})  # then a crash
    registry = client(store[0])
    assert not is_gated(registry, NAME, run[0])
    result = _gate(store, run, 0.90)
    assert (result.version, result.alias, result.champion_score) == (2, "champion", 0.80)
    assert registry.get_model_version(NAME, "2").tags[GATE_TAG] == "champion"
    assert is_gated(registry, NAME, run[0])
    assert len(registry.search_model_versions(f"name='{NAME}'")) == 2


def test_incompatibility_names_what_changed_in_the_data() -> None:
    from training.data.spec import incompatibility

    table = DataSpec("table", (30,), 2, feature_names=tuple(f"c{i}" for i in range(30)))
    wider = DataSpec("table", (31,), 2, feature_names=(*table.feature_names, "new"))
    assert incompatibility(table, "classification", table, "classification") is None
    assert "added ['new']" in incompatibility(table, "classification", wider, "classification")
    assert "learned classification" in incompatibility(table, "classification", table, "regression")
    tokens = DataSpec("tokens", vocab_size=2048, tokenizer="a" * 64)
    retrained = DataSpec("tokens", vocab_size=2048, tokenizer="b" * 64)
    assert "another tokenizer" in incompatibility(
        tokens, "language_modeling", retrained, "language_modeling"
    )
    assert "257 tokens" in incompatibility(
        DataSpec("tokens", vocab_size=257), "language_modeling", tokens, "language_modeling"
    )
