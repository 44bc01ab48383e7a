"""What a model and an objective need to know about the data, read from the manifest.

One small value passed to the model builder (input shape, classes, vocabulary, the
statistics that standardize tables) and to the objective (label statistics, bytes per
token), so neither of them reads manifest keys by hand.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from training.data.options import DataKind

# Tokens in an example of a token stream (fewer when the model's context is shorter).
EXAMPLE_TOKENS = 16


@dataclass(frozen=True)
class DataSpec:
    kind: DataKind
    feature_shape: tuple[int, ...] = ()  # table/image: one example's shape
    num_classes: int | None = None  # classification
    vocab_size: int | None = None  # tokens
    feature_mean: tuple[float, ...] | None = None  # table: train-split statistics
    feature_std: tuple[float, ...] | None = None
    label_mean: float | None = None  # regression: train-split statistics
    label_std: float | None = None
    feature_names: tuple[str, ...] | None = None  # table: the source's column names
    tokenizer: str | None = None  # tokens: sha256 of the tokenizer that made them
    # Tables with categorical features (recommendation): the first
    # len(categorical_columns) features are integer id codes (< 2**24, exact in float32),
    # the rest dense values. Per id column, from all rows at the shard stage: how many
    # distinct ids it holds and one more than its largest id (what sizes the tables).
    categorical_columns: tuple[str, ...] = ()
    categorical_distinct: tuple[int, ...] = ()
    categorical_bound: tuple[int, ...] = ()
    categorical_hashed: bool = False  # raw values hashed at ingest (training.data.categorical)

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> DataSpec:
        kind = manifest.get("kind")
        if kind == "tokens":
            tokenizer = (manifest.get("tokenizer") or {}).get("sha256")
            return cls("tokens", vocab_size=int(manifest["vocab_size"]), tokenizer=tokenizer)
        shape = tuple(int(d) for d in manifest["feature_shape"])
        kind = kind or ("table" if len(shape) == 1 else "image")
        features = manifest.get("feature_stats") or {}
        labels = manifest.get("label_stats") or {}
        names = manifest.get("feature_names")
        categorical = manifest.get("categorical") or {}
        return cls(
            kind=kind,
            feature_shape=shape,
            num_classes=manifest.get("num_classes"),
            feature_mean=tuple(features["mean"]) if features else None,
            feature_std=tuple(features["std"]) if features else None,
            label_mean=labels.get("mean"),
            label_std=labels.get("std"),
            feature_names=tuple(names) if names else None,
            categorical_columns=tuple(categorical.get("columns", ())),
            categorical_distinct=tuple(int(n) for n in categorical.get("distinct", ())),
            categorical_bound=tuple(int(n) for n in categorical.get("bound", ())),
            categorical_hashed=bool(categorical.get("hashed", False)),
        )

    @property
    def num_categorical(self) -> int:
        """Leading feature columns that hold id codes (0: every feature is dense)."""
        return len(self.categorical_columns)

    @property
    def num_dense(self) -> int:
        return math.prod(self.feature_shape) - self.num_categorical if self.feature_shape else 0

    def default_table_rows(self) -> tuple[int, ...]:
        """Rows of each id column's embedding table when model.table_rows is not set.

        Ids numbered densely by their source (the largest below a few times the distinct
        count) get a row each. Hashed codes (BLAKE2b, 24 bits, spread over 16M values)
        are folded by remainder into 4x their distinct count: about 1 - e^-1/4 = 22% of
        ids then share a row with another, the usual price of the hashing trick, and the
        table stays proportional to what the data holds."""
        return tuple(
            max(1, min(bound, 4 * distinct))
            for distinct, bound in zip(
                self.categorical_distinct, self.categorical_bound, strict=True
            )
        )

    def feature_scaling(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """(mean, std) that standardize a table's features inside the model: the train
        split's statistics for dense features, (0, 1) for id codes, which must reach the
        embedding tables unchanged. None when the manifest has no statistics."""
        if self.feature_mean is None or self.feature_std is None:
            return None
        k = self.num_categorical
        return (0.0,) * k + self.feature_mean[k:], (1.0,) * k + self.feature_std[k:]

    @property
    def column_names(self) -> list[str]:
        """A table's feature columns as callers name them: the source's names, else
        f0..fN-1."""
        size = math.prod(self.feature_shape)
        if self.feature_names and len(self.feature_names) == size:
            return list(self.feature_names)
        return [f"f{i}" for i in range(size)]

    def example(self, batch: int = 2, context: int | None = None) -> np.ndarray:
        """A batch of this data, for signatures and build checks: float32 features in
        their raw shape (near the train split's values for tables), or int64 token ids
        (batch, min(context, EXAMPLE_TOKENS))."""
        rng = np.random.default_rng(0)
        if self.kind == "tokens":
            length = min(context or EXAMPLE_TOKENS, EXAMPLE_TOKENS)
            return rng.integers(0, self.vocab_size or 2, size=(batch, length), dtype=np.int64)
        rows = rng.standard_normal((batch, *self.feature_shape))
        if self.kind == "table" and self.feature_mean is not None:
            rows = rows * np.asarray(self.feature_std) + np.asarray(self.feature_mean)
        if self.num_categorical:  # ids: whole numbers the data holds
            bounds = self.categorical_bound or (1,) * self.num_categorical
            rows[:, : self.num_categorical] = rng.integers(0, bounds, (batch, len(bounds)))
        return rows.astype(np.float32)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DataSpec:
        tuples = (
            "feature_shape",
            "feature_mean",
            "feature_std",
            "feature_names",
            "categorical_columns",
            "categorical_distinct",
            "categorical_bound",
        )
        fixed = {k: tuple(v) if k in tuples and v is not None else v for k, v in values.items()}
        return cls(**fixed)


def incompatibility(trained: DataSpec, trained_task: str, now: DataSpec, task: str) -> str | None:
    """Why a model trained on `trained` data cannot score `now` data, or None if it can."""
    if trained_task != task:
        return f"it learned {trained_task}, the job now learns {task}"
    if trained.kind != now.kind:
        return f"it takes {trained.kind} data, the data is now {now.kind}"
    if trained.feature_shape != now.feature_shape:
        names_then, names_now = set(trained.feature_names or ()), set(now.feature_names or ())
        change = ""
        if names_then and names_now:
            added, removed = sorted(names_now - names_then), sorted(names_then - names_now)
            change = f" (added {added or 'none'}, removed {removed or 'none'})"
        return (
            f"it takes features of shape {list(trained.feature_shape)}, the data now has "
            f"{list(now.feature_shape)}{change}"
        )
    if trained.categorical_columns != now.categorical_columns:
        return (
            f"it takes id columns {list(trained.categorical_columns)}, the data now has "
            f"{list(now.categorical_columns)}"
        )
    if trained.num_classes != now.num_classes:
        return f"it predicts {trained.num_classes} classes, the data now has {now.num_classes}"
    if trained.vocab_size != now.vocab_size:
        return f"its vocabulary has {trained.vocab_size} tokens, the data's {now.vocab_size}"
    if trained.tokenizer and now.tokenizer and trained.tokenizer != now.tokenizer:
        return "it was trained with another tokenizer, so its tokens are not the data's"
    return None
