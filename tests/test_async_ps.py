"""The asynchronous parameter server (training.engine.async_ps), with real gloo processes.

Every rank trains a tiny Linear(8, 4) on deterministic random batches: global batch n has
11 rows, and rank w reads slice w of it (torch.tensor_split: shares of unequal size, so the
sample weighting counts). The synchronous reference is one process taking one AdamW step
per global batch on the mean loss over all its rows, with the same learning-rate schedule
and gradient clipping, applied through the server's `before_step` hook.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from training.engine.async_ps import AsyncUpdates, ParameterServerError, Segment, flat_params
from training.engine.worker_start import start_method

ROWS = 11  # rows of one global batch


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(8, 4)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def _before_step(version: int, params: list[nn.Parameter], optimizer) -> None:
    """What the lead does there: the learning rate of this step, then clipping."""
    for group in optimizer.param_groups:
        group["lr"] = 0.05 * (1.0 - version / 40)
    torch.nn.utils.clip_grad_norm_(params, 1.0)


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + n)
    x = torch.randn(ROWS, 8, generator=generator)
    return x, x[:, :4] * 2.0 - 1.0 + 0.1 * torch.randn(ROWS, 4, generator=generator)


def _compute(model: nn.Module, n: int, rank: int, world: int) -> tuple[float, int]:
    x, y = (t.tensor_split(world)[rank] for t in _batch(n))
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item(), len(x)


def _synchronous(steps: int) -> tuple[torch.Tensor, list[float]]:
    """One process, one AdamW step per global batch: the parameters and the losses."""
    model = _model()
    optimizer = _adamw(model)
    losses = []
    for n in range(steps):
        x, y = _batch(n)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        _before_step(n, list(model.parameters()), optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return flat_params(model), losses


def _updates(model: nn.Module, rank: int, world: int, staleness: int, timeout_s: float = 20.0):
    box = {}

    def make_optimizer(server_model: nn.Module):
        box["optimizer"] = _adamw(server_model)
        return box["optimizer"]

    def before_step(version, params):
        _before_step(version, params, box["optimizer"])

    return AsyncUpdates(model, make_optimizer, rank, world, staleness, before_step, timeout_s)


# -- running ranks -------------------------------------------------------------------------


def _rank_entry(rank: int, world: int, directory: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    # The first optimizer built in a process imports torch._dynamo (seconds): not inside
    # the tests' short timeouts.
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    store = dist.FileStore(os.path.join(directory, "store"), world)
    timeout = timedelta(seconds=30)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(directory, f"result-{rank}.pt"))
    except BaseException:
        Path(directory, f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    # No teardown: a test may leave a peer dead or asleep, and gloo's could wait on it.
    os._exit(0)


def _in_ranks(tmp_path: Path, world: int, fn, *args, deadline_s: float = 90, wait_for=None):
    """Run fn(rank, world, *args) in `world` gloo processes; their return values. Waits
    for the ranks in `wait_for` (all by default) and kills whatever is left."""
    # The engine's forkserver (torch imported once), not an interpreter per rank.
    context = multiprocessing.get_context(start_method())
    processes = [
        context.Process(target=_rank_entry, args=(rank, world, str(tmp_path), fn, args))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + deadline_s
    try:
        for rank in wait_for if wait_for is not None else range(world):
            processes[rank].join(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    errors = sorted(tmp_path.glob("error-*.txt"))
    if errors:
        pytest.fail("\n".join(f"{e.name}:\n{e.read_text()}" for e in errors))
    results = []
    for rank in range(world):
        path = tmp_path / f"result-{rank}.pt"
        if rank in (wait_for if wait_for is not None else range(world)):
            assert path.exists(), f"rank {rank} gave no result within {deadline_s} s"
        # The ranks' results hold Segments: allowed by name, nothing else runs on load.
        with torch.serialization.safe_globals([Segment]):
            results.append(torch.load(path, weights_only=True) if path.exists() else None)
    return results


def _train(rank, world, staleness, segments, delays=None, pause_s=0.0, timeout_s=20.0):
    """Run the segments; after each, gather every rank's model (an ordinary collective)
    and pause `pause_s`."""
    model = _model()
    updates = _updates(model, rank, world, staleness, timeout_s)
    seen = []

    def compute(n: int) -> tuple[float, int]:
        seen.append(n)
        if delays:
            time.sleep(delays[rank])
        return _compute(model, n, rank, world)

    out = {"segments": [], "seen": seen}
    for until in segments:
        segment = updates.run_segment(until, compute)
        models = [torch.empty_like(flat_params(model)) for _ in range(world)]
        dist.all_gather(models, flat_params(model))
        server = flat_params(updates.server_model) if rank == 0 else None
        out["segments"].append(
            {"segment": segment, "models": models, "server": server, "version": updates.version}
        )
        time.sleep(pause_s)
    out["next_gradient"] = [updates.next_gradient(w) for w in range(world)]
    updates.close()  # joins rank 0's proxies: the last reply they sent is counted
    out["bytes_sent"], out["wait_seconds"] = updates.bytes_sent, updates.wait_seconds
    return out


# -- the tests -----------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_staleness_zero_is_synchronous_data_parallel(tmp_path) -> None:
    steps = 12
    results = _in_ranks(tmp_path, 2, _train, 0, [steps])
    expected, losses = _synchronous(steps)
    for rank, result in enumerate(results):
        (end,) = result["segments"]
        torch.testing.assert_close(end["models"][rank], expected, rtol=1e-5, atol=1e-7)
        segment = end["segment"]
        assert (segment.start_version, segment.version) == (0, steps)
        torch.testing.assert_close(segment.losses, losses, rtol=1e-5, atol=1e-7)
        assert segment.gradients == [steps, steps] and segment.next_gradient == [steps, steps]
        assert segment.staleness_max == 0 and segment.applied == 2 * steps
        assert result["seen"] == list(range(steps))  # gradient n on global batch n
        assert result["wait_seconds"] > 0
    torch.testing.assert_close(results[0]["segments"][0]["server"], expected, rtol=1e-5, atol=1e-7)
    # Bytes are counted as they are sent. Rank 1: 13 pull requests (the last one meets
    # the barrier) and 12 pushes of a header and 36 float32 gradients.
    header, vector = 64, 4 * 36
    assert results[1]["bytes_sent"] == 13 * header + 12 * (header + vector)
    # Rank 0: its replies to rank 1, the barrier's with the segment statistics.
    stats = 8 * results[1]["segments"][0]["segment"].to_tensor().numel()
    assert results[0]["bytes_sent"] == 13 * (header + vector) + stats


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_slow_worker_lags_but_never_beyond_the_staleness_bound(tmp_path) -> None:
    results = _in_ranks(tmp_path, 2, _train, 2, [15, 30], [0.01, 0.03])
    for result in results:
        segments = [s["segment"] for s in result["segments"]]
        assert [s.version for s in segments] == [15, 30]
        assert [len(s.losses) for s in segments] == [15, 15]
        assert all(s.staleness_max <= 2 for s in segments)
        assert max(s.staleness_max for s in segments) >= 1  # it did run asynchronously
        fast, slow = (sum(s.gradients[w] for s in segments) for w in (0, 1))
        assert fast > slow
        assert [fast, slow] == result["next_gradient"]
    assert results[0]["segments"][-1]["segment"] == results[1]["segments"][-1]["segment"]
    for rank, result in enumerate(results):  # each worker's gradients are numbered 0, 1, ...
        assert result["seen"] == list(range(result["next_gradient"][rank]))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_at_each_barrier_every_rank_holds_the_server_parameters(tmp_path) -> None:
    # Three workers (two proxy threads) and s=1: gradients are in flight at the barriers.
    # The pause between segments outlasts the timeout: no wait is armed while paused.
    delays = [0.0, 0.002, 0.004]
    results = _in_ranks(tmp_path, 3, _train, 1, [5, 10], delays, 5.0, 4.0)
    for index, until in enumerate((5, 10)):
        server = results[0]["segments"][index]["server"]
        for result in results:
            end = result["segments"][index]
            assert end["version"] == until
            for model in end["models"]:
                assert torch.equal(model, server)
    segment = results[0]["segments"][1]["segment"]
    assert (segment.start_version, segment.version) == (5, 10)
    assert segment.staleness_max <= 1


def _resume(rank: int, world: int, directory: str):
    """An uninterrupted 0 -> 12, then 0 -> 6, save, new objects on other weights, load,
    6 -> 12; both with s=0."""
    uninterrupted = _train(rank, world, 0, [12])["segments"][0]["models"][rank]

    model = _model()
    updates = _updates(model, rank, world, 0)
    updates.run_segment(6, lambda n: _compute(model, n, rank, world))
    path = os.path.join(directory, "async.pt")
    if rank == 0:
        state = {
            "async": updates.state_dict(),
            "model": updates.server_model.state_dict(),
            "optimizer": updates.server_optimizer.state_dict(),
        }
        torch.save(state, path)
    updates.close()
    dist.barrier()

    state = torch.load(path, weights_only=True)
    model = _model(seed=1)  # other initial weights: the loaded ones must win
    updates = _updates(model, rank, world, 0)
    updates.load_state_dict(state["async"])
    if rank == 0:
        updates.server_model.load_state_dict(state["model"])
        updates.server_optimizer.load_state_dict(state["optimizer"])
    positions = [updates.next_gradient(w) for w in range(world)]
    seen = []

    def compute(n: int) -> tuple[float, int]:
        seen.append(n)
        return _compute(model, n, rank, world)

    segment = updates.run_segment(12, compute)
    updates.close()
    return {
        "uninterrupted": uninterrupted,
        "resumed": flat_params(model),
        "positions": positions,
        "seen": seen,
        "segment": segment,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_resume_from_state_dict_is_exact(tmp_path) -> None:
    results = _in_ranks(tmp_path, 2, _resume, str(tmp_path))
    expected, _ = _synchronous(12)
    for result in results:
        assert result["positions"] == [6, 6]
        assert result["seen"] == list(range(6, 12))
        assert torch.equal(result["resumed"], result["uninterrupted"])
        torch.testing.assert_close(result["resumed"], expected, rtol=1e-5, atol=1e-7)
        assert (result["segment"].start_version, result["segment"].version) == (6, 12)


def _peer_fails(rank: int, world: int, how: str):
    model = _model()
    updates = _updates(model, rank, world, 0, timeout_s=4.0)

    def compute(n: int) -> tuple[float, int]:
        if rank == 1 and n == 2:
            if how == "dies":
                os._exit(0)
            time.sleep(30)  # stalls
        return _compute(model, n, rank, world)

    started = time.monotonic()
    with pytest.raises(ParameterServerError) as failure:
        updates.run_segment(9 if how == "disagrees" and rank == 1 else 10, compute)
    elapsed = time.monotonic() - started
    if rank == 0:
        with pytest.raises(ParameterServerError):  # stays raised on the next call
            updates.check()
    updates.close()
    return {"message": str(failure.value), "elapsed": elapsed}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_dead_or_silent_worker_is_named_on_rank_0(tmp_path, how) -> None:
    result, _ = _in_ranks(tmp_path, 2, _peer_fails, how, wait_for=[0])
    assert "worker 1 (rank 1)" in result["message"]
    if how == "stalls":
        assert "computing n=2" in result["message"]
    # Named by the 4 s timeout, not once the 30 s stall ends (with room for a loaded host).
    assert result["elapsed"] < 25


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_server_failure_reaches_the_other_workers(tmp_path) -> None:
    # Rank 1 asks for a segment to version 9, rank 0 to 10: the server refuses.
    on_rank_0, on_rank_1 = _in_ranks(tmp_path, 2, _peer_fails, "disagrees")
    assert "worker 1 runs a segment to version 9, rank 0 to 10" in on_rank_0["message"]
    assert "the parameter server on rank 0 failed" in on_rank_1["message"]
    assert on_rank_1["elapsed"] < 30  # told, not left to wait (room for a loaded host)


def test_one_worker_in_one_process_without_torch_distributed() -> None:
    model = _model()
    updates = _updates(model, 0, 1, 0)
    segment = updates.run_segment(8, lambda n: _compute(model, n, 0, 1))
    expected, losses = _synchronous(8)
    torch.testing.assert_close(flat_params(model), expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(segment.losses, losses, rtol=1e-5, atol=1e-7)
    assert updates.bytes_sent == 0.0 and updates.version == 8
    state = updates.state_dict()
    assert state["version"] == 8 and state["next_gradient"] == [8]
    updates.close()


def test_a_failing_step_hook_surfaces_on_the_caller() -> None:
    def before_step(version, params):
        if version == 3:
            raise ValueError("bad learning rate")

    model = _model()
    updates = AsyncUpdates(model, _adamw, 0, 1, 1, before_step, timeout_s=10.0)
    with pytest.raises(ParameterServerError, match="step 3 failed") as failure:
        updates.run_segment(8, lambda n: _compute(model, n, 0, 1))
    assert isinstance(failure.value.__cause__, ValueError)
    updates.close()


def test_the_server_drops_a_non_finite_gradient_and_stays_finite() -> None:
    # A NaN loss at step 3 makes a NaN gradient: the server drops that step instead of
    # letting the NaN into the weights every replica pulls next.
    model = _model()
    updates = _updates(model, 0, 1, 0)

    def compute(n: int) -> tuple[float, int]:
        loss, rows = _compute(model, n, 0, 1)
        if n == 3:
            for p in model.parameters():
                p.grad.fill_(float("nan"))
        return loss, rows

    updates.run_segment(8, compute)
    assert updates.version == 8  # the dropped step still counts as a step
    assert updates._server.nonfinite_steps == 1
    assert torch.isfinite(flat_params(model)).all()
    updates.close()
