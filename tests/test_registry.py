"""The registry gate against a real MLflow SQLite store: champion moves only on a win,
measured on the same test data (the champion is re-evaluated when the data changed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.models import ModelSpec, build_model
from training.registry import register_and_gate
from training.runs import log_final_model
from training.tracking import TAG_TEST_DIGEST, client, ensure_experiment

NAME = "gate-test"


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = ensure_experiment(uri, "registry", (tmp_path / "artifacts").as_uri())
    return uri, experiment


def _trained(store, accuracy: float, digest: str = "test-split-a") -> tuple[str, str]:
    """A logged model whose run says it scored `accuracy` on test split `digest`."""
    uri, experiment = store
    mlflow = client(uri)
    run_id = mlflow.create_run(experiment).info.run_id
    torch.manual_seed(int(accuracy * 1000))
    model = build_model(ModelSpec(in_features=4, num_classes=2, hidden=8))
    model_uri = log_final_model(uri, run_id, model, np.zeros((2, 4), dtype=np.float32))
    mlflow.log_metric(run_id, "test_accuracy", accuracy)
    mlflow.set_tag(run_id, TAG_TEST_DIGEST, digest)
    return run_id, model_uri


def _gate(store, run, accuracy, digest="test-split-a", reevaluate=None):
    def never(_uri: str) -> float:
        raise AssertionError("the champion was scored on the same data: no re-evaluation")

    return register_and_gate(store[0], NAME, run[1], run[0], accuracy, digest, reevaluate or never)


def test_champion_moves_only_when_beaten(store) -> None:
    first = _gate(store, _trained(store, 0.90), 0.90)
    assert (first.version, first.alias, first.champion_accuracy) == (1, "champion", None)
    worse = _gate(store, _trained(store, 0.85), 0.85)
    assert (worse.version, worse.alias, worse.champion_accuracy) == (2, "challenger", 0.90)
    tie = _gate(store, _trained(store, 0.90), 0.90)
    assert tie.alias == "challenger"  # a tie does not beat the champion
    better = _gate(store, _trained(store, 0.95), 0.95)
    assert (better.version, better.alias) == (4, "champion")
    mlflow = client(store[0])
    assert int(mlflow.get_model_version_by_alias(NAME, "champion").version) == 4


def test_champion_is_re_evaluated_on_new_test_data(store) -> None:
    _gate(store, _trained(store, 0.99, digest="old-split"), 0.99, digest="old-split")
    loaded = []

    def reevaluate(model_uri: str) -> float:
        import mlflow.pytorch

        champion = mlflow.pytorch.load_model(model_uri)  # through the configured registry
        loaded.append(champion(torch.zeros(1, 4)).shape)
        return 0.70

    result = _gate(store, _trained(store, 0.80, "new-split"), 0.80, "new-split", reevaluate)
    assert loaded == [torch.Size([1, 2])]
    assert (result.alias, result.champion_accuracy) == ("champion", 0.70)


def test_registering_the_same_run_twice_adds_no_version(store) -> None:
    run = _trained(store, 0.9)
    assert _gate(store, run, 0.9).version == _gate(store, run, 0.9).version == 1


def test_a_registration_cut_short_is_gated_on_the_next_run(store) -> None:
    import mlflow
    from training.registry import GATE_TAG, is_gated

    _gate(store, _trained(store, 0.80), 0.80)
    run = _trained(store, 0.90)
    mlflow.set_registry_uri(store[0])
    mlflow.register_model(run[1], NAME, tags={"gradline.run_id": run[0]})  # then a crash
    registry = client(store[0])
    assert not is_gated(registry, NAME, run[0])
    result = _gate(store, run, 0.90)
    assert (result.version, result.alias, result.champion_accuracy) == (2, "champion", 0.80)
    assert registry.get_model_version(NAME, "2").tags[GATE_TAG] == "champion"
    assert is_gated(registry, NAME, run[0])
    assert len(registry.search_model_versions(f"name='{NAME}'")) == 2
