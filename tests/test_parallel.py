"""Parallel layouts on CPU/gloo through the real launcher: FSDP2, HSDP, tensor and pipeline
parallelism and their hybrids train the same `gpt` as one rank, resume each other's
distributed checkpoints, and survive a killed rank bitwise.

Every test starts worker processes and has a timeout. One thread per rank: 4 ranks on
2 cores stay slow but correct.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from training.config import Config
from training.engine.launch import TrainingFailed, launch_workers
from training.mlops.tracking import client, ensure_experiment
from training.models.folder import load_model_dir

from .conftest import assert_same_training, train_job
from .resume_checks import Resumed, assert_resumed

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

GPT_JOB = {
    "data": {"source": "stdlib"},
    "task": {"type": "language_modeling"},
    # One short sample per validation: a sharded model samples in collective forwards, one
    # per token, and the default (3 prompts x 120 tokens) would outweigh the training.
    "evaluate": {"prompts": ["def "], "max_new_tokens": 4},
    "model": {
        "name": "gpt",
        "layers": 4,
        "heads": 2,
        "width": 32,
        "context": 16,
        "tied_embeddings": False,
    },
    "optim": {"lr": 0.01, "warmup_steps": 5},
    "train": {"epochs": 1, "max_steps": 20, "batch_size": 16},
    "runtime": {"checkpoint_every_steps": 8, "log_every_steps": 5, "control_every_steps": 2},
}
# (world size, parallel section) of each layout the engine offers.
LAYOUTS = {
    "ddp": (2, {}),
    "fsdp": (2, {"dp_shard": 2}),
    # HSDP, with each block recomputed in backward (activation checkpointing).
    "hsdp": (4, {"dp_replicate": 2, "dp_shard": 2, "activation_checkpointing": "block"}),
    "tp": (2, {"tp": 2}),
    "pp-gpipe": (2, {"pp": 2, "pp_schedule": "gpipe"}),
    "pp-1f1b": (2, {"pp": 2, "pp_schedule": "1f1b"}),
    "fsdp-tp": (4, {"dp_shard": 2, "tp": 2}),
    # Pipeline x data parallel, two model chunks per pipeline rank (interleaved 1F1B).
    "pp-dp": (4, {"pp": 2, "dp_replicate": 2, "pp_schedule": "interleaved_1f1b"}),
}
# Losses agree to a relative 1e-4 at every step. Weights agree to an absolute 1e-3:
# summation order differs between layouts, and parameters whose true gradient is zero
# (attention key biases: softmax ignores a shift shared by all keys) receive Adam steps
# of pure rounding noise, up to ~lr each, in any layout (measured: <= 2.1e-4 here).
LOSS_RTOL, WEIGHT_ATOL = 1e-4, 1e-3


def _config(world: int, parallel: dict, eval_batch: int = 512) -> Config:
    runtime = {**GPT_JOB["runtime"], "procs_per_node": world}
    return Config.model_validate(
        {
            **GPT_JOB,
            "runtime": runtime,
            "parallel": parallel,
            "evaluate": {**GPT_JOB["evaluate"], "batch_size": eval_batch},
        }
    )


def _uneven_eval_batch(shards: Path, shares: int) -> int:
    """A validation batch size that gives the larger of `shares` data-parallel shares one
    batch more than the smaller ones (a sharded forward is a collective: every rank must
    still make the same calls)."""
    from training.data.loader import open_reader
    from training.data.manifest import read_manifest

    rows = open_reader(shards, read_manifest(shards), "val", context=16).num_rows
    return max(1, -(-rows // shares) - 1)


@pytest.fixture(scope="module")
def tracking(tmp_path_factory) -> tuple[str, str]:
    base = tmp_path_factory.mktemp("parallel-mlflow")
    uri = f"sqlite:///{base / 'mlflow.db'}"
    return uri, ensure_experiment(uri, "parallel", (base / "artifacts").as_uri())


def _run(shards: Path, work: Path, cfg: Config, tracking, run_id: str | None = None, restarts=0):
    """Train `cfg` in `work` into an MLflow run (a new one unless given); return it."""
    uri, experiment = tracking
    run_id = run_id or client(uri).create_run(experiment).info.run_id
    job = train_job(shards, work, cfg, (uri, run_id))
    launch_workers(job, cfg.runtime.procs_per_node, max_restarts=restarts)
    return run_id


def _losses(tracking, run_id: str) -> list[float]:
    history = client(tracking[0]).get_metric_history(run_id, "train_loss")
    steps = [m.step for m in history]
    assert steps == list(range(1, len(steps) + 1)), "one loss per step, none repeated"
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def _weights(work: Path) -> dict[str, torch.Tensor]:
    return load_model_dir(work / "model")[0].state_dict()


_finished: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}
_work: dict[str, Path] = {}
_run_ids: dict[str, str] = {}


@pytest.fixture
def finished(tiny_token_shards, tracking, tmp_path_factory):
    """(losses, final weights) of an uninterrupted job under a layout (run once)."""

    def get(layout: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        if layout not in _finished:
            world, parallel = (1, {}) if layout == "single" else LAYOUTS[layout]
            work = tmp_path_factory.mktemp(layout)
            run_id = _run(tiny_token_shards, work, _config(world, parallel), tracking)
            _finished[layout] = (_losses(tracking, run_id), _weights(work))
            _work[layout], _run_ids[layout] = work, run_id
        return _finished[layout]

    return get


def _assert_same_training(got, want) -> None:
    assert_same_training(got, want, GPT_JOB["train"]["max_steps"], LOSS_RTOL, WEIGHT_ATOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_what_one_rank_trains(layout, finished) -> None:
    _assert_same_training(finished(layout), finished("single"))


def test_pipeline_and_sharded_layouts_report_their_waiting(finished, tracking) -> None:
    """The time breakdown keeps working: collectives inside a sharded forward and backward
    are sync wait; a pipeline stage's idle time is its bubble."""
    for name in ("fsdp-tp", "pp-1f1b"):
        finished(name)
        metrics = client(tracking[0]).get_run(_run_ids[name]).data.metrics
        world = LAYOUTS[name][0]
        assert all(f"time_sync_wait_s/rank{r}" in metrics for r in range(world))
        assert metrics["time_fraction_sync_wait"] > 0
        bubble = metrics["time_fraction_pipeline_bubble"]
        assert (bubble > 0) if name.startswith("pp") else (bubble == 0)


def test_a_checkpoint_resumes_under_other_layouts(
    tiny_token_shards, tracking, finished, tmp_path, monkeypatch
) -> None:
    """Saved under dp_shard=2 (the job dies at step 12; step 8 is on disk), resumed under
    dp_shard=4 into the same MLflow run, and (from copies of the job) under FSDP x TP and
    on one rank: each the loss curve and weights of an uninterrupted job. The copies go
    into new runs, which receive the first attempt's metrics from the job's journal."""
    monkeypatch.setenv("GRADLINE_FAULT", "kill:rank=1:step=12:attempt=0")
    uri, experiment = tracking
    original = tmp_path / "dp_shard=4"
    run_id = client(uri).create_run(experiment).info.run_id
    with pytest.raises(TrainingFailed):
        _run(tiny_token_shards, original, _config(2, {"dp_shard": 2}), tracking, run_id)
    monkeypatch.delenv("GRADLINE_FAULT")
    assert sorted(p.name for p in (original / "ckpt").glob("step-*")) == ["step-00000008"]
    resumes = {original: (4, {"dp_shard": 4}, run_id)}
    for name, world, parallel in [("fsdp2xtp2", 4, {"dp_shard": 2, "tp": 2}), ("one", 1, {})]:
        shutil.copytree(original, tmp_path / name)
        resumes[tmp_path / name] = (world, parallel, None)
    eval_batch = _uneven_eval_batch(tiny_token_shards, 4)
    for work, (world, parallel, into) in resumes.items():
        cfg = _config(world, parallel, eval_batch)
        resumed_run = _run(tiny_token_shards, work, cfg, tracking, into)
        # From the step-8 checkpoint that 2 ranks wrote under dp_shard=2, by this layout.
        written = {"written_by": 2, "written_mesh": {"dp_shard": 2}}
        expected_mesh = parallel if world > 1 else {}
        resumed = Resumed(8, **written, resumed_by=world, resumed_mesh=expected_mesh)
        assert_resumed(work / "ckpt", resumed)
        got = (_losses(tracking, resumed_run), _weights(work))
        _assert_same_training(got, finished("single"))


@pytest.mark.parametrize("layout", ["fsdp", "pp-1f1b"])
def test_killed_rank_restarts_and_ends_bitwise_identical(
    layout, tiny_token_shards, tracking, finished, tmp_path, monkeypatch
) -> None:
    _, expected = finished(layout)
    monkeypatch.setenv("GRADLINE_FAULT", "kill:rank=1:step=12:attempt=0")
    world, parallel = LAYOUTS[layout]
    _run(tiny_token_shards, tmp_path, _config(world, parallel), tracking, restarts=1)
    weights = _weights(tmp_path)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_consolidated_model_is_one_whole_model(finished) -> None:
    """The registry gets the whole model whatever the layout: a pipeline-trained model
    loads alone, with every stage's blocks, and generates."""
    from training.objectives.language_modeling import generate

    finished("pp-1f1b")
    model, _ = load_model_dir(_work["pp-1f1b"] / "model")
    assert list(model.blocks) == ["0", "1", "2", "3"]
    assert model.token_embedding is not None and model.head is not None
    out = generate(model, torch.zeros((1, 3), dtype=torch.int64), 5, temperature=0)
    assert out.shape == (1, 8)
