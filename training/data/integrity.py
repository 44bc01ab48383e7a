"""Each shard file is checked against the sha256 its manifest recorded, once per process:
the first time it is mapped. A shard changed or corrupted after sharding fails here,
named, instead of training on whatever its bytes now say.

Once per process, not per read: later maps of a file whose inode, size and mtime are
unchanged skip the hash. DataLoader workers forked after the first map inherit what was
checked. The hash reads the whole file once up front; the training reads that follow
then find it in the page cache (benchmarks/shard_verify.py measures the cost).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from training.errors import DataError


class CorruptShard(DataError):
    """A shard file's content differs from the checksum in its manifest."""


# path -> (inode, size, mtime_ns, expected sha256) of the files found intact
_intact: dict[str, tuple[int, int, int, str]] = {}
_lock = threading.Lock()


def ensure_shard_intact(path: Path, sha256: str) -> None:
    """Return if `path` hashes to `sha256` (hashing it only the first time); else raise
    CorruptShard naming the file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DataError(f"cannot read shard {path}: {exc}; re-run the shard stage") from exc
    seen = (st.st_ino, st.st_size, st.st_mtime_ns, sha256)
    key = str(path)
    with _lock:
        if _intact.get(key) == seen:
            return
    digest = file_sha256(path)
    if digest != sha256:
        raise CorruptShard(
            f"shard {path} fails its checksum: its sha256 is {digest}, the shard manifest "
            f"says {sha256}. It was changed or damaged after sharding; restore the shards "
            "(dvc checkout data/shards) or re-run the shard stage (dvc repro shard)"
        )
    with _lock:
        _intact[key] = seen


def file_sha256(path: Path) -> str:
    """The sha256 of a file: what the shard manifest records and what reading checks."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def forget_checked() -> None:
    """Hash every shard again on its next map (benchmarks measure the first open)."""
    with _lock:
        _intact.clear()
