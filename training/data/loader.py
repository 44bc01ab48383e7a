"""Rank-aware, memory-mapped batch loader over Arrow IPC shards.

The order of samples is a pure function of (seed, epoch): one global permutation per
epoch, cut into global batches of `global_batch` rows; rank r takes the r-th contiguous
slice of each global batch. So the rows of a global step are the same whatever the world
size, every rank gets the same number of batches (the last partial global batch is
dropped), and a position is a global batch index that means the same on any world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import torch.utils.data

from training.data.manifest import ShardInfo, split_shards
from training.data.sources import FEATURES, LABEL
from training.data.tokens import TokenReader
from training.errors import DataError


LOADER_STATE_VERSION = 1
# Batches of at most SMALL_BATCH_BYTES are gathered in groups of up to SMALL_GROUP_BYTES.
SMALL_BATCH_BYTES = 128 << 10
SMALL_GROUP_BYTES = 1 << 20


def epoch_permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def batches_per_epoch(num_rows: int, global_batch: int) -> int:
    return num_rows // global_batch


def check_batch_fits(train_rows: int, global_batch: int) -> None:
    """Fail as bad input (no retry can help) when not one global batch fits the split."""
    if batches_per_epoch(train_rows, global_batch) == 0:
        raise DataError(
            f"train split has {train_rows} rows, fewer than one global batch "
            f"({global_batch}); lower train.batch_size or use more data"
        )


def rank_slice(batch_index: int, global_batch: int, world_size: int, rank: int) -> slice:
    """Positions in the epoch permutation that rank `rank` reads for one global batch."""
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} does not split over {world_size} ranks")
    per_rank = global_batch // world_size
    start = batch_index * global_batch + rank * per_rank
    return slice(start, start + per_rank)


def share_slice(batch_index: int, global_batch: int, shares: list[int], rank: int) -> slice:
    """Positions rank `rank` reads for one global batch when ranks take `shares` rows
    each (consecutive slices, summing to the global batch: the same rows as any split)."""
    start = batch_index * global_batch + sum(shares[:rank])
    return slice(start, start + shares[rank])


def strided_rows(num_rows: int, world_size: int, rank: int) -> np.ndarray:
    """Evaluation split: rank r takes rows r, r+W, ...; every row is read exactly once."""
    return np.arange(rank, num_rows, world_size)


class ShardReader:
    """Gathers rows by global index from memory-mapped shards, opening each on first use."""

    def __init__(self, shards: list[ShardInfo]) -> None:
        if not shards:
            raise DataError("no shards to read")
        self.shards = shards
        self._offsets = np.cumsum([0] + [s.rows for s in shards])
        self._views: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def num_rows(self) -> int:
        return int(self._offsets[-1])

    @property
    def row_bytes(self) -> int:
        """Bytes of one row as the loader delivers it (features + label)."""
        features, labels = self._view(0)
        return features.shape[1] * features.itemsize + labels[:1].nbytes

    def open_all(self) -> None:
        """Map every shard now (mapping reads nothing). The first map in a process pays
        for Arrow's one-time set-up; done here, it stays out of the first training step."""
        for shard_id in range(len(self.shards)):
            self._view(shard_id)

    def _view(self, shard_id: int) -> tuple[np.ndarray, np.ndarray]:
        view = self._views.get(shard_id)
        if view is None:
            batch = self.shards[shard_id].map()
            column = batch.column(batch.schema.get_field_index(FEATURES))
            width = column.type.list_size
            # Zero-copy views straight onto the mapped file.
            features = column.flatten().to_numpy(zero_copy_only=True).reshape(-1, width)
            label = batch.column(batch.schema.get_field_index(LABEL))
            if pa.types.is_fixed_size_list(label.type):
                # Several values per row (a forecast's horizon): a (rows, width) view.
                labels = (
                    label.flatten().to_numpy(zero_copy_only=True).reshape(-1, label.type.list_size)
                )
            else:
                labels = label.to_numpy()
            view = (features, labels)
            self._views[shard_id] = view
        return view

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows at `indices`, returned in storage order (sorted).

        The order of rows inside a batch does not change what a step learns, and sorting
        makes each shard's rows one contiguous run, so every row is copied exactly once,
        straight from the memory map into the batch, in ascending addresses. (np.take
        with mode="clip" skips the bounds check that would force a buffered copy; the
        indices are in range by construction.)
        """
        rows = np.sort(indices)
        bounds = np.searchsorted(rows, self._offsets)
        first_shard = int(np.searchsorted(self._offsets, rows[0], side="right") - 1)
        first_x, first_y = self._view(first_shard)
        features = np.empty((len(rows), first_x.shape[1]), dtype=np.float32)
        # Labels keep the shards' type: int64 classes, float32 regression targets.
        labels = np.empty((len(rows), *first_y.shape[1:]), dtype=first_y.dtype)
        for shard_id in np.flatnonzero(bounds[1:] - bounds[:-1]).tolist():
            start, stop = bounds[shard_id], bounds[shard_id + 1]
            local = rows[start:stop] - self._offsets[shard_id]
            src_x, src_y = self._view(shard_id)
            src_x.take(local, axis=0, out=features[start:stop], mode="clip")
            src_y.take(local, axis=0, out=labels[start:stop], mode="clip")
        return features, labels


@dataclass
class LoaderPosition:
    """Where training stands in the data, in global terms (valid on any world size)."""

    epoch: int = 0
    batch_index: int = 0  # global batches already consumed in this epoch

    def state_dict(self) -> dict[str, int]:
        return {
            "version": LOADER_STATE_VERSION,
            "epoch": self.epoch,
            "batch_index": self.batch_index,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, int]) -> LoaderPosition:
        if state.get("version") != LOADER_STATE_VERSION:
            raise DataError(
                f"loader state version {state.get('version')} is not {LOADER_STATE_VERSION}; "
                "this checkpoint was written by another gradline and cannot resume here"
            )
        return cls(epoch=int(state["epoch"]), batch_index=int(state["batch_index"]))


class _RankEpoch(torch.utils.data.IterableDataset):
    """One rank's batches of one epoch, shareable among DataLoader workers.

    Worker w of n yields global batches start+w, start+w+n, ... through the same
    RankLoader.batches; the DataLoader collects them round-robin, so the order is the
    same as with no workers. Each worker opens its own memory maps (never inherited
    across the fork).
    """

    def __init__(
        self,
        shards: list[ShardInfo],
        loader: dict,
        epoch: int,
        start: int,
        context: int | None = None,
    ) -> None:
        self.shards, self.loader, self.epoch, self.start = shards, loader, epoch, start
        self.context = context  # token windows' length; None for tables

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        loader = RankLoader(make_reader(self.shards, self.context), **self.loader)
        for x, y in loader.batches(self.epoch, self.start + worker, every=workers):
            yield torch.from_numpy(x), torch.from_numpy(y)


class RankLoader:
    """Yields this rank's (features, labels) batches for one epoch, from a position."""

    def __init__(
        self,
        reader: ShardReader,
        *,
        rank: int,
        world_size: int,
        global_batch: int,
        seed: int,
        shares: list[int] | None = None,
    ) -> None:
        check_batch_fits(reader.num_rows, global_batch)
        reader.open_all()
        self.reader = reader
        self.rank = rank
        self.world_size = world_size
        self.global_batch = global_batch
        self.seed = seed
        # Rows per rank of each global batch: even unless balanced by measured throughput.
        self.shares = list(shares) if shares else None

    @property
    def batches_per_epoch(self) -> int:
        return batches_per_epoch(self.reader.num_rows, self.global_batch)

    def batches(
        self, epoch: int, start: int = 0, every: int = 1
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """This rank's batches for global batches start, start+every, ...; rows of a batch
        in storage order. Small batches are gathered several at a time: one gather's
        fixed cost (tens of microseconds of Python) would otherwise be a visible share of
        a step."""
        order = epoch_permutation(self.reader.num_rows, self.seed, epoch)
        shares = self.shares
        per_rank = shares[self.rank] if shares else self.global_batch // self.world_size
        batch_bytes = per_rank * self.reader.row_bytes
        # Grouping costs a second copy (back to batch order): worth it only where the
        # fixed cost of a gather dominates, i.e. for small batches.
        small = 0 < batch_bytes <= SMALL_BATCH_BYTES
        group = max(1, min(64, SMALL_GROUP_BYTES // batch_bytes)) if small else 1
        wanted = np.arange(start, self.batches_per_epoch, every)
        for first in range(0, len(wanted), group):
            ks = wanted[first : first + group]
            # rank_slice/share_slice are the assignments the property tests check.
            slices = [self._slice(int(k)) for k in ks]
            rows = np.sort(np.stack([order[sl] for sl in slices]), axis=1)
            if len(ks) == 1:
                yield self.reader.gather(rows[0])
                continue
            # One gather for the group (it returns rows sorted), then back to batch order.
            flat = rows.ravel()
            features, labels = self.reader.gather(flat)
            back = np.searchsorted(np.sort(flat), flat)
            features, labels = features[back], labels[back]
            for i in range(len(ks)):
                batch = slice(i * per_rank, (i + 1) * per_rank)
                yield features[batch], labels[batch]

    def _slice(self, batch_index: int) -> slice:
        if self.shares:
            return share_slice(batch_index, self.global_batch, self.shares, self.rank)
        return rank_slice(batch_index, self.global_batch, self.world_size, self.rank)

    def tensors(
        self, epoch: int, start: int = 0, workers: int = 0, pin_memory: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same batches as torch tensors (no copy), optionally from worker processes."""
        if workers == 0:
            for x, y in self.batches(epoch, start):
                yield torch.from_numpy(x), torch.from_numpy(y)
            return
        loader = {
            "rank": self.rank,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "shares": self.shares,
        }
        yield from torch.utils.data.DataLoader(
            _RankEpoch(
                self.reader.shards, loader, epoch, start, getattr(self.reader, "context", None)
            ),
            batch_size=None,
            num_workers=workers,
            pin_memory=pin_memory,
        )


def make_reader(shards: list[ShardInfo], context: int | None = None) -> ShardReader | TokenReader:
    """A reader of table rows, or of token windows of `context` tokens when it is given."""
    if context is None:
        return ShardReader(shards)
    return TokenReader(shards, context)


def open_reader(
    shard_dir: Path, manifest: dict, split: str, context: int | None = None
) -> ShardReader | TokenReader:
    """The reader for the manifest's kind; token shards need the model's `context`."""
    shards = split_shards(shard_dir, manifest, split)
    if manifest.get("kind") != "tokens":
        return ShardReader(shards)
    if context is None:
        raise ValueError("token shards are read as windows: pass the model's context length")
    return make_reader(shards, context)
