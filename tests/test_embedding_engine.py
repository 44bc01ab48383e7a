"""The dlrm model's embedding tables sharded across ranks, through the real launcher.

20 steps of the click task on generated click logs: 2 and 4 ranks, row- and table-wise,
train what one rank trains; a job saved row-wise on 2 ranks resumes on 1 (unsharded) and
on 4 (row- and table-wise); a job whose rank is killed, then whose launcher is told to
stop (SIGTERM), resumes and ends bitwise identical; tables over a rank's budget fail
before training unless sharded. Each test starts worker processes (one thread each) and
has a timeout; the kill and stop tests save synchronously (SYNC_SAVES).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from training.config import Config
from training.engine.launch import (
    Preempted,
    TrainingCannotContinue,
    TrainingFailed,
    launch_workers,
)
from training.mlops.tracking import client, ensure_experiment
from training.models.folder import load_model_dir

from .conftest import assert_same_training, train_job
from .resume_checks import Resumed, assert_resumed, stopped_steps

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

CLICK_JOB = {
    "data": {"source": "clicks", "clicks_rows": 6000, "clicks_users": 400, "clicks_items": 150},
    "task": {"type": "click"},
    "model": {"name": "dlrm", "embedding_dim": 8, "bottom": [16], "top": [16]},
    "optim": {"lr": 0.01, "warmup_steps": 5},
    "train": {"epochs": 1, "max_steps": 20, "batch_size": 64},
    "runtime": {"checkpoint_every_steps": 8, "log_every_steps": 5, "control_every_steps": 2},
}
# (world size, parallel section) of each layout.
LAYOUTS = {
    "row2": (2, {"embedding_sharding": "row"}),
    "row4": (4, {"embedding_sharding": "row"}),
    "table2": (2, {"embedding_sharding": "table"}),
}
# A kill at step 12 must find step 8's checkpoint complete: these steps take
# milliseconds, so an asynchronous save could still be in flight.
SYNC_SAVES = {"async_checkpoint": False}
# Losses agree to a relative 1e-5 at every step, weights to an absolute 1e-5: the rows'
# gradients are summed in another order (arriving from N ranks), nothing else differs.
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def click_shards(tmp_path_factory) -> Path:
    from training.data.ingest import ingest
    from training.data.shards import write_shards

    cfg = Config.model_validate(CLICK_JOB)
    root = tmp_path_factory.mktemp("clicks")
    ingest(
        cfg.data, root, root / "raw", root / "quarantine", root / "report.json", labels="classes"
    )
    write_shards(cfg.shard, root / "raw", root / "shards", "v1")
    return root / "shards"


def _config(world: int, parallel: dict, **sections) -> Config:
    runtime = {**CLICK_JOB["runtime"], "procs_per_node": world, **sections.pop("runtime", {})}
    return Config.model_validate(
        {**CLICK_JOB, "runtime": runtime, "parallel": parallel, **sections}
    )


@pytest.fixture(scope="module")
def tracking(tmp_path_factory) -> tuple[str, str]:
    base = tmp_path_factory.mktemp("emb-mlflow")
    uri = f"sqlite:///{base / 'mlflow.db'}"
    return uri, ensure_experiment(uri, "emb", (base / "artifacts").as_uri())


def _run(shards: Path, work: Path, cfg: Config, tracking, run_id: str | None = None, restarts=0):
    uri, experiment = tracking
    run_id = run_id or client(uri).create_run(experiment).info.run_id
    launch_workers(
        train_job(shards, work, cfg, (uri, run_id)),
        cfg.runtime.procs_per_node,
        max_restarts=restarts,
    )
    return run_id


def _losses(tracking, run_id: str) -> list[float]:
    history = client(tracking[0]).get_metric_history(run_id, "train_loss")
    assert [m.step for m in history] == list(range(1, len(history) + 1))
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def _weights(work: Path) -> dict[str, torch.Tensor]:
    return load_model_dir(work / "model")[0].state_dict()


_finished: dict[str, tuple[list[float], dict[str, torch.Tensor], str]] = {}


@pytest.fixture
def finished(click_shards, tracking, tmp_path_factory):
    """(losses, consolidated weights, run id) of an uninterrupted job (run once)."""

    def get(layout: str):
        if layout not in _finished:
            world, parallel = (1, {}) if layout == "single" else LAYOUTS[layout]
            work = tmp_path_factory.mktemp(layout)
            run_id = _run(click_shards, work, _config(world, parallel), tracking)
            _finished[layout] = (_losses(tracking, run_id), _weights(work), run_id)
        return _finished[layout]

    return get


def _assert_same_training(got, want) -> None:
    assert any("embeddings.tables.0.weight" in name for name in got[1])  # one whole model
    assert_same_training(got, want, CLICK_JOB["train"]["max_steps"], LOSS_RTOL, WEIGHT_ATOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_tables_train_what_one_rank_trains(layout, finished, tracking) -> None:
    losses, weights, run_id = finished(layout)
    single = finished("single")
    _assert_same_training((losses, weights), single[:2])
    # The all-to-alls are waited for and counted: sync wait and bytes on every rank.
    metrics = client(tracking[0]).get_run(run_id).data.metrics
    world = LAYOUTS[layout][0]
    assert all(metrics[f"time_sync_wait_s/rank{r}"] > 0 for r in range(world))


def test_a_sharded_checkpoint_resumes_on_1_and_4_ranks(
    click_shards, tracking, finished, tmp_path, monkeypatch
) -> None:
    """Saved row-wise by 2 ranks (killed at step 12; step 8 is on disk), resumed into the
    same run row-wise on 4, and from copies unsharded on 1 and table-wise on 4: each
    the loss curve and weights of an uninterrupted job."""
    monkeypatch.setenv("GRADLINE_FAULT", "kill:rank=1:step=12:attempt=0")
    uri, experiment = tracking
    original = tmp_path / "row4"
    run_id = client(uri).create_run(experiment).info.run_id
    with pytest.raises(TrainingFailed):
        _run(
            click_shards, original, _config(*LAYOUTS["row2"], runtime=SYNC_SAVES), tracking, run_id
        )
    monkeypatch.delenv("GRADLINE_FAULT")
    assert sorted(p.name for p in (original / "ckpt").glob("step-*")) == ["step-00000008"]
    resumes = {original: (4, {"embedding_sharding": "row"}, run_id)}
    for name, world, parallel in [("one", 1, {}), ("table4", 4, {"embedding_sharding": "table"})]:
        shutil.copytree(original, tmp_path / name)
        resumes[tmp_path / name] = (world, parallel, None)
    for work, (world, parallel, into) in resumes.items():
        resumed_run = _run(click_shards, work, _config(world, parallel), tracking, into)
        assert_resumed(work / "ckpt", Resumed(8, written_by=2, resumed_by=world))
        got = (_losses(tracking, resumed_run), _weights(work))
        _assert_same_training(got, finished("single")[:2])


def test_killed_then_preempted_job_ends_bitwise_identical(
    click_shards, tracking, finished, tmp_path, monkeypatch
) -> None:
    """Deterministic mode (the default): rank 1 is killed at step 12 (the restart resumes
    from step 8); on the restart the launcher gets SIGTERM at step 14 and the job stops
    with a checkpoint; run again, it ends with exactly the weights of the uninterrupted
    row-wise job, one loss per step in the same MLflow run."""
    _, expected, _ = finished("row2")
    monkeypatch.setenv(
        "GRADLINE_FAULT", "kill:rank=1:step=12:attempt=0;term:rank=0:step=14:attempt=1"
    )
    cfg = _config(*LAYOUTS["row2"], runtime=SYNC_SAVES)
    assert cfg.train.deterministic
    uri, experiment = tracking
    run_id = client(uri).create_run(experiment).info.run_id
    with pytest.raises(Preempted) as stop:
        _run(click_shards, tmp_path, cfg, tracking, run_id, restarts=1)
    (stopped,) = stopped_steps(str(stop.value))
    assert 14 <= stopped < 20
    monkeypatch.delenv("GRADLINE_FAULT")
    _run(click_shards, tmp_path, cfg, tracking, run_id)
    resumed = [Resumed(8, written_by=2, resumed_by=2), Resumed(stopped, written_by=2, resumed_by=2)]
    assert_resumed(tmp_path / "ckpt", *resumed)
    assert len(_losses(tracking, run_id)) == CLICK_JOB["train"]["max_steps"]
    weights = _weights(tmp_path)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_tables_over_the_budget_fail_before_training_unless_sharded(
    click_shards, tracking, tmp_path
) -> None:
    """(400 + 150 + 6) rows x 8 x 4 bytes x 3 (AdamW) = 0.051 MB; a 0.03 MB budget."""
    budget = {"embedding_budget_mb": 0.03}
    with pytest.raises(TrainingCannotContinue) as refused:
        _run(click_shards, tmp_path / "whole", _config(2, budget), tracking)
    message = str(refused.value)
    assert "ConfigError" in message and "0.1 MB on every rank" in message
    assert "embedding_budget_mb is 0.03" in message and "embedding_sharding: row" in message
    assert not list((tmp_path / "whole" / "ckpt").glob("step-*"))  # no step was taken
    sharded = _config(
        2, {**budget, "embedding_sharding": "row"}, train={**CLICK_JOB["train"], "max_steps": 4}
    )
    _run(click_shards, tmp_path / "sharded", sharded, tracking)
    assert (tmp_path / "sharded" / "model").is_dir()
