"""Checkpoints: sharded (DCP), complete or absent, pruned, verified; a corrupt newest one
falls back to the previous; async saves hold the values at save time."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from training.engine.checkpoint import (
    Checkpointer,
    CorruptCheckpoint,
    checkpoint_dir,
    find_latest,
    list_checkpoints,
    load_into,
    load_model_weights,
    signed_manifest,
    verify,
)
from training.engine.worker_start import start_method

# Saves without a process group are single-process saves; DCP says so each time.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((3,), value)}, "optim": {"m": torch.full((2,), -value)}}


def _save(directory: Path, step: int, keep: int, asynchronous: bool = False, **kw) -> Path:
    writer = Checkpointer(directory, keep, asynchronous, is_main=True, **kw)
    writer.save(step, _state(step), {"step": step}, {"train_loss": 1.0})
    writer.close()
    return checkpoint_dir(directory, step)


def _loaded(path: Path) -> dict:
    target = _state(0)
    load_into(path, target)
    return target


def test_keeps_newest_k_and_loads_latest(tmp_path) -> None:
    writer = Checkpointer(tmp_path, keep=2, asynchronous=False, is_main=True)
    for step in (10, 20, 30, 40):
        writer.save(step, _state(step), {"step": step, "loader": {"epoch": 1}}, {})
    writer.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000040", "step-00000030"]
    path, train_state = find_latest(tmp_path)
    assert train_state == {"step": 40, "loader": {"epoch": 1}, "format": 3}
    state = _loaded(path)
    assert torch.equal(state["model"]["w"], torch.full((3,), 40.0))
    assert torch.equal(state["optim"]["m"], torch.full((2,), -40.0))
    assert not list(tmp_path.glob("*.tmp"))


def test_same_step_is_saved_once(tmp_path) -> None:
    writer = Checkpointer(tmp_path, keep=2, asynchronous=False, is_main=True)
    writer.save(5, _state(5), {"step": 5}, {})
    assert writer.save(5, _state(6), {"step": 5}, {}) == 0.0
    writer.close()
    assert torch.equal(_loaded(checkpoint_dir(tmp_path, 5))["model"]["w"], torch.full((3,), 5.0))


def test_truncated_shard_falls_back_with_warning(tmp_path, caplog) -> None:
    _save(tmp_path, 1, keep=3)
    newest = _save(tmp_path, 2, keep=3)
    (shard,) = newest.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(CorruptCheckpoint, match=shard.name):
        verify(newest)
    with caplog.at_level(logging.WARNING):
        path, train_state = find_latest(tmp_path)
    assert path.name == "step-00000001" and train_state["step"] == 1
    assert f"{newest}: file checksum mismatch ({shard.name} is truncated" in caplog.text
    assert "falling back to the previous one" in caplog.text


@pytest.mark.parametrize(
    ("damage", "cause"),
    [
        (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
        (lambda p: (p / "sha256.json").unlink(), "sha256.json is missing"),
        (lambda p: (p / "train_state.json").unlink(), "train_state.json is missing"),
    ],
)
def test_missing_file_is_corrupt(tmp_path, damage, cause) -> None:
    path = _save(tmp_path, 1, keep=3)
    damage(path)
    with pytest.raises(CorruptCheckpoint, match=cause):
        verify(path)


def test_another_format_is_corrupt(tmp_path) -> None:
    path = _save(tmp_path, 1, keep=3)
    (path / "train_state.json").write_text(json.dumps({"step": 1, "format": 1}))
    # Re-signed by the key's holder: a format this gradline does not read, not tampering.
    files = json.loads((path / "sha256.json").read_text())["files"]
    files["train_state.json"] = hashlib.sha256((path / "train_state.json").read_bytes())
    files["train_state.json"] = files["train_state.json"].hexdigest()
    (path / "sha256.json").write_text(json.dumps(signed_manifest(path, files)))
    with pytest.raises(CorruptCheckpoint, match="format 1"):
        verify(path)


def test_torn_save_is_never_listed_or_loaded(tmp_path) -> None:
    _save(tmp_path, 1, keep=3)
    torn = _save(tmp_path / "elsewhere", 2, keep=3)
    torn.rename(tmp_path / "step-00000002.tmp")  # complete files, but never renamed
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001"]
    assert find_latest(tmp_path)[1]["step"] == 1
    # A later save removes the torn folder of an older step.
    _save(tmp_path, 3, keep=3)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_job_starts_by_removing_torn_saves_and_a_save_keeps_its_own_folder(tmp_path) -> None:
    """Rank 0 removes a killed attempt's torn folders as the job starts, the newest step's
    included; never during a save, where another rank may have made the step's folder
    already (DCP makes it on every rank as the save begins)."""
    for step in (4, 9):
        (tmp_path / f"step-{step:08d}.tmp").mkdir()
        (tmp_path / f"step-{step:08d}.tmp" / "__3_0.distcp").write_bytes(b"old")
    runtime = SimpleNamespace(async_checkpoint=False, keep_checkpoints=2)
    tracker = SimpleNamespace(log_checkpoint=None)
    other_rank = Checkpointer.for_job(SimpleNamespace(is_main=False), tmp_path, runtime, tracker)
    assert len(list(tmp_path.glob("*.tmp"))) == 2  # only rank 0 removes them
    writer = Checkpointer.for_job(SimpleNamespace(is_main=True), tmp_path, runtime, tracker)
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "step-00000009.tmp").mkdir()  # as another rank's save makes it first
    writer.save(9, _state(9), {"step": 9}, {})
    other_rank.close()
    writer.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000009"]
    assert torch.equal(_loaded(checkpoint_dir(tmp_path, 9))["model"]["w"], torch.full((3,), 9.0))


def test_no_checkpoint_means_fresh_start(tmp_path) -> None:
    assert find_latest(tmp_path / "missing") is None


def test_async_save_writes_the_values_at_save_time(tmp_path) -> None:
    saved = []
    writer = Checkpointer(
        tmp_path, keep=2, asynchronous=True, is_main=True, on_saved=lambda *a: saved.append(a)
    )
    live = {"model": {"w": torch.zeros(1000, 100)}, "optim": {"m": torch.zeros(2)}}
    writer.save(5, live, {"step": 5}, {"train_loss": 1.0})
    live["model"]["w"] += 7  # training goes on while the checkpoint is written
    live["optim"]["m"] += 7
    writer.save(6, live, {"step": 6}, {"train_loss": 0.5})  # waits for step 5 first
    live["model"]["w"] += 1
    writer.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000006", "step-00000005"]
    five = {"model": {"w": torch.ones(1000, 100)}, "optim": {"m": torch.ones(2)}}
    load_into(checkpoint_dir(tmp_path, 5), five)
    assert torch.equal(five["model"]["w"], torch.zeros(1000, 100))
    assert torch.equal(five["optim"]["m"], torch.zeros(2))
    six = {"model": {"w": torch.ones(1000, 100)}}
    load_into(checkpoint_dir(tmp_path, 6), six)
    assert torch.equal(six["model"]["w"], torch.full((1000, 100), 7.0))
    assert [(Path(p).name, s, m) for p, s, m in saved] == [
        ("step-00000005", 5, {"train_loss": 1.0}),
        ("step-00000006", 6, {"train_loss": 0.5}),
    ]


def test_async_failure_is_raised_by_the_next_wait(tmp_path) -> None:
    def broken(*_):
        raise OSError("disk full")

    writer = Checkpointer(tmp_path, keep=2, asynchronous=True, is_main=True, on_saved=broken)
    writer.save(1, _state(1), {"step": 1}, {})
    with pytest.raises(OSError, match="disk full"):
        writer.close()


def test_load_model_weights_reads_the_model_only(tmp_path) -> None:
    torch.manual_seed(0)
    trained = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optim = {"exp_avg": torch.randn(3, 4), "lr": 0.1}
    writer = Checkpointer(tmp_path, keep=1, asynchronous=False, is_main=True)
    writer.save(7, {"model": trained.state_dict(), "optim": optim}, {"step": 7}, {})
    writer.close()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    load_model_weights(checkpoint_dir(tmp_path, 7), fresh)
    for name, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


class _Parts(torch.nn.Module):
    """The full (unsharded) model that the two ranks below save parts of."""

    def __init__(self) -> None:
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.zeros(3))
        self.w1 = torch.nn.Parameter(torch.zeros(3))
        self.shared = torch.nn.Parameter(torch.zeros(8))


def _rank_saves_its_part(rank: int, directory: str, store: str) -> None:
    """One rank of two: each saves a different tensor and its half of a sharded one."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from training.engine.topology import end_process_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    topo = SimpleNamespace(is_main=rank == 0, world_size=2)
    runtime = SimpleNamespace(keep_checkpoints=1, async_checkpoint=True)
    tracker = SimpleNamespace(log_checkpoint=lambda path, step, metrics: None)
    writer = Checkpointer.for_job(topo, Path(directory), runtime, tracker)
    assert writer.group is not None
    own = torch.full((3,), float(rank + 1))
    shared = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    for step in (1, 2):
        model = {f"w{rank}": own, "shared": shared}
        writer.save(step, {"model": model}, {"step": step, "world_size": 2}, {})
        own += 10  # the live values move on; each checkpoint keeps its own
        shared.to_local().add_(10)
        dist.barrier()  # training-thread collectives while the save runs in the background
    writer.close()
    dist.barrier()
    end_process_groups()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_every_rank_writes_its_part_before_the_checkpoint_completes(tmp_path) -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.start_processes(
        _rank_saves_its_part,
        args=(str(tmp_path / "ckpt"), str(tmp_path / "store")),
        nprocs=2,
        join=False,
        start_method=start_method(),  # the engine's forkserver: torch imported once
    )
    deadline = time.monotonic() + 150  # a cold forkserver on a loaded 2-core host
    try:
        # join() returns when one process ends; it raises if one failed.
        while not context.join(timeout=max(deadline - time.monotonic(), 0)):
            if time.monotonic() > deadline:
                pytest.fail("the two ranks did not finish their saves in 150 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["step-00000002"]
    path, train_state = find_latest(tmp_path / "ckpt")
    assert train_state == {"step": 2, "world_size": 2, "format": 3}
    model = _Parts()
    load_model_weights(path, model)  # one process, full tensors: DCP reshards
    assert torch.equal(model.w0.data, torch.full((3,), 11.0))
    assert torch.equal(model.w1.data, torch.full((3,), 12.0))
    assert torch.equal(model.shared.data, torch.arange(8.0) + 10)


def test_checkpoint_copies_waiting_to_ship_are_bounded(tmp_path) -> None:
    # The tracking server is down: nothing ships, yet the disk holds at most `keep`
    # copies beyond the checkpoints themselves.
    from training.mlops.tracking import link_checkpoint

    for step in range(1, 6):
        link_checkpoint(_save(tmp_path, step, keep=2), keep=2)
    waiting = sorted(p.name for p in tmp_path.glob(".mlflow-*"))
    assert waiting == [".mlflow-step-00000004", ".mlflow-step-00000005"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000005", "step-00000004"]


def test_a_checkpoint_pruned_while_it_ships_still_lands_whole(tmp_path) -> None:
    """The writer prunes pending copies beyond `keep` while a slow helper ships the
    oldest: the helper's copy is its own, so every file lands and nothing fails."""
    from training.mlops.tracking import _ship, link_checkpoint

    pending = link_checkpoint(_save(tmp_path, 3, keep=1), keep=1)
    record = {"kind": "checkpoint", "path": str(pending), "name": "step-00000003", "step": 3}
    record["values"] = {"train_loss": 0.5}
    want = sorted(p.name for p in pending.iterdir())
    shipped = []

    class Client:
        def log_artifacts(self, run_id, local_dir, artifact_path):
            for step in (4, 5):  # training goes on meanwhile, keeping one copy waiting
                link_checkpoint(_save(tmp_path, step, keep=1), keep=1)
            shipped.append(sorted(p.name for p in Path(local_dir).iterdir()))

        def log_dict(self, run_id, payload, artifact_file):
            shipped.append(payload)

    _ship(Client(), "run", [record], {})
    assert shipped == [want, {"step": 3, "train_loss": 0.5}]
    left = sorted(p.name for p in tmp_path.glob(".mlflow-*"))
    assert left == [".mlflow-step-00000005"]  # the shipped copy is gone, the newest waits


def test_a_checkpoint_dropped_before_it_ships_is_skipped_and_nothing_is_left(tmp_path) -> None:
    """The writer drops the oldest pending copy first: the shipper skips its record."""
    from training.mlops.tracking import _ship, claim_pending, link_checkpoint

    oldest = link_checkpoint(_save(tmp_path, 3, keep=1), keep=1)
    link_checkpoint(_save(tmp_path, 4, keep=1), keep=1)  # drops step 3's copy
    assert claim_pending(oldest) is None
    record = {"kind": "checkpoint", "path": str(oldest), "name": "step-00000003", "step": 3}

    class Client:  # any call would be a shipped record that should have been skipped
        pass

    _ship(Client(), "run", [{**record, "values": {}}], {})
    assert sorted(p.name for p in tmp_path.glob(".mlflow-*")) == [".mlflow-step-00000004"]


def test_tracker_links_the_checkpoint_and_ships_it_once(tmp_path) -> None:
    from training.mlops.tracking import _ship, link_checkpoint

    path = _save(tmp_path, 3, keep=1)
    pending = link_checkpoint(path)
    assert pending.name == ".mlflow-step-00000003"
    assert list_checkpoints(tmp_path) == [path]  # never taken for a checkpoint
    record = {"kind": "checkpoint", "path": str(pending), "name": path.name, "step": 3}
    record["values"] = {"train_loss": 0.25}
    _save(tmp_path, 4, keep=1)  # prunes step 3: the links keep its files
    assert not path.exists()

    shipped = []

    class Client:
        def log_artifacts(self, run_id, local_dir, artifact_path):
            names = sorted(p.name for p in Path(local_dir).iterdir())
            shipped.append((artifact_path, names))

        def log_dict(self, run_id, payload, artifact_file):
            shipped.append((artifact_file, payload))

    _ship(Client(), "run", [record], {})
    _ship(Client(), "run", [record], {})  # a restarted shipper replays the journal
    files = shipped[0][1]
    assert shipped[0][0] == "checkpoints/step-00000003"
    assert {".metadata", "sha256.json", "train_state.json"} <= set(files)
    assert any(name.endswith(".distcp") for name in files)
    assert shipped[1:] == [
        ("checkpoints/step-00000003/metrics.json", {"step": 3, "train_loss": 0.25})
    ]
    assert not pending.exists()
