"""Update rules, gradient compression and measured balance through the real launcher
(CPU, gloo, one thread per rank): their degenerate cases reproduce synchronous training,
their bytes are counted on the wire, a slow rank's share shrinks without changing what
is computed, and every rule resumes exactly after SIGKILL and SIGTERM.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training.config import Config
from training.engine.launch import Preempted, launch_workers
from training.mlops.tracking import client, ensure_experiment
from training.models.folder import load_model_dir

from .conftest import train_job
from .resume_checks import Resumed, assert_resume_tags, assert_resumed, stopped_steps

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

JOB = {
    "data": {"source": "stdlib"},
    "task": {"type": "language_modeling"},
    "evaluate": {"prompts": ["def "], "max_new_tokens": 4},
    "model": {"name": "gpt", "layers": 2, "heads": 2, "width": 32, "context": 16},
    "optim": {"lr": 0.01, "warmup_steps": 5},
    "train": {"epochs": 1, "max_steps": 20, "batch_size": 16},
    "runtime": {
        "procs_per_node": 2,
        "checkpoint_every_steps": 4,
        "log_every_steps": 2,
        "control_every_steps": 2,
    },
}
# Rules with state of their own between syncs; H=3 puts checkpoints (every 4 steps)
# and the stops below in the middle of local phases.
RULES = {
    "sync": {},
    "local_sgd": {"update": {"rule": "local_sgd", "sync_every": 3, "sync_warmup_steps": 2}},
    "diloco": {"update": {"rule": "diloco", "sync_every": 3}},
    "powersgd": {"update": {"grad_compression": "powersgd", "powersgd_rank": 2}},
    # A staleness bound of 0 makes the parameter server lockstep: deterministic.
    "async": {"update": {"rule": "async", "max_staleness": 0}},
}


def _config(changes: dict) -> Config:
    """The job with `changes` (section -> keys) applied."""
    return Config.model_validate({**JOB, **changes})


@pytest.fixture(scope="module")
def tracking(tmp_path_factory) -> tuple[str, str]:
    base = tmp_path_factory.mktemp("updates-mlflow")
    uri = f"sqlite:///{base / 'mlflow.db'}"
    return uri, ensure_experiment(uri, "updates", (base / "artifacts").as_uri())


def _train(shards: Path, work: Path, changes: dict, tracking, run_id=None, restarts=0):
    """Train into an MLflow run (new unless given); return (run id, rank 0's result)."""
    uri, experiment = tracking
    run_id = run_id or client(uri).create_run(experiment).info.run_id
    cfg = _config(changes)
    result = launch_workers(train_job(shards, work, cfg, (uri, run_id)), 2, restarts)
    return run_id, result


def _losses(tracking, run_id: str) -> list[float]:
    history = client(tracking[0]).get_metric_history(run_id, "train_loss")
    steps = [m.step for m in history]
    assert sorted(steps) == list(range(1, JOB["train"]["max_steps"] + 1)), "one loss per step"
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def _weights(work: Path) -> dict[str, torch.Tensor]:
    return load_model_dir(work / "model")[0].state_dict()


def _assert_same_training(tracking, got: tuple[str, Path], want: tuple[str, Path]) -> None:
    """Losses of two (run id, work folder) jobs agree to 1e-5 at every step, weights to
    1e-3 as in the layout tests (test_parallel): parameters whose true gradient is zero
    (attention key biases) take Adam steps of rounding noise in any split."""
    torch.testing.assert_close(
        torch.tensor(_losses(tracking, got[0])),
        torch.tensor(_losses(tracking, want[0])),
        rtol=1e-5,
        atol=0,
    )
    got_weights, want_weights = _weights(got[1]), _weights(want[1])
    for name, value in want_weights.items():
        torch.testing.assert_close(got_weights[name], value, rtol=0, atol=1e-3, msg=name)


_done: dict[str, tuple[str, dict, Path]] = {}


@pytest.fixture
def uninterrupted(tiny_token_shards, tracking, tmp_path_factory):
    """(run id, result, work folder) of an uninterrupted job under a rule (run once)."""

    def get(name: str, changes: dict | None = None):
        if name not in _done:
            work = tmp_path_factory.mktemp(name)
            run_id, result = _train(tiny_token_shards, work, changes or RULES[name], tracking)
            _done[name] = (run_id, result, work)
        return _done[name]

    return get


def test_local_sgd_syncing_every_step_reproduces_sync(uninterrupted, tracking) -> None:
    """H=1: every step ends with the replicas averaged. With Adam, the average of two
    replicas' updates is not the update of their averaged gradient, so the two agree
    closely, not bitwise: losses within 2% at every step."""
    sync_run, _, _ = uninterrupted("sync")
    local_run, _, _ = uninterrupted(
        "local_sgd-1", {"update": {"rule": "local_sgd", "sync_every": 1}}
    )
    torch.testing.assert_close(
        torch.tensor(_losses(tracking, local_run)),
        torch.tensor(_losses(tracking, sync_run)),
        rtol=2e-2,
        atol=0,
    )


def test_async_with_no_staleness_reproduces_sync(uninterrupted, tracking) -> None:
    """max_staleness 0: every server step averages gradient n of every worker, all
    computed on the same parameters: synchronous training by another route."""
    (sync_run, _, sync_work), (async_run, _, async_work) = (
        uninterrupted("sync"),
        uninterrupted("async"),
    )
    _assert_same_training(tracking, (async_run, async_work), (sync_run, sync_work))


def test_async_bounds_staleness_and_keeps_a_slow_rank_from_holding_others_back(
    tracking, tmp_path, tiny_token_shards, monkeypatch
) -> None:
    """Rank 1 computes 3x slower and the job is killed and stopped on the way: it still
    completes every server step once, rank 0 computes more gradients than rank 1, and
    no applied gradient is staler than the bound."""
    monkeypatch.setenv(
        "GRADLINE_FAULT",
        "slow:rank=1:factor=3;kill:rank=1:step=4:attempt=0;term:rank=0:step=10:attempt=1",
    )
    uri, experiment = tracking
    run_id = client(uri).create_run(experiment).info.run_id
    changes = {"update": {"rule": "async", "max_staleness": 2}}
    with pytest.raises(Preempted):
        _train(tiny_token_shards, tmp_path, changes, tracking, run_id, restarts=1)
    monkeypatch.setenv("GRADLINE_FAULT", "slow:rank=1:factor=3")
    _train(tiny_token_shards, tmp_path, changes, tracking, run_id)
    _losses(tracking, run_id)  # one loss per server step
    mlflow = client(uri)
    staleness = mlflow.get_metric_history(run_id, "async_staleness_max")
    assert staleness and max(m.value for m in staleness) <= 2
    assert max(m.value for m in staleness) >= 1  # the fast rank did not wait every step
    done = mlflow.get_run(run_id).data.metrics
    assert done["async_gradients/rank0"] > done["async_gradients/rank1"]


def test_bytes_per_step_are_counted_on_the_wire(uninterrupted) -> None:
    """Local SGD with H=4 (no warmup) sends one parameter average per 4 steps: 1/4 of
    sync's gradient all-reduces. fp16 halves them; PowerSGD sends low-rank factors."""
    sync = uninterrupted("sync")[1]["comm_bytes_per_step"]
    local = uninterrupted("local_sgd-4", {"update": {"rule": "local_sgd", "sync_every": 4}})[1]
    fp16 = uninterrupted("fp16", {"update": {"grad_compression": "fp16"}})[1]
    powersgd = uninterrupted("powersgd")[1]
    assert sync > 0
    assert local["comm_bytes_per_step"] / sync == pytest.approx(1 / 4, rel=1e-9)
    assert fp16["comm_bytes_per_step"] / sync == pytest.approx(1 / 2, rel=1e-9)
    assert powersgd["comm_bytes_per_step"] / sync < 0.5


def test_measured_balance_moves_rows_off_a_slow_rank_and_computes_the_same(
    uninterrupted, tracking, tmp_path, tiny_token_shards, monkeypatch
) -> None:
    """Rank 1 computes 3x slower: its share of each global batch shrinks, while the rows
    of each step and the gradient stay those of the even split (the same training, up
    to summation order)."""
    even_run, _, even_work = uninterrupted("sync")
    monkeypatch.setenv("GRADLINE_FAULT", "slow:rank=1:factor=3")
    changes = {"parallel": {"balance": "measured", "balance_every_logs": 1}}
    run_id, _ = _train(tiny_token_shards, tmp_path, changes, tracking)
    shares = client(tracking[0]).get_metric_history(run_id, "batch_share/rank1")
    assert shares and min(m.value for m in shares) < 0.5
    _assert_same_training(tracking, (run_id, tmp_path), (even_run, even_work))


@pytest.mark.parametrize("name", list(RULES))
def test_each_rule_resumes_exactly_after_sigkill_and_sigterm(
    name, uninterrupted, tracking, tmp_path, tiny_token_shards, monkeypatch
) -> None:
    """Rank 1 is killed at step 6 (the job restarts from the step-4 checkpoint, inside a
    local phase); on the restart, the launcher gets SIGTERM at step 10 and the job stops
    with a checkpoint; run again, it ends bitwise identical to an uninterrupted job, in
    the same MLflow run with one loss per step."""
    _, _, expected_work = uninterrupted(name)
    monkeypatch.setenv(
        "GRADLINE_FAULT", "kill:rank=1:step=6:attempt=0;term:rank=0:step=10:attempt=1"
    )
    uri, experiment = tracking
    run_id = client(uri).create_run(experiment).info.run_id
    # Checkpoints written in the loop: an asynchronous one still in flight when rank 1
    # dies is lost, and the restart would (rightly) begin at step 0, not where it claims.
    changes = {**RULES[name], "runtime": {**JOB["runtime"], "async_checkpoint": False}}
    with pytest.raises(Preempted) as stop:
        _train(tiny_token_shards, tmp_path, changes, tracking, run_id, restarts=1)
    (stopped,) = stopped_steps(str(stop.value))
    _train(tiny_token_shards, tmp_path, changes, tracking, run_id)
    # The restart resumed from step 4's checkpoint, the rerun from the one the stop wrote
    # (at step 10 or soon after): never from step 0.
    assert stopped >= 10
    resumed = [Resumed(4, written_by=2, resumed_by=2), Resumed(stopped, written_by=2, resumed_by=2)]
    assert_resumed(tmp_path / "ckpt", *resumed)
    assert_resume_tags(client(uri), run_id, resumed)
    _losses(tracking, run_id)
    got, want = _weights(tmp_path), _weights(expected_work)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), name
