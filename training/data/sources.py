"""Sources produce the raw table: a row key, a fixed-size float feature vector, a label."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from training.config import DataConfig

ROW_KEY = "row_id"
FEATURES = "features"
LABEL = "label"


def raw_schema(num_features: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field(ROW_KEY, pa.string(), nullable=False),
            pa.field(FEATURES, pa.list_(pa.float32(), num_features), nullable=False),
            pa.field(LABEL, pa.int64(), nullable=False),
        ]
    )


def to_table(row_ids: list[str], features: np.ndarray, labels: np.ndarray) -> pa.Table:
    """Build a raw-schema table from a (rows, features) float array and integer labels."""
    rows, width = features.shape
    flat = pa.array(np.ascontiguousarray(features, dtype=np.float32).reshape(-1))
    columns = [
        pa.array(row_ids, pa.string()),
        pa.FixedSizeListArray.from_arrays(flat, width),
        pa.array(labels.astype(np.int64)),
    ]
    return pa.Table.from_arrays(columns, schema=raw_schema(width))


def digits_table(cfg: DataConfig) -> pa.Table:
    """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes): real data, no download.

    Pixels 0..16 are scaled to 0..1 here so every consumer sees the same values.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    features = bunch.data.astype(np.float32) / 16.0
    labels = bunch.target
    if cfg.max_rows is not None:
        features, labels = features[: cfg.max_rows], labels[: cfg.max_rows]
    row_ids = [f"digits-{i:05d}" for i in range(len(labels))]
    return to_table(row_ids, features, labels)


def load_source(cfg: DataConfig) -> pa.Table:
    if cfg.source == "digits":
        return digits_table(cfg)
    raise NotImplementedError(cfg.source)  # unreachable: the schema admits only known sources
