"""Checkpoints: sharded (torch.distributed.checkpoint), asynchronous, complete or absent.

Every rank writes its own shard of the state (FSDP / tensor-parallel DTensors, pipeline
stages) into `step-NNNNNNNN.tmp/`. DCP's coordinator, rank 0, writes `.metadata` only after
gathering every rank's write results, so once rank 0's save has returned, all shards are
on disk. Rank 0 then adds `train_state.json` (step, data position, layout) and a sha256
manifest, and renames the folder to `step-NNNNNNNN/`: a folder with that name is complete,
and one a killed job left behind keeps its `.tmp` name and is never read.

DCP unpickles `.metadata` on load, so a planted file would run code. The manifest is
therefore signed (HMAC-SHA256, training.signing) over every file's checksum, and every
load path (`load_into`, `load_model_weights`) verifies the signature and each file
before DCP reads a byte; a checkpoint that fails is skipped like a torn one.

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
from training.errors import GradlineError, ensure_free
from training.signing import sign, signature_matches, signing_key

log = logging.getLogger(__name__)

# 3: the manifest is signed. Format 2 checkpoints are unsigned and refused on load.
CHECKPOINT_FORMAT = 3
TRAIN_STATE = "train_state.json"
MANIFEST = "sha256.json"
_NAME = re.compile(r"^step-(\d{8})$")
_TMP_NAME = re.compile(r"^step-(\d{8})\.tmp$")
_ROOM_MARGIN = 1 << 20  # DCP's metadata, the train state and checksums


class CorruptCheckpoint(Exception):
    """The checkpoint cannot be used: torn, truncated, or a file fails its checksum.
    `reason` says which in a few words (the warning that skips it names it)."""

    def __init__(self, path: Path, reason: str, detail: str = "") -> None:
        super().__init__(f"{path}: {reason}" + (f" ({detail})" if detail else ""))
        self.path, self.reason = path, reason


class UntrustedCheckpoint(CorruptCheckpoint):
    """Its manifest is unsigned or its signature does not match: anyone could have
    written it, so nothing in it is read."""


class NoTrustedCheckpoint(GradlineError):
    """A job's folder holds checkpoints, none of them verifies, and some are unsigned or
    signed with another key: starting afresh would silently discard them, so the job
    stops and says what to do."""


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


def _signed_payload(name: str, files: dict[str, str]) -> bytes:
    """What the signature covers: the folder's step name (a signed checkpoint renamed to
    another step is refused) and every file's checksum, in one canonical encoding."""
    return json.dumps({"checkpoint": name, "files": files}, sort_keys=True).encode("utf-8")


def signed_manifest(path: Path, files: dict[str, str]) -> dict[str, Any]:
    """The manifest of checkpoint folder `path` (named as it will be read) over `files`
    (name -> sha256), signed with the key for its job folder."""
    key = signing_key(path.parent)
    return {"files": files, "hmac_sha256": sign(key, _signed_payload(path.name, files))}


def verify(path: Path) -> dict[str, Any]:
    """The checkpoint's train state, once its manifest's signature and every file's
    checksum hold. Reads nothing but the manifest before the signature is checked."""
    if not path.is_dir():
        raise CorruptCheckpoint(path, "torn", "no such checkpoint folder")
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CorruptCheckpoint(path, "torn", f"checksum manifest {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpoint(path, "torn", f"{MANIFEST} cannot be read: {exc}") from exc
    if not isinstance(manifest, dict) or "hmac_sha256" not in manifest:
        raise UntrustedCheckpoint(
            path, "unsigned", "written before checkpoints were signed, or by someone else"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not signature_matches(
        signing_key(path.parent), _signed_payload(path.name, files), manifest["hmac_sha256"]
    ):
        raise UntrustedCheckpoint(
            path, "signature mismatch", "its manifest was changed, or signed with another key"
        )
    for required in (".metadata", TRAIN_STATE):
        if required not in files:
            raise CorruptCheckpoint(path, "torn", f"{required} is missing")
    present = {p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST}
    if unlisted := sorted(present - set(files)):
        # DCP reads only what the signed .metadata names, but nothing unsigned stays.
        raise CorruptCheckpoint(path, "file checksum mismatch", f"unsigned files {unlisted}")
    for name, digest in sorted(files.items()):
        if name not in present:
            raise CorruptCheckpoint(path, "torn", f"{name} is missing")
        if _sha256(path / name) != digest:
            raise CorruptCheckpoint(
                path, "file checksum mismatch", f"{name} is truncated, corrupt or replaced"
            )
    train_state = json.loads((path / TRAIN_STATE).read_text(encoding="utf-8"))
    if train_state.get("format") != CHECKPOINT_FORMAT:
        raise CorruptCheckpoint(
            path,
            "torn",
            f"{TRAIN_STATE} has format {train_state.get('format')}, not {CHECKPOINT_FORMAT}",
        )
    return train_state


def find_latest(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, falling back past torn and untrusted ones.
    None when there is none at all; NoTrustedCheckpoint when every one is refused and
    some for want of a valid signature (see the class)."""
    refused: list[UntrustedCheckpoint] = []
    for path in list_checkpoints(directory):
        try:
            return path, verify(path)
        except CorruptCheckpoint as exc:
            log.warning("skipping checkpoint %s; falling back to the previous one", exc)
            if isinstance(exc, UntrustedCheckpoint):
                refused.append(exc)
    if refused:
        raise NoTrustedCheckpoint(
            f"no checkpoint in {directory} can be trusted: {refused[0]}. A checkpoint is "
            "unpickled when loaded, so gradline reads only checkpoints signed with this "
            "project's key (.gradline/signing.key, or GRADLINE_SIGNING_KEY). If these were "
            "written by an older gradline or with another key, start the job afresh by "
            f"deleting {directory}; if a node of a multi-node job wrote them, give every "
            "node the same GRADLINE_SIGNING_KEY"
        )
    return None


def find_at(directory: Path, step: int) -> tuple[Path, dict[str, Any]]:
    """The checkpoint of `step`, verified; CorruptCheckpoint when it is missing or bad."""
    path = checkpoint_dir(directory, step)
    return path, verify(path)


def load_into(path: Path, state: dict[str, Any], group=None) -> None:
    """Fill `state` in place (every rank its own shards; DCP reshards as needed), after
    this rank has verified the checkpoint itself: on separate disks its copy may differ
    from the one rank 0 chose."""
    verify(path)
    dcp.load(state, checkpoint_id=path, process_group=group)


def load_model_weights(path: Path, model: torch.nn.Module, key: str = "model") -> None:
    """Fill a full, unsharded model from the checkpoint's "model" part (or the part at
    dotted `key`), in this process alone (no process group): how the final model is
    consolidated. The optimizer's state is not read. Verified first, as every load."""
    verify(path)
    weights = model.state_dict()
    nested: dict[str, Any] = weights
    for part in reversed(key.split(".")):
        nested = {part: nested}
    with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(nested, checkpoint_id=path, no_dist=True)
    model.load_state_dict(weights)


def remove_torn_saves(directory: Path, below: int | None = None) -> None:
    """Remove the `.tmp` folders of saves that never completed (of steps below `below`):
    a killed attempt's, or one that failed. Rank 0 alone, where no save is running."""
    if not directory.is_dir():
        return
    for torn in directory.iterdir():
        match = _TMP_NAME.match(torn.name)
        if match and (below is None or int(match.group(1)) < below):
            shutil.rmtree(torn, ignore_errors=True)


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
        self.pinned: int | None = None  # the best step's checkpoint: never pruned
        self.stall_seconds = 0.0

    @classmethod
    def for_job(cls, topo, directory: Path, runtime, tracker) -> Checkpointer:
        if topo.is_main:
            remove_torn_saves(directory)
        group = None
        distributed = dist.is_available() and dist.is_initialized()
        if runtime.async_checkpoint and distributed:
            # The background save runs collectives; on a group of its own they never
            # interleave with the loop's on the default group. gloo, because async_save
            # needs a CPU backend (an NCCL-only default group is refused, even on 1 rank).
            # A collective: every rank creates its Checkpointer at the same point.
            group = dist.new_group(backend="gloo")
        if distributed:
            # Every rank makes a save's folder as the save begins (DCP's local plan), maybe
            # before rank 0 arrives: none may, before rank 0 has removed the torn ones.
            dist.barrier(group=group)
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
        # (A torn save of this step by a killed attempt was removed as the job started.)
        staging = _staging_dir(self.directory, step)
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
        files = {
            file.name: _sha256(file)
            for file in sorted(staging.iterdir())
            if file.is_file() and file.name != MANIFEST
        }
        path = checkpoint_dir(self.directory, step)
        # Signed for the name it is renamed to below.
        _write_synced(staging / MANIFEST, signed_manifest(path, files))
        fsync_dir(staging)
        if path.exists():  # the same step saved by an earlier attempt: the new one wins
            shutil.rmtree(path)
        os.replace(staging, path)
        fsync_dir(self.directory)
        self._prune(step)
        if self.on_saved is not None:
            self.on_saved(path, step, metrics)
        return path

    def _prune(self, step: int) -> None:
        kept = [p for p in list_checkpoints(self.directory) if p.name != self._pinned_name]
        for old in kept[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        remove_torn_saves(self.directory, below=step)

    @property
    def _pinned_name(self) -> str | None:
        pinned = self.pinned
        return None if pinned is None else checkpoint_dir(self.directory, pinned).name

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
