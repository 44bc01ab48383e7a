"""Token shards: a text snapshot split by document, tokenized, and read as windows.

A document's split is a pure function of its key (the tables' split_codes), so it never
moves when files are added. Each split is one token stream (every document followed by
the end-of-document id) cut into uncompressed single-batch Arrow IPC shards of uint16
(uint32 for vocabularies above 65,536), which readers memory-map and view without a
copy. A reader's row is a window of `context` tokens and the same window shifted by one;
windows tile the stream and may cross shard boundaries.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from numpy.lib.stride_tricks import sliding_window_view

from training.atomic import atomic_dir, write_json
from training.data.options import ShardConfig
from training.data.manifest import (
    MANIFEST,
    MANIFEST_VERSION,
    SPLITS,
    ShardInfo,
    ensure_room_for_shards,
    file_sha256,
    split_codes,
)
from training.data.sources import ROW_KEY
from training.data.text import DOCUMENTS_FILE, TEXT, read_documents
from training.data.tokenizer import TOKENIZER_FILE, load_tokenizer
from training.errors import DataError
from training.progress import Progress

TOKENS = "tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _TokenSplitWriter:
    """One split's token stream, written as shards of `shard_tokens` tokens (the last
    one shorter) as it grows: memory stays about one shard per split."""

    def __init__(self, name: str, folder: Path, shard_tokens: int, dtype: np.dtype) -> None:
        self.name, self.folder, self.shard_tokens, self.dtype = name, folder, shard_tokens, dtype
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.shards: list[dict[str, Any]] = []
        self.tokens = self.bytes = self.documents = 0

    def add(self, stream: np.ndarray, documents: int, text_bytes: int) -> None:
        self.documents += documents
        self.bytes += text_bytes
        self.pending.append(stream.astype(self.dtype))
        self.pending_tokens += len(stream)
        if self.pending_tokens >= self.shard_tokens:
            buffered = np.concatenate(self.pending)
            full = len(buffered) // self.shard_tokens * self.shard_tokens
            for start in range(0, full, self.shard_tokens):
                self._write(buffered[start : start + self.shard_tokens])
            self.pending = [buffered[full:]]
            self.pending_tokens = len(buffered) - full

    def flush(self) -> None:
        if self.pending_tokens:
            self._write(np.concatenate(self.pending))
        self.pending, self.pending_tokens = [], 0

    def _write(self, tokens: np.ndarray) -> None:
        path = self.folder / f"{self.name}-{len(self.shards):05d}.arrow"
        batch = pa.record_batch([pa.array(tokens)], names=[TOKENS])
        # One record batch per file, uncompressed: a memory-mapped reader views it zero-copy.
        with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, batch.schema) as writer:
            writer.write_batch(batch)
        self.shards.append({"file": path.name, "rows": len(tokens), "sha256": file_sha256(path)})
        self.tokens += len(tokens)

    def summary(self) -> dict[str, Any]:
        # "rows" of a token split counts tokens, as its shards' "rows" do.
        return {
            "rows": self.tokens,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "documents": self.documents,
            "shards": self.shards,
        }


def write_token_shards(cfg: ShardConfig, raw_dir: Path, out_dir: Path, data_version: str) -> dict:
    """Split, tokenize and shard the text snapshot in `raw_dir` into `out_dir` (replaced
    whole, only on success)."""
    tokenizer = load_tokenizer(raw_dir / TOKENIZER_FILE)
    dtype = token_dtype(tokenizer.vocab_size)
    shard_tokens = max(1, int(cfg.target_shard_mb * 2**20) // dtype.itemsize)
    documents = pq.ParquetFile(raw_dir / DOCUMENTS_FILE).metadata.num_rows
    # At most one token per byte of text.
    ensure_room_for_shards(out_dir, [raw_dir / DOCUMENTS_FILE], per_value=dtype.itemsize)
    with atomic_dir(out_dir) as staging, Progress("shard", documents, "documents") as progress:
        writers = [_TokenSplitWriter(name, staging, shard_tokens, dtype) for name in SPLITS]
        for batch in read_documents(raw_dir, [ROW_KEY, TEXT]):
            keys = batch.column(0).to_numpy()
            codes = split_codes(keys, cfg.val_fraction, cfg.test_fraction)
            texts, text_bytes = batch.column(1), pc.binary_length(batch.column(1)).to_numpy()
            for code, writer in enumerate(writers):
                chosen = np.flatnonzero(codes == code)
                if len(chosen):
                    picked = texts.take(pa.array(chosen)).to_pylist()
                    stream = tokenizer.encode_documents(picked)
                    writer.add(stream, len(chosen), int(text_bytes[chosen].sum()))
            progress.advance(batch.num_rows)
        for writer in writers:
            writer.flush()
            if not writer.shards:
                raise DataError(
                    f"split {writer.name!r} is empty ({documents} documents in all): a split "
                    "holds whole documents, so add text, set data.split_by: document (a "
                    "document per paragraph) or larger shard.val_fraction / test_fraction"
                )
        shutil.copyfile(raw_dir / TOKENIZER_FILE, staging / TOKENIZER_FILE)
        manifest: dict[str, Any] = {
            "version": MANIFEST_VERSION,
            "kind": "tokens",
            "data_version": data_version,
            "schema": {TOKENS: dtype.name},
            "vocab_size": tokenizer.vocab_size,
            "eot_token": tokenizer.eot,
            "tokenizer": {
                "kind": tokenizer.kind,
                "file": TOKENIZER_FILE,
                # Which tokenizer: models trained with another one score other tokens.
                "sha256": file_sha256(staging / TOKENIZER_FILE),
            },
            "splits": {w.name: w.summary() for w in writers},
        }
        write_json(staging / MANIFEST, manifest)
    return manifest


class TokenReader:
    """Windows of one split's token stream, gathered from memory-mapped shards.

    Row w is x = tokens[w*context : w*context + context] and y = the next token of each
    (the same window shifted by one), both int64 of shape (n, context). Windows tile the
    stream without overlap except y's last token, so there are (tokens - 1) // context.
    """

    def __init__(self, shards: list[ShardInfo], context: int) -> None:
        if not shards:
            raise DataError("no shards to read")
        if context < 1:
            raise ValueError(f"context must be at least 1, got {context}")
        self.shards, self.context = shards, context
        self._offsets = np.cumsum([0] + [s.rows for s in shards])
        self._views: dict[int, np.ndarray] = {}
        tokens = int(self._offsets[-1])
        if (tokens - 1) // context < 1:
            raise DataError(
                f"the split has {tokens} tokens, too few for one window of {context} tokens "
                "and its next token; use more text or a shorter model context"
            )

    @property
    def num_rows(self) -> int:
        return (int(self._offsets[-1]) - 1) // self.context

    @property
    def row_bytes(self) -> int:
        """Bytes of one row as the loader delivers it (x and y, int64)."""
        return 2 * self.context * 8

    def open_all(self) -> None:
        """Map every shard now (mapping reads nothing), keeping Arrow's one-time set-up out
        of the first training step."""
        for shard_id in range(len(self.shards)):
            self._view(shard_id)

    def _view(self, shard_id: int) -> np.ndarray:
        view = self._views.get(shard_id)
        if view is None:
            # A zero-copy view straight onto the mapped file.
            view = self.shards[shard_id].map("tokens").column(0).to_numpy(zero_copy_only=True)
            self._views[shard_id] = view
        return view

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Windows at `indices`, returned in storage order (sorted), as ShardReader does.

        Windows inside one shard come from a strided view of its map (no index arrays);
        the few that cross a shard boundary are stitched from the shards they span."""
        rows = np.sort(np.asarray(indices, dtype=np.int64))
        span = self.context + 1
        starts = rows * self.context
        shard_of = np.searchsorted(self._offsets, starts, side="right") - 1
        inside = starts + span <= self._offsets[shard_of + 1]
        x = np.empty((len(rows), self.context), dtype=np.int64)
        y = np.empty((len(rows), self.context), dtype=np.int64)
        for shard_id in np.unique(shard_of[inside]).tolist():
            chosen = np.flatnonzero(inside & (shard_of == shard_id))
            local = starts[chosen] - self._offsets[shard_id]
            windows = sliding_window_view(self._view(shard_id), span)[local]
            x[chosen], y[chosen] = windows[:, :-1], windows[:, 1:]
        for i in np.flatnonzero(~inside).tolist():
            window = self._stitch(int(starts[i]), int(starts[i]) + span)
            x[i], y[i] = window[:-1], window[1:]
        return x, y

    def _stitch(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, read across as many shards as they span."""
        first = int(np.searchsorted(self._offsets, start, side="right") - 1)
        last = int(np.searchsorted(self._offsets, stop - 1, side="right") - 1)
        parts = []
        for shard_id in range(first, last + 1):
            lo = max(start - self._offsets[shard_id], 0)
            hi = min(stop, self._offsets[shard_id + 1]) - self._offsets[shard_id]
            parts.append(self._view(shard_id)[lo:hi])
        return np.concatenate(parts)
