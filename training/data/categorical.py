"""Raw categorical values (user names, item SKUs, any type) as 24-bit id codes.

A user's table names its id columns in `data.categorical_columns`. Ingest turns each
value into a code: BLAKE2b of the value's text, 3 bytes (24 bits), so a code is exact in
a float32 feature column and the same value always gets the same code, in every file,
run, machine and library version (no vocabulary to keep in step). The registered model
hashes the raw ids it is given the same way (training.objectives.click).

The text of a value: strings as they are; integers in decimal; floats that are whole
numbers as the integer (a Parquet 12.0 and a CSV 12 are one id), other floats in
Arrow's shortest form; booleans as true/false. Distinct values may share a code (about
n^2 / 2^25 pairs among n values: ~3 among 10k values); the embedding tables fold codes
into fewer rows anyway (model.table_rows).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

CODE_BITS = 24
CODE_BYTES = CODE_BITS // 8


def code_of(text: str) -> int:
    """The id code of one value's text."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=CODE_BYTES).digest(), "big")


def id_text(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Each value's text (see the module docstring); nulls stay null."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    kind = values.type
    if pa.types.is_dictionary(kind):
        values = values.cast(kind.value_type)
        kind = values.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return values.cast(pa.string())
    if pa.types.is_floating(kind):
        whole = pc.and_(pc.is_finite(values), pc.equal(pc.floor(values), values))
        whole = pc.fill_null(whole, False)
        as_int = pc.cast(pc.if_else(whole, values, 0), pa.int64(), safe=False).cast(pa.string())
        return pc.if_else(whole, as_int, values.cast(pa.string()))
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return values.cast(pa.string())
    return values.cast(pa.string())


def id_codes(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """float32 codes (0 <= code < 2**24) of raw values; NaN where a value is null.
    Each distinct value is hashed once per call (dictionary encoding)."""
    encoded = pc.dictionary_encode(id_text(values))
    table = np.array([code_of(s) for s in encoded.dictionary.to_pylist()] + [0], np.float32)
    indices = encoded.indices.to_numpy(zero_copy_only=False)
    codes = table[np.nan_to_num(indices, nan=len(table) - 1).astype(np.int64)]
    if encoded.null_count:
        codes[encoded.is_null().to_numpy(zero_copy_only=False)] = np.nan
    return codes
