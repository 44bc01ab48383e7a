"""The engine under failure, on CPU with gloo, through the real elastic launcher.

Every test here starts worker processes and has a timeout. Faults are injected with
GRADLINE_FAULT (training/faults.py), which the workers inherit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from training.config import Config, jobspec, load_config, update_params_file, write_overrides
from training.data.spec import DataSpec
from training.engine import rendezvous_costs
from training.engine.launch import PREEMPTED_EXIT_CODE, TrainingFailed, launch_workers
from training.host_client import STAGE_HOST_ENV
from training.mlops.tracking import client, ensure_experiment
from training.models.folder import load_model_dir

from .conftest import REPO, copy_project, train_job
from .resume_checks import Resumed, assert_resume_tags, assert_resumed, stopped_steps
from .servers import SharedStageHost

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

# Small and quick: ~13 steps an epoch on the tiny digits split, checkpoints every 8 steps.
TRAIN = {"epochs": 3, "batch_size": 32}
OPTIM = {"lr": 0.01, "warmup_steps": 5}
RUNTIME = {"checkpoint_every_steps": 8, "log_every_steps": 5, "control_every_steps": 2}
# Each workload the engine must carry with the same guarantees, at test size.
WORKLOADS = {
    "mlp": {"model": {"name": "mlp", "hidden": 32, "depth": 2}},
    "cnn": {"model": {"name": "cnn", "channels": 8, "blocks": 1, "stages": 2}},
    "gpt": {
        "data": {"source": "stdlib"},
        "task": {"type": "language_modeling"},
        "model": {"name": "gpt", "layers": 2, "heads": 2, "width": 32, "context": 16},
        "train": {"epochs": 1, "max_steps": 30},
        # One short sample per validation (the default draws 3 x 120 tokens).
        "evaluate": {"prompts": ["def "], "max_new_tokens": 4},
    },
    # Forecasting windows (tests/conftest.py tiny_series_shards): a list label per row.
    "tcn": {
        "data": {"source": "co2"},
        "task": {"type": "forecasting", "context": 26, "horizon": 4, "season": 13},
        "model": {"name": "tcn", "channels": 8, "layers": 2},
        "train": {"epochs": 1, "max_steps": 30},
    },
}
# 1, 2 and 4 ranks (and micro-batches) differ only by floating-point summation order.
# The MLP's weights agree to a relative 1e-4. Models with normalization layers are judged
# by what they compute (max |logit difference| on validation rows): behind a LayerNorm or
# GroupNorm some gradients are sums that nearly cancel, and Adam, which divides each
# gradient by its own running size, turns their rounding noise into small weight changes.
WEIGHT_TOLERANCE = {"mlp": 1e-4, "tcn": 1e-4}
OUTPUT_TOLERANCE = {"cnn": 0.05, "gpt": 0.02}


def _config(workload: str = "mlp", **sections) -> Config:
    spec = WORKLOADS[workload]
    base = {
        "data": spec.get("data", {}),
        "task": spec.get("task", {}),
        "model": spec["model"],
        "optim": OPTIM,
        "train": {**TRAIN, **spec.get("train", {})},
        "runtime": RUNTIME,
        "evaluate": spec.get("evaluate", {}),
    }
    for section, values in sections.items():
        base[section] = {**base[section], **values}
    return Config.model_validate(base)


def _shards(workload: str, request) -> Path:
    name = {"gpt": "tiny_token_shards", "tcn": "tiny_series_shards"}.get(workload, "tiny_shards")
    return request.getfixturevalue(name)


def _job(shards: Path, work: Path, cfg: Config, tracking: tuple[str, str] | None = None):
    return train_job(shards, work, cfg, tracking)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model_dir(model_dir)
    return model.state_dict()


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _new_run(tmp_path: Path) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = ensure_experiment(uri, "test", (tmp_path / "artifacts").as_uri())
    return uri, client(uri).create_run(experiment).info.run_id


@pytest.fixture
def left_in_temp():
    """What launches leave in the system's temporary folder during the test: elastic
    agents' folders (nothing in the suite makes one any more) and torch's pickled
    tracebacks of failed workers that name `fault`. The folder is everyone's, so only
    what no other test makes is counted. (Redirecting tempfile would also move where
    multiprocessing's forkserver puts its socket, for the rest of the test process.)"""
    temp = Path(tempfile.gettempdir())
    before = set(temp.iterdir())

    def left(fault: str = "") -> list[str]:
        found = []
        for path in set(temp.iterdir()) - before:
            if path.name.startswith("torchelastic_"):
                found.append(path.name)
            elif path.name.startswith("pytorch-errorfile-") and fault:
                with contextlib.suppress(OSError):
                    if fault.encode() in path.read_bytes():
                        found.append(path.name)
        return sorted(found)

    return left


_references: dict[str, dict[str, torch.Tensor]] = {}


@pytest.fixture
def reference(request, tmp_path_factory):
    """Final weights of an uninterrupted 2-rank job of a workload (computed once)."""

    def weights(workload: str) -> dict[str, torch.Tensor]:
        if workload not in _references:
            work = tmp_path_factory.mktemp(f"reference-{workload}")
            shards = _shards(workload, request)
            result = launch_workers(_job(shards, work, _config(workload)), 2, max_restarts=0)
            assert result["step"] > 0 and "val_loss" in result
            _references[workload] = _weights(work / "model")
        return _references[workload]

    return weights


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_killed_rank_is_restarted_and_ends_bitwise_identical(
    workload, request, tmp_path, reference, monkeypatch, left_in_temp
) -> None:
    expected = reference(workload)
    monkeypatch.setenv("GRADLINE_FAULT", "kill:rank=1:step=20:attempt=0")
    uri, run_id = _new_run(tmp_path)
    # Checkpoints written in the loop, so the step-16 one is surely whole when rank 1 dies
    # (an asynchronous one in flight would be lost, and the restart would begin earlier).
    cfg = _config(workload, runtime={"async_checkpoint": False})
    job = _job(_shards(workload, request), tmp_path, cfg, (uri, run_id))
    result = launch_workers(job, procs_per_node=2, max_restarts=2)
    assert left_in_temp() == []  # two attempts' agent folders, removed
    # Killed at step 20: the restart continued from the step-16 checkpoint, not step 0.
    resumed = [Resumed(16, written_by=2, resumed_by=2)]
    assert_resumed(tmp_path / "ckpt", *resumed)
    assert _identical(_weights(tmp_path / "model"), expected)
    mlflow = client(uri)
    assert_resume_tags(mlflow, run_id, resumed)
    steps = [m.step for m in mlflow.get_metric_history(run_id, "train_loss")]
    assert steps == list(range(1, result["step"] + 1))  # one value per step, none repeated
    checkpoints = {a.path for a in mlflow.list_artifacts(run_id, "checkpoints")}
    assert "checkpoints/step-00000008" in checkpoints
    recorded = {a.path for a in mlflow.list_artifacts(run_id, "checkpoints/step-00000008")}
    # The distributed checkpoint: each rank's shard file, DCP's metadata, the loop's
    # position and the checksums, and the metrics of the step.
    folder = "checkpoints/step-00000008/"
    names = {"__0_0.distcp", ".metadata", "train_state.json", "sha256.json", "metrics.json"}
    assert {folder + name for name in names} <= recorded


def test_rank_failing_every_attempt_fails_the_job_naming_it(
    tiny_shards, tmp_path, monkeypatch, left_in_temp
) -> None:
    monkeypatch.setenv("GRADLINE_FAULT", "fail:rank=1:step=3")
    started = time.monotonic()
    with pytest.raises(TrainingFailed) as failure:
        launch_workers(_job(tiny_shards, tmp_path, _config()), procs_per_node=2, max_restarts=1)
    assert time.monotonic() - started < 200  # not the 300 s collective timeout
    message = str(failure.value)
    assert "after 2 attempt(s)" in message
    assert "root cause: rank 1 raised InjectedFailure: injected failure at step 3" in message
    assert left_in_temp("injected failure at step 3") == []  # read for the message, then removed
    # One node: the rendezvous skipped its random pause before the first round.
    assert rendezvous_costs.dynamic_rendezvous._delay is rendezvous_costs._delay_without_skew


def test_stalled_rank_fails_the_job_naming_it_within_the_timeout(
    tiny_shards, tmp_path, monkeypatch
) -> None:
    timeout = 6.0
    monkeypatch.setenv("GRADLINE_FAULT", "stall:rank=1:step=4")
    cfg = _config(runtime={"collective_timeout_s": timeout})
    with pytest.raises(TrainingFailed) as failure:
        launch_workers(_job(tiny_shards, tmp_path, cfg), procs_per_node=2, max_restarts=0)
    # The heartbeats came through the control store, not files: stall to failure is
    # within the collective timeout.
    found = re.search(r"rank 1 stopped at step 4 in data \(([0-9.]+) s before", str(failure.value))
    assert found, str(failure.value)
    assert float(found.group(1)) < timeout + 30  # the explanation comes after teardown
    assert not (tmp_path / "ckpt" / "health" / "rank1.json").exists()


def test_slow_rank_is_reported_as_a_straggler(tiny_shards, tmp_path, monkeypatch) -> None:
    # 0.1 s a step: a busy 2-core host can hold rank 0's ~2 ms steps back by tens of ms
    # (with 0.03 s, rank 0 was once flagged too, its steps 1.5 times rank 1's).
    monkeypatch.setenv("GRADLINE_FAULT", "slow:rank=1:step=0:seconds=0.1")
    uri, run_id = _new_run(tmp_path)
    # No checkpoint mid-run: rank 0's share of a checkpoint (DCP's coordination, checksums)
    # runs on threads that, on a loaded 2-core host, would slow its steps too.
    cfg = _config(
        train={"epochs": 1}, runtime={"straggler_factor": 1.5, "checkpoint_every_steps": 1000}
    )
    result = launch_workers(
        _job(tiny_shards, tmp_path, cfg, (uri, run_id)), procs_per_node=2, max_restarts=0
    )
    assert set(result["stragglers"]) == {"1"}
    run = client(uri).get_run(run_id)
    assert run.data.tags["gradline.stragglers"].startswith("rank 1 (")
    assert run.data.metrics["straggler_ratio/rank1"] > 1.5
    assert "time_sync_wait_s/rank0" in run.data.metrics


@pytest.mark.parametrize(("workload", "resume_world_size"), [("cnn", 2), ("gpt", 1)])
def test_sigterm_checkpoints_exits_distinctly_and_resumes(
    workload, resume_world_size, request, tmp_path, reference
) -> None:
    """Preemption of the real `gradline stage train`, then the same command resumes it in
    the same MLflow run: bitwise identical on the same world size, within tolerance on
    another (a change of runtime only: the same job)."""
    expected = reference(workload)
    shards = _shards(workload, request)
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "dvc.yaml", project / "dvc.yaml")
    shutil.copy(REPO / "params.yaml", project / "params.yaml")
    cfg = _config(workload)
    sections = ("data", "task", "model", "optim", "train", "update", "runtime")
    changes = {section: getattr(cfg, section).model_dump() for section in sections}
    update_params_file(project / "params.yaml", changes, replace=frozenset({"model"}))
    written = load_config(project / "params.yaml")
    assert jobspec.job_identity(written) == jobspec.job_identity(cfg)
    command = [
        str(Path(sys.executable).parent / "gradline"),
        *("stage", "train", "--shards", str(shards), "--model", "model"),
        *("--checkpoints", "checkpoints", "--result", "result.json"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    # Run as `gradline run` runs its stages: a fork of the stage host behind a command
    # that passes the signal on and exits as the stage does.
    env[STAGE_HOST_ENV] = SharedStageHost.socket()
    slow = {**env, "GRADLINE_FAULT": "slow:rank=0:step=0:seconds=0.15"}
    job = subprocess.Popen(command, cwd=project, env=slow, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(project.glob("checkpoints/*/step-????????")):
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=180)
    assert job.returncode == PREEMPTED_EXIT_CODE, stderr[-2000:]
    stopped = int(stderr.split("stopped on request at step ")[1].split(";")[0])
    job_dir = next(project.glob("checkpoints/*/"))
    assert (job_dir / f"step-{stopped:08d}").is_dir()  # checkpointed at the stop step
    assert not (project / "model").exists()

    write_overrides(project / "params.yaml", [f"runtime.procs_per_node={resume_world_size}"])
    resumed = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "(resumed)" in resumed.stderr
    # From the checkpoint written where it stopped, by 2 ranks, under the new world size.
    assert_resumed(job_dir, Resumed(stopped, written_by=2, resumed_by=resume_world_size))
    weights = _weights(project / "model")
    if resume_world_size == 2:
        assert _identical(weights, expected)
    else:
        _assert_agree(workload, project / "model", expected, shards)
    run_id = json.loads((project / "result.json").read_text())["run_id"]
    mlflow = client(f"sqlite:///{project / 'mlflow' / 'mlflow.db'}")
    assert len(mlflow.search_runs([mlflow.get_run(run_id).info.experiment_id])) == 1
    run = mlflow.get_run(run_id)
    assert run.data.tags["gradline.runtime.procs_per_node"] == str(resume_world_size)
    assert_resume_tags(mlflow, run_id, [Resumed(stopped)])
    steps = [m.step for m in mlflow.get_metric_history(run_id, "train_loss")]
    assert steps == sorted(set(steps)) == list(range(1, len(steps) + 1))


def test_sigterm_to_the_stage_under_dvc_repro_stops_it_and_dvc_repro_resumes(tmp_path) -> None:
    """`dvc repro` runs the train stage (not the flow): a preemption notice to the stage
    (SIGTERM, as the flow's stop and a cluster's notice send it) stops training at a
    checkpoint, dvc records nothing for the stage, and the next `dvc repro` resumes it
    from that checkpoint in the same MLflow run, leaving `dvc status train` clean."""
    import psutil

    project = copy_project(tmp_path / "project")
    cfg = _config("mlp", runtime={"procs_per_node": 2})
    changes = {section: getattr(cfg, section).model_dump() for section in ("model", "train")}
    changes |= {"optim": OPTIM, "runtime": cfg.runtime.model_dump(), "data": {"max_rows": 600}}
    update_params_file(project / "params.yaml", changes, replace=frozenset({"model"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    repro = [sys.executable, "-m", "dvc", "repro", "train"]
    log_path = tmp_path / "first.log"
    slow = {**env, "GRADLINE_FAULT": "slow:rank=0:step=0:seconds=0.15"}
    with log_path.open("w") as log:
        dvc = subprocess.Popen(repro, cwd=project, env=slow, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 150
        while not list(project.glob("checkpoints/*/step-????????")):
            assert dvc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.2)
        children = psutil.Process(dvc.pid).children(recursive=True)
        # The stage, not its workers' server and workers: forks of it, they share its
        # command line.
        stages = [p for p in children if "stage" in p.cmdline() and "train" in p.cmdline()]
        (stage,) = [p for p in stages if p.ppid() not in {s.pid for s in stages}]
        stage.send_signal(signal.SIGTERM)
        assert dvc.wait(timeout=300) != 0  # dvc reports the stage did not finish
    finally:
        if dvc.poll() is None:
            dvc.kill()
    first = log_path.read_text()
    (stopped,) = stopped_steps(first)
    (job,) = [p for p in (project / "checkpoints").iterdir() if p.is_dir()]
    assert (job / f"step-{stopped:08d}").is_dir(), first[-3000:]
    assert not (project / "model").exists()
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert "train" not in lock["stages"]  # not recorded as done

    again = subprocess.run(repro, cwd=project, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = [Resumed(stopped, written_by=2, resumed_by=2)]
    assert_resumed(job, *resumed)
    status = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "train"],  # evaluate never ran
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert "up to date" in status.stdout, status.stdout + status.stderr
    run_id = json.loads((project / "result.json").read_text())["run_id"]
    mlflow = client(f"sqlite:///{project / 'mlflow' / 'mlflow.db'}")
    assert_resume_tags(mlflow, run_id, resumed)
    steps = [m.step for m in mlflow.get_metric_history(run_id, "train_loss")]
    assert steps == list(range(1, len(steps) + 1))  # one value per step, none repeated


@pytest.mark.parametrize(
    ("workload", "layouts"),
    [
        ("mlp", ((1, 1), (4, 1), (2, 2))),
        ("cnn", ((1, 1), (4, 1))),
        ("tcn", ((1, 1),)),
        # gpt: tests/test_parallel.py holds 1 rank against every layout, losses per step.
    ],
)
def test_one_two_and_four_ranks_and_accumulation_agree(
    workload, layouts, request, tmp_path, reference
) -> None:
    """Same global batch, different world sizes (and micro-batches): the same data per
    step (see the loader), so the weights differ only by floating-point summation order."""
    expected, shards = reference(workload), _shards(workload, request)
    for world, accum in layouts:
        work = tmp_path / f"w{world}-a{accum}"
        cfg = _config(workload, train={"grad_accum_steps": accum})
        launch_workers(_job(shards, work, cfg), world, max_restarts=0)
        _assert_agree(workload, work / "model", expected, shards)


def test_micro_batch_auto_fits_the_budget_and_trains_what_the_full_batch_trains(
    request, tmp_path, reference
) -> None:
    """A budget that holds half a rank's share: auto picks 2 micro-batches per step, and
    the model agrees with the reference (the same rows per step, summed in another order)."""
    from training.data.loader import open_reader
    from training.data.manifest import read_manifest
    from training.engine.micro_batch import bytes_per_row, static_bytes
    from training.models.registry import build_model

    expected, shards = reference("mlp"), _shards("mlp", request)
    cfg = _config("mlp")
    manifest = read_manifest(shards)
    model = build_model(cfg.model, cfg.task.type, DataSpec.from_manifest(manifest))
    x, _ = open_reader(shards, manifest, "val").gather(np.arange(2))
    per_row = bytes_per_row(model, torch.from_numpy(x), contextlib.nullcontext)
    half = cfg.train.batch_size // 2 // 2  # 2 ranks, half a rank's rows
    budget = static_bytes(model, cfg) + per_row * (half + 0.5)
    cfg = _config("mlp", train={"micro_batch": "auto", "memory_budget_mb": budget / 2**20})
    result = launch_workers(_job(shards, tmp_path, cfg), 2, max_restarts=0)
    assert result["grad_accum_steps"] == 2
    _assert_agree("mlp", tmp_path / "model", expected, shards)


def _assert_agree(workload: str, model_dir: Path, expected, shards: Path) -> None:
    """A model trained on another layout agrees with the reference, as documented."""
    if tol := WEIGHT_TOLERANCE.get(workload):
        weights = _weights(model_dir)
        for key, value in expected.items():
            torch.testing.assert_close(weights[key], value, rtol=tol, atol=tol / 10)
        return
    from training.data.loader import open_reader
    from training.data.manifest import read_manifest

    context = WORKLOADS[workload]["model"].get("context")
    reader = open_reader(shards, read_manifest(shards), "val", context=context)
    x, _ = reader.gather(np.arange(min(64, reader.num_rows)))
    model, _ = load_model_dir(model_dir)
    reference_model, _ = load_model_dir(model_dir)
    reference_model.load_state_dict(expected)
    with torch.no_grad():
        got, want = model(torch.from_numpy(x)), reference_model(torch.from_numpy(x))
    assert (got - want).abs().max().item() < OUTPUT_TOLERANCE[workload]
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.98
