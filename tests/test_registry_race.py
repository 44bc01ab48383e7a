"""Concurrent registrations of one model name (two projects, one MLflow server): distinct
versions, exactly one `champion`, and it is the best of them.

A real `mlflow server` on 127.0.0.1 with a SQLite store; K registrations from separate
processes, released together by a barrier."""

from __future__ import annotations

import multiprocessing
import random

import pytest

from tests import test_tracking_outage
from tests.test_registry import _trained
from training.engine.worker_start import start_method
from training.mlops.registry import (
    CHAMPION,
    GATE_TAG,
    Registration,
    Score,
    register_and_gate,
)
from training.mlops.tracking import client, ensure_experiment

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NAME = "race-test"
server = test_tracking_outage.server  # the fixture: a real mlflow server on 127.0.0.1
DIGEST = "test-split-a"
BASELINE = 0.5


def _logged(uri: str, experiment: str, tmp_path, accuracy: float) -> tuple[str, str]:
    """A logged model whose run says it scored `accuracy` on the test split."""
    return _trained((uri, experiment, tmp_path), accuracy, DIGEST)


def _never(_uri: str) -> float:
    raise AssertionError("every model was scored on the same test split: no re-scoring")


def _register(uri, run, accuracy, barrier, results) -> None:
    """One project's register step, in its own process, started together with the others."""
    barrier.wait(timeout=300)  # five interpreters importing MLflow
    score = Score("test_accuracy", True, accuracy, BASELINE)
    results.put(register_and_gate(uri, NAME, run[1], run[0], score, DIGEST, _never))


def _race(uri: str, runs: dict[float, tuple[str, str]]) -> list[Registration]:
    """Register every run at once, each from its own process; their Registrations."""
    # Forked by the engine's forkserver (MLflow imported once, no thread of this process
    # inherited: MLflow's client threads survive no fork of this one).
    context = multiprocessing.get_context(start_method())
    barrier, results = context.Barrier(len(runs)), context.Queue()
    workers = [
        context.Process(target=_register, args=(uri, run, accuracy, barrier, results))
        for accuracy, run in runs.items()
    ]
    try:
        for worker in workers:
            worker.start()
        done = [results.get(timeout=300) for _ in workers]
        for worker in workers:
            worker.join(timeout=30)
            assert worker.exitcode == 0
        return done
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()


def test_concurrent_registrations_leave_one_champion_the_best(server, tmp_path) -> None:
    uri = server.uri
    experiment = ensure_experiment(uri, "race", (tmp_path / "artifacts").as_uri())
    # A champion to beat, so every racer reads the same old champion and beats it.
    first = _logged(uri, experiment, tmp_path, 0.60)
    old = register_and_gate(
        uri, NAME, first[1], first[0], Score("test_accuracy", True, 0.60, BASELINE), DIGEST, _never
    )
    assert (old.version, old.alias) == (1, CHAMPION)
    accuracies = [0.70, 0.75, 0.80, 0.95, 0.85]
    random.shuffle(accuracies)  # which one registers first is the race's business
    runs = {accuracy: _logged(uri, experiment, tmp_path, accuracy) for accuracy in accuracies}

    registrations = _race(uri, runs)

    versions = sorted(r.version for r in registrations)
    assert versions == list(range(2, 2 + len(runs)))  # distinct, none lost
    registry = client(uri)
    holder = registry.get_model_version_by_alias(NAME, CHAMPION)
    assert registry.get_run(holder.run_id).data.metrics["test_accuracy"] == 0.95
    assert [r.alias for r in registrations].count(CHAMPION) == 1
    (winner,) = [r for r in registrations if r.alias == CHAMPION]
    assert (winner.version, winner.score.value) == (int(holder.version), 0.95)
    for version in range(1, 2 + len(runs)):
        found = registry.get_model_version(NAME, str(version))
        is_holder = found.version == holder.version
        assert (CHAMPION in found.aliases) == is_holder, found
        assert (found.tags[GATE_TAG] == CHAMPION) == is_holder or version == 1, found
        if not is_holder and version > 1:
            assert found.description.startswith("Challenger"), found.description
