"""Checkpoints: atomic, pruned, verified; a corrupt newest one falls back to the previous."""

from __future__ import annotations

import logging

import torch

from training.engine.checkpoint import list_checkpoints, load_latest, save_checkpoint


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((3,), value)}, "loader": {"version": 1}}


def test_keeps_newest_k_and_loads_latest(tmp_path) -> None:
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, _state(step), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000040.pt", "ckpt-00000030.pt"]
    _, state = load_latest(tmp_path)
    assert state["step"] == 40 and torch.equal(state["model"]["w"], torch.full((3,), 40.0))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_truncated_latest_falls_back_with_warning(tmp_path, caplog) -> None:
    save_checkpoint(tmp_path, 1, _state(1), keep=3)
    newest = save_checkpoint(tmp_path, 2, _state(2), keep=3)
    newest.write_bytes(newest.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        _, state = load_latest(tmp_path)
    assert state["step"] == 1
    assert "checksum mismatch" in caplog.text


def test_no_checkpoint_means_fresh_start(tmp_path) -> None:
    assert load_latest(tmp_path / "missing") is None


def test_async_checkpointer_writes_a_snapshot_not_the_live_state(tmp_path) -> None:
    from training.engine.checkpoint import Checkpointer

    saved = []
    writer = Checkpointer(tmp_path, keep=2, asynchronous=True, on_saved=lambda *a: saved.append(a))
    live = {"model": {"w": torch.zeros(3)}}
    writer.save(5, live, {"train_loss": 1.0})
    live["model"]["w"] += 7  # training goes on while the writer thread works
    writer.close()
    _, state = load_latest(tmp_path)
    assert torch.equal(state["model"]["w"], torch.zeros(3))
    assert saved[0][1:] == (5, {"train_loss": 1.0})
