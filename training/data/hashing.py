"""Stable 64-bit row keys and hashes, vectorized with numpy.

Keys decide a row's split, so they must not change between runs, machines or library
versions: only fixed arithmetic (splitmix64) and blake2b are used.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective, well-mixed map of uint64 values."""
    x = np.asarray(values).astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def unit_interval(keys: np.ndarray, salt: int = 0) -> np.ndarray:
    """Map keys to [0, 1) uniformly and stably (53-bit precision)."""
    mixed = mix64(np.asarray(keys, dtype=np.uint64) ^ np.uint64(salt))
    return (mixed >> np.uint64(11)).astype(np.float64) * 2.0**-53


def keys_from_column(column: pa.Array) -> np.ndarray:
    """A user's key column as uint64: integers as they are, strings through blake2b."""
    if pa.types.is_integer(column.type):
        return column.to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64)
    values = column.to_pylist()
    return np.array(
        [
            int.from_bytes(hashlib.blake2b(str(v).encode(), digest_size=8).digest(), "big")
            for v in values
        ],
        dtype=np.uint64,
    )


def content_keys(features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """A key from a row's values, for tables without a key column."""
    words = np.ascontiguousarray(features, dtype=np.float32).view(np.uint32)
    h = np.full(len(words), _GOLDEN, dtype=np.uint64)
    for j in range(words.shape[1]):
        h = mix64(h ^ words[:, j].astype(np.uint64))
    return mix64(h ^ labels.astype(np.int64).view(np.uint64))
