"""The engine under failure, on CPU with gloo, through the real elastic launcher.

Every test here starts worker processes and has a timeout. Faults are injected with
GRADLINE_FAULT (training/faults.py), which the workers inherit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from training.config import Config, TrainConfig, write_overrides
from training.launch import PREEMPTED_EXIT_CODE, TrainingFailed, launch_workers
from training.loop import TrainJob, load_model
from training.tracking import client, ensure_experiment

from .conftest import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

# Small and quick: ~13 steps an epoch on the tiny split, checkpoints every 8 steps.
TRAIN = {
    "epochs": 3,
    "batch_size": 32,
    "hidden": 32,
    "checkpoint_every_steps": 8,
    "log_every_steps": 5,
    "control_every_steps": 2,
    "warmup_steps": 5,
    "lr": 0.01,
}


def _config(**train) -> Config:
    return Config(train=TrainConfig(**{**TRAIN, **train}))


def _job(shards: Path, work: Path, cfg: Config, tracking: tuple[str, str] | None = None):
    uri, run_id = tracking or (None, None)
    return TrainJob(
        config=cfg.model_dump(),
        shard_dir=str(shards),
        checkpoint_dir=str(work / "ckpt"),
        model_dir=str(work / "model"),
        tracking_uri=uri,
        run_id=run_id,
    )


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(model_dir)
    return model.state_dict()


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _new_run(tmp_path: Path) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = ensure_experiment(uri, "test", (tmp_path / "artifacts").as_uri())
    return uri, client(uri).create_run(experiment).info.run_id


@pytest.fixture(scope="module")
def reference(tiny_shards, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Final weights of an uninterrupted 2-rank job with the default test config."""
    work = tmp_path_factory.mktemp("reference")
    result = launch_workers(_job(tiny_shards, work, _config()), world_size=2, max_restarts=0)
    assert result["epoch"] == 3 and result["val_accuracy"] > 0.5
    return _weights(work / "model")


def test_killed_rank_is_restarted_and_ends_bitwise_identical(
    tiny_shards, tmp_path, reference, monkeypatch
) -> None:
    monkeypatch.setenv("GRADLINE_FAULT", "kill:rank=1:step=20:attempt=0")
    uri, run_id = _new_run(tmp_path)
    result = launch_workers(
        _job(tiny_shards, tmp_path, _config(), (uri, run_id)), world_size=2, max_restarts=2
    )
    assert _identical(_weights(tmp_path / "model"), reference)
    mlflow = client(uri)
    steps = [m.step for m in mlflow.get_metric_history(run_id, "train_loss")]
    assert steps == list(range(1, result["step"] + 1))  # one value per step, none repeated
    checkpoints = {a.path for a in mlflow.list_artifacts(run_id, "checkpoints")}
    assert "checkpoints/step-00000008" in checkpoints
    recorded = {a.path for a in mlflow.list_artifacts(run_id, "checkpoints/step-00000008")}
    assert recorded == {
        "checkpoints/step-00000008/ckpt-00000008.pt",
        "checkpoints/step-00000008/metrics.json",
    }


def test_rank_failing_every_attempt_fails_the_job_naming_it(
    tiny_shards, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("GRADLINE_FAULT", "fail:rank=1:step=3")
    started = time.monotonic()
    with pytest.raises(TrainingFailed) as failure:
        launch_workers(_job(tiny_shards, tmp_path, _config()), world_size=2, max_restarts=1)
    assert time.monotonic() - started < 90
    message = str(failure.value)
    assert "after 2 attempt(s)" in message
    assert "root cause: rank 1 raised InjectedFailure: injected failure at step 3" in message


def test_stalled_rank_fails_the_job_naming_it_within_the_timeout(
    tiny_shards, tmp_path, monkeypatch
) -> None:
    timeout = 6.0
    monkeypatch.setenv("GRADLINE_FAULT", "stall:rank=1:step=4")
    cfg = _config(collective_timeout_s=timeout)
    with pytest.raises(TrainingFailed) as failure:
        launch_workers(_job(tiny_shards, tmp_path, cfg), world_size=2, max_restarts=0)
    failed_at = time.time()
    beat = json.loads((tmp_path / "ckpt" / "health" / "rank1.json").read_text())
    assert beat["step"] == 4 and beat["phase"] == "data"
    assert failed_at - beat["since"] < timeout + 5  # stall to failure
    assert "rank 1 stopped at step 4 in data" in str(failure.value)


def test_slow_rank_is_reported_as_a_straggler(tiny_shards, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GRADLINE_FAULT", "slow:rank=1:step=0:seconds=0.03")
    uri, run_id = _new_run(tmp_path)
    cfg = _config(epochs=1, straggler_factor=1.5)
    result = launch_workers(
        _job(tiny_shards, tmp_path, cfg, (uri, run_id)), world_size=2, max_restarts=0
    )
    assert set(result["stragglers"]) == {"1"}
    run = client(uri).get_run(run_id)
    assert run.data.tags["gradline.stragglers"].startswith("rank 1 (")
    assert run.data.metrics["straggler_ratio/rank1"] > 1.5
    assert "time_sync_wait_s/rank0" in run.data.metrics


def test_sigterm_checkpoints_exits_distinctly_and_resumes(tiny_shards, tmp_path, reference) -> None:
    """Preemption of the real `gradline stage train`, then the same command resumes it."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "dvc.yaml", project / "dvc.yaml")
    shutil.copy(REPO / "params.yaml", project / "params.yaml")
    overrides = [f"train.{k}={v}" for k, v in TRAIN.items()]
    cfg = write_overrides(project / "params.yaml", overrides)
    assert cfg.train == _config().train
    command = [
        str(Path(sys.executable).parent / "gradline"),
        *("stage", "train", "--shards", str(tiny_shards), "--model", "model"),
        *("--checkpoints", "checkpoints", "--result", "result.json"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    slow = {**env, "GRADLINE_FAULT": "slow:rank=0:step=0:seconds=0.15"}
    job = subprocess.Popen(command, cwd=project, env=slow, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(project.glob("checkpoints/*/ckpt-*.pt")):
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == PREEMPTED_EXIT_CODE, stderr[-2000:]
    assert "stopped on request at step" in stderr
    assert not (project / "model").exists()

    resumed = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "(resumed)" in resumed.stderr
    assert _identical(_weights(project / "model"), reference)
    run_id = json.loads((project / "result.json").read_text())["run_id"]
    mlflow = client(f"sqlite:///{project / 'mlflow' / 'mlflow.db'}")
    assert len(mlflow.search_runs([mlflow.get_run(run_id).info.experiment_id])) == 1
    steps = [m.step for m in mlflow.get_metric_history(run_id, "train_loss")]
    assert steps == sorted(set(steps)) == list(range(1, len(steps) + 1))


def test_one_two_and_four_ranks_and_accumulation_agree(tiny_shards, tmp_path, reference) -> None:
    """Same global batch, different world sizes (and micro-batches): the same data per
    step (see the loader), so the weights differ only by floating-point summation order."""
    for world, accum in ((1, 1), (4, 1), (2, 2)):
        work = tmp_path / f"w{world}-a{accum}"
        cfg = _config(batch_size=32, grad_accum_steps=accum)
        launch_workers(_job(tiny_shards, work, cfg), world_size=world, max_restarts=0)
        weights = _weights(work / "model")
        for key, value in reference.items():
            torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5)
