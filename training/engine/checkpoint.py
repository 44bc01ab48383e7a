"""Checkpoints: sharded (torch.distributed.checkpoint), asynchronous, complete or absent.

Every rank writes its own shard of the state (FSDP / tensor-parallel DTensors, pipeline
stages) into `step-NNNNNNNN.tmp/`. DCP's coordinator, rank 0, writes `.metadata` only after
gathering every rank's write results, so once rank 0's save has returned, all shards are
on disk. Rank 0 then adds `train_state.json` (step, data position, layout) and a sha256
manifest, and renames the folder to `step-NNNNNNNN/`: a folder with that name is complete,
and one a killed job left behind keeps its `.tmp` name and is never read.

Loading goes through DCP too, which reshards when the target state has another layout
(other world size, FSDP <-> TP, or one full CPU model at the end). Random streams are a
pure function of (seed, data-parallel rank, pipeline stage, step) in the loop, so no
RNG state is saved.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from training.atomic import fsync_dir
from training.errors import ensure_free

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2
TRAIN_STATE = "train_state.json"
MANIFEST = "sha256.json"
_NAME = re.compile(r"^step-(\d{8})$")
_TMP_NAME = re.compile(r"^step-(\d{8})\.tmp$")
_ROOM_MARGIN = 1 << 20  # DCP's metadata, the train state and checksums


class CorruptCheckpoint(Exception):
    pass


def state_bytes(state: Any) -> int:
    """Bytes of the tensors this rank holds in `state` (its shard of a sharded tensor):
    about what it writes into a checkpoint."""
    if isinstance(state, DTensor):
        return state_bytes(state.to_local())
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def checkpoint_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def _staging_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.tmp"


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (renamed from their .tmp folder), newest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _write_synced(path: Path, payload: Any) -> None:
    with path.open("w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def verify(path: Path) -> dict[str, Any]:
    """The checkpoint's train state, if every file is present and matches its checksum."""
    if not path.is_dir():
        raise CorruptCheckpoint(f"{path}: no such checkpoint folder")
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CorruptCheckpoint(f"{path}: checksum manifest {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpoint(f"{path}: {MANIFEST} cannot be read ({exc})") from exc
    for required in (".metadata", TRAIN_STATE):
        if required not in manifest:
            raise CorruptCheckpoint(f"{path}: {required} is missing")
    for name, digest in sorted(manifest.items()):
        file = path / name
        if not file.is_file():
            raise CorruptCheckpoint(f"{path}: {name} is missing")
        if _sha256(file) != digest:
            raise CorruptCheckpoint(f"{path}: {name} fails its checksum (truncated or corrupt)")
    train_state = json.loads((path / TRAIN_STATE).read_text(encoding="utf-8"))
    if train_state.get("format") != CHECKPOINT_FORMAT:
        raise CorruptCheckpoint(
            f"{path}: {TRAIN_STATE} has format {train_state.get('format')}, not {CHECKPOINT_FORMAT}"
        )
    return train_state


def find_latest(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, falling back past corrupt ones."""
    for path in list_checkpoints(directory):
        try:
            return path, verify(path)
        except CorruptCheckpoint as exc:
            log.warning("skipping checkpoint: %s; falling back to the previous one", exc)
    return None


def load_into(path: Path, state: dict[str, Any], group=None) -> None:
    """Fill `state` in place (every rank its own shards; DCP reshards as needed)."""
    dcp.load(state, checkpoint_id=path, process_group=group)


def load_model_weights(path: Path, model: torch.nn.Module, key: str = "model") -> None:
    """Fill a full, unsharded model from the checkpoint's "model" part (or the part at
    dotted `key`), in this process alone (no process group): how the final model is
    consolidated. The optimizer's state is not read."""
    weights = model.state_dict()
    nested: dict[str, Any] = weights
    for part in reversed(key.split(".")):
        nested = {part: nested}
    with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(nested, checkpoint_id=path, no_dist=True)
    model.load_state_dict(weights)


class Checkpointer:
    """One per rank. `save` returns the seconds the loop stalled: with `asynchronous`, only
    for DCP's copy of the state into CPU memory; the writes, rank 0's checksums, rename,
    pruning and `on_saved` (the MLflow record) happen in the background. One save is in
    flight at a time: the next one waits for it first.
    """

    def __init__(
        self,
        directory: Path,
        keep: int,
        asynchronous: bool,
        *,
        is_main: bool,
        group=None,
        on_saved=None,
    ) -> None:
        self.directory, self.keep, self.asynchronous = directory, keep, asynchronous
        self.is_main, self.group, self.on_saved = is_main, group, on_saved
        # Rank 0's finishing work (checksums, rename) waits on DCP's future off the loop.
        self._finisher = (
            ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
            if asynchronous and is_main
            else None
        )
        self._pending: Future | None = None
        self.last_step: int | None = None
        self.stall_seconds = 0.0

    @classmethod
    def for_job(cls, topo, directory: Path, runtime, tracker) -> Checkpointer:
        group = None
        if runtime.async_checkpoint and dist.is_available() and dist.is_initialized():
            # The background save runs collectives; on a group of its own they never
            # interleave with the loop's on the default group. gloo, because async_save
            # needs a CPU backend (an NCCL-only default group is refused, even on 1 rank).
            # A collective: every rank creates its Checkpointer at the same point.
            group = dist.new_group(backend="gloo")
        return cls(
            directory,
            runtime.keep_checkpoints,
            runtime.async_checkpoint,
            is_main=topo.is_main,
            group=group,
            on_saved=tracker.log_checkpoint,
        )

    def save(
        self,
        step: int,
        state: dict[str, Any],
        train_state: dict[str, Any],
        metrics: dict[str, float],
    ) -> float:
        """Checkpoint `step` (once: a second save of the same step is skipped)."""
        if step == self.last_step:
            return 0.0
        started = time.perf_counter()
        self.wait()
        # A full disk fails here, naming the folder, before a torn save; the checkpoints
        # already written are kept (pruning comes after a complete save).
        ensure_free(self.directory, state_bytes(state) + _ROOM_MARGIN)
        staging = _staging_dir(self.directory, step)
        if self.is_main:
            # A torn save of this step by a killed attempt. Safe to remove: no rank writes
            # data before rank 0 has joined the save's planning, which comes after this.
            shutil.rmtree(staging, ignore_errors=True)
        finish_args = (step, staging, dict(train_state), dict(metrics))
        if self.asynchronous:
            # async_save copies every tensor (CPU ones too) into its own CPU buffers
            # before it returns, so training may change the parameters right away.
            future = dcp.async_save(state, checkpoint_id=staging, process_group=self.group)
            if self.is_main:
                future = self._finisher.submit(self._finish_after, future, *finish_args)
            self._pending = future
        else:
            dcp.save(state, checkpoint_id=staging, process_group=self.group)
            if self.is_main:
                self._finish(*finish_args)
        self.last_step = step
        stalled = time.perf_counter() - started
        self.stall_seconds += stalled
        return stalled

    def _finish_after(self, saved: Future, *finish_args) -> Path:
        saved.result()
        return self._finish(*finish_args)

    def _finish(
        self, step: int, staging: Path, train_state: dict, metrics: dict[str, float]
    ) -> Path:
        """Rank 0, once every rank's shards and DCP's .metadata are written."""
        _write_synced(staging / TRAIN_STATE, {**train_state, "format": CHECKPOINT_FORMAT})
        manifest = {
            file.name: _sha256(file)
            for file in sorted(staging.iterdir())
            if file.is_file() and file.name != MANIFEST
        }
        _write_synced(staging / MANIFEST, manifest)
        fsync_dir(staging)
        path = checkpoint_dir(self.directory, step)
        if path.exists():  # the same step saved by an earlier attempt: the new one wins
            shutil.rmtree(path)
        os.replace(staging, path)
        fsync_dir(self.directory)
        self._prune(step)
        if self.on_saved is not None:
            self.on_saved(path, step, metrics)
        return path

    def _prune(self, step: int) -> None:
        for old in list_checkpoints(self.directory)[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        for torn in self.directory.iterdir():
            match = _TMP_NAME.match(torn.name)
            if match and int(match.group(1)) < step:
                shutil.rmtree(torn, ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight is complete on this rank; re-raise its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._finisher is not None:
                self._finisher.shutdown()
