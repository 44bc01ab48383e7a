"""Checkpoints: atomic, checksummed, newest K kept, loaded with weights_only=True.

A checkpoint holds everything needed to continue exactly: model, optimizer, step and the
data position. Random streams are a pure function of (seed, rank, step) in the loop, so
no RNG state needs saving. Each file `ckpt-<step>.pt` has a sidecar `.sha256`; a file
that fails its checksum or does not load is skipped with a warning, and the previous one
is used.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
from pathlib import Path
from typing import Any

import torch

from training.atomic import atomic_file

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Newest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)


def save_checkpoint(directory: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write atomically (temp, fsync, rename), then its checksum, then prune old ones."""
    buffer = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, "step": step, **state}, buffer)
    payload = buffer.getvalue()
    path = checkpoint_path(directory, step)
    with atomic_file(path) as handle:
        handle.write(payload)
    with atomic_file(path.with_suffix(".sha256"), "w") as handle:
        handle.write(hashlib.sha256(payload).hexdigest() + "\n")
    for old in list_checkpoints(directory)[keep:]:
        old.unlink(missing_ok=True)
        old.with_suffix(".sha256").unlink(missing_ok=True)
    return path


class CorruptCheckpoint(Exception):
    pass


def load_checkpoint(path: Path) -> dict[str, Any]:
    payload = path.read_bytes()
    sidecar = path.with_suffix(".sha256")
    if not sidecar.is_file():
        raise CorruptCheckpoint(f"{path}: checksum file {sidecar.name} is missing")
    if hashlib.sha256(payload).hexdigest() != sidecar.read_text().strip():
        raise CorruptCheckpoint(f"{path}: checksum mismatch (truncated or corrupt)")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CorruptCheckpoint(f"{path}: cannot be loaded ({exc})") from exc
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CorruptCheckpoint(f"{path}: format {state.get('format')} is not {CHECKPOINT_FORMAT}")
    return state


def load_latest(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, falling back past corrupt ones."""
    for path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path)
        except CorruptCheckpoint as exc:
            log.warning("skipping checkpoint: %s; falling back to the previous one", exc)
    return None


def snapshot(value: Any) -> Any:
    """A CPU copy of a (nested) state dict, safe to write while training goes on."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(snapshot(v) for v in value)
    return value


class Checkpointer:
    """Rank 0's checkpoint writer. Asynchronous by default: the loop pays only for a CPU
    snapshot of the state; serialising, fsync and the MLflow record happen on a writer
    thread, one save in flight at a time. `save` returns the seconds the loop stalled.
    """

    def __init__(self, directory: Path, keep: int, asynchronous: bool, on_saved=None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.directory, self.keep, self.asynchronous = directory, keep, asynchronous
        self.on_saved = on_saved
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if asynchronous else None
        )
        self._pending = None
        self.last_step: int | None = None
        self.stall_seconds = 0.0

    @classmethod
    def for_rank(cls, topo, directory: Path, runtime, tracker) -> Checkpointer | NullCheckpointer:
        """Rank 0 writes checkpoints (every rank holds the same replica); others don't."""
        if not topo.is_main:
            return NullCheckpointer()
        return cls(
            directory, runtime.keep_checkpoints, runtime.async_checkpoint, tracker.log_checkpoint
        )

    def _write(self, step: int, state: dict[str, Any], metrics: dict[str, float]) -> Path:
        path = save_checkpoint(self.directory, step, state, self.keep)
        if self.on_saved is not None:
            self.on_saved(path, step, metrics)
        return path

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, float]) -> float:
        """Checkpoint `step` (once: a second save of the same step is skipped)."""
        import time

        if step == self.last_step:
            return 0.0
        started = time.perf_counter()
        self.wait()
        if self._pool is None:
            self._write(step, state, metrics)
        else:
            self._pending = self._pool.submit(self._write, step, snapshot(state), dict(metrics))
        self.last_step = step
        stalled = time.perf_counter() - started
        self.stall_seconds += stalled
        return stalled

    def wait(self) -> None:
        """Block until the save in flight is on disk; re-raise its error if it failed."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()


class NullCheckpointer:
    """What ranks other than 0 hold: saving is rank 0's side effect."""

    stall_seconds = 0.0

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, float]) -> float:
        return 0.0

    def close(self) -> None:
        pass
