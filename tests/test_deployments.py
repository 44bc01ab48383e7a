"""The pieces of orchestration that need no server: prefect.yaml validation, model
references, the retry contract, progress reporting, one-shot faults."""

from __future__ import annotations

import errno
import inspect
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from flows.deploy import read_deployments
from training.engine.faults import FaultPlan, InjectedFailure, parse
from training.engine.launch import Preempted, TrainingFailed
from training.errors import (
    CRASH_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    ConfigError,
    DiskFull,
    TrackingError,
    is_retryable_exit,
)
from training.mlops.lineage import ModelRef, parse_model_ref
from training.progress import Progress

from .conftest import REPO


@pytest.fixture
def project(tmp_path: Path) -> Path:
    for name in ("params.yaml", "dvc.yaml", "prefect.yaml"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def _edit_deployment(project: Path, **changes) -> None:
    document = yaml.safe_load((project / "prefect.yaml").read_text())
    document["deployments"][0].update(changes)
    (project / "prefect.yaml").write_text(yaml.safe_dump(document))


def test_shipped_prefect_yaml_is_valid(project: Path) -> None:
    nightly, score = read_deployments(project)
    assert nightly.name == "nightly"
    assert nightly.parameters == {"overrides": [], "force": False}
    assert nightly.schedules == [{"cron": "0 2 * * *", "timezone": "UTC"}]
    # Batch scoring ships with a daily schedule that is off until a user turns it on.
    assert (score.name, score.entrypoint) == ("score-daily", "flows/score.py:score")
    assert set(score.parameters) == {"model", "input", "output", "on_bad_rows"}
    assert score.schedules == [{"cron": "0 6 * * *", "timezone": "UTC", "active": False}]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"model": "", "force": True}, "unknown parameters ['force']"),
        ({"on_bad_rows": "skip"}, "on_bad_rows must be fail or quarantine"),
        ({"input": 3}, "input must be text"),
    ],
)
def test_bad_score_deployments_are_refused(project: Path, parameters, message) -> None:
    document = yaml.safe_load((project / "prefect.yaml").read_text())
    document["deployments"][1]["parameters"] = parameters
    (project / "prefect.yaml").write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError, match="deployment 'score-daily'") as info:
        read_deployments(project)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"parameters": {"overrides": ["train.lr=fast"]}}, "train.lr"),
        ({"parameters": {"overrides": ["train.epoch=3"]}}, "unknown key train.epoch"),
        ({"parameters": {"overrides": "train.lr=0.1"}}, "overrides must be a list"),
        ({"parameters": {"force": "yes"}}, "force must be true or false"),
        ({"parameters": {"root": "/tmp"}}, "unknown parameters ['root']"),
        ({"schedules": [{"cron": "every night"}]}, "invalid schedule"),
        ({"schedules": [{"cron": "0 2 * * *", "timezone": "Mars/Olympus"}]}, "invalid"),
        ({"schedules": [{"interval": 60}]}, "needs a cron string"),
        ({"entrypoint": "flows/other.py:main"}, "entrypoint must be"),
    ],
)
def test_bad_deployments_are_refused_naming_the_problem(
    project: Path, changes: dict, message: str
) -> None:
    _edit_deployment(project, **changes)
    with pytest.raises(ConfigError, match="deployment 'nightly'") as info:
        read_deployments(project)
    assert message in str(info.value)


def test_model_references() -> None:
    assert parse_model_ref("m@challenger") == ModelRef("m", "challenger", None)
    assert parse_model_ref("m/3") == ModelRef("m", None, 3)
    assert parse_model_ref("models:/m@champion") == ModelRef("m", "champion", None)
    assert parse_model_ref("m") == ModelRef("m", "champion", None)
    with pytest.raises(TrackingError, match="NAME@ALIAS"):
        parse_model_ref("m/latest")


def test_only_user_errors_are_final() -> None:
    assert not is_retryable_exit(USER_ERROR_EXIT_CODE)
    for code in (1, CRASH_EXIT_CODE, PREEMPTED_EXIT_CODE, -9, None):
        assert is_retryable_exit(code)
    assert (ConfigError.exit_code, ConfigError.retryable) == (USER_ERROR_EXIT_CODE, False)
    assert (TrainingFailed.exit_code, TrainingFailed.retryable) == (CRASH_EXIT_CODE, True)
    assert (Preempted.exit_code, Preempted.retryable) == (PREEMPTED_EXIT_CODE, True)


def test_preemptions_and_crashes_spend_separate_budgets_and_lasting_failures_none() -> None:
    from prefect.states import Failed

    from tasks.dvc_stages import RetryBudget, StageFailed

    def failed_with(exc: BaseException):
        return Failed(data=exc)

    crash = failed_with(StageFailed("workers died", CRASH_EXIT_CODE, retryable=True))
    preempted = failed_with(StageFailed("stopped", PREEMPTED_EXIT_CODE, retryable=True))
    budget = RetryBudget(crashes=2, preemptions=3)
    assert budget.most == 5
    allows = budget.condition
    assert inspect.isfunction(allows)  # Prefect calls nothing else: a method never retries
    # A night of spot reclaims does not use up the crash budget, nor the reverse.
    assert [allows(None, None, preempted) for _ in range(4)] == [True] * 3 + [False]
    assert [allows(None, None, crash) for _ in range(3)] == [True, True, False]
    fresh = RetryBudget(crashes=2, preemptions=10)
    bad_data = StageFailed("label 12 outside 0..9", USER_ERROR_EXIT_CODE, retryable=False)
    full = OSError(errno.ENOSPC, "No space left on device", "checkpoints/step-8")
    for lasting in (bad_data, ConfigError("bad"), full, DiskFull("full")):
        assert not fresh.condition(None, None, failed_with(lasting)), lasting
    assert fresh.condition(None, None, failed_with(OSError("disk hiccup")))
    assert fresh.left == {"crash": 1, "preemption": 10}


def test_plain_progress_logs_every_tenth(monkeypatch, caplog) -> None:
    monkeypatch.setenv("GRADLINE_PROGRESS", "plain")
    with caplog.at_level(logging.INFO, logger="gradline"), Progress("train", 100, "steps") as bar:
        for _ in range(100):
            bar.advance()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "train: 10/100 steps (10%)" and lines[-1] == "train: 100/100 steps (100%)"
    assert len(lines) == 10


def test_a_once_fault_fires_once_per_job(tmp_path: Path) -> None:
    health = tmp_path / "health"
    health.mkdir()
    plan = FaultPlan(parse("fail:rank=0:step=3:once=1"), rank=0, record_dir=health)
    with pytest.raises(InjectedFailure):
        plan.at_step(3)
    plan_after_retry = FaultPlan(parse("fail:rank=0:step=3:once=1"), rank=0, record_dir=health)
    plan_after_retry.at_step(3)  # the job already failed here once: no second failure
