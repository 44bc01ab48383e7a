"""The `data` and `shard` sections of params.yaml, and what each data source yields.

The data package owns these keys; training.config composes them with the other
sections. `SOURCES` says, without reading any data, what a source can feed: which
kinds of examples (tables, images, token streams), whether its labels are fixed (the
bundled data sets) and whether it knows its number of classes. The config checks a
task and a model against it before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from training.options import Section, Seed

DataKind = Literal["table", "image", "tokens"]
LabelKind = Literal["classes", "values"]


@dataclass(frozen=True)
class SourceInfo:
    kinds: tuple[DataKind, ...]  # what its examples can be
    labels: LabelKind | None = None  # fixed by a bundled data set, else the task's
    knows_classes: bool = False  # says how many classes its labels have
    text: bool = False  # documents and a tokenizer rather than rows

    @property
    def table(self) -> bool:
        return not self.text


SOURCES: dict[str, SourceInfo] = {
    "digits": SourceInfo(("image",), labels="classes", knows_classes=True),
    "diabetes": SourceInfo(("table",), labels="values"),
    "synthetic": SourceInfo(("table", "image"), knows_classes=True),
    "clicks": SourceInfo(("table",), labels="classes", knows_classes=True),
    "parquet": SourceInfo(("table", "image")),
    "csv": SourceInfo(("table", "image")),
    "text": SourceInfo(("tokens",), text=True),
    "stdlib": SourceInfo(("tokens",), text=True),
}
USER_TABLE_SOURCES = ("parquet", "csv")


class DataConfig(Section):
    source: Literal[tuple(SOURCES)] = Field(  # type: ignore[valid-type]
        "digits",
        description="digits, diabetes (bundled with scikit-learn), synthetic; clicks "
        "(generated click logs for recommendation); parquet or csv tables and text "
        "files under data.path; stdlib: the running Python's own source code, a text "
        "corpus on every machine",
    )
    path: str = Field(
        "data/incoming",
        min_length=1,
        description="parquet/csv/text: a file or a folder of files, relative to the project",
    )
    label_column: str = Field("label", min_length=1)
    feature_columns: list[str] | None = Field(
        None, description="numeric feature columns; null: every column but label and key"
    )
    categorical_columns: list[str] | None = Field(
        None,
        description="columns of ids (users, items, ... of any type), hashed to 24-bit codes "
        "at ingest; they come first among the features, before the numeric ones",
    )
    tensor_column: str | None = Field(
        None, description="one fixed-shape list column holding all features instead"
    )
    feature_shape: list[int] | None = Field(
        None, description="shape of tensor_column's values, e.g. [8, 8]"
    )
    key_column: str | None = Field(
        None, description="a unique row key; null: a hash of the row's contents"
    )
    num_classes: int | None = Field(
        None, ge=2, description="classification: labels must lie in 0..num_classes-1"
    )
    on_invalid: Literal["fail", "quarantine"] = Field(
        "fail", description="quarantine: bad rows go to data/quarantine/ with a reason"
    )
    duplicates: Literal["keep", "reject"] = Field(
        "keep", description="reject: a repeated key (or repeated row) is an invalid row"
    )
    max_rows: int | None = Field(
        None, ge=1, description="keep only the first N source rows (null keeps all)"
    )
    read_batch_rows: int = Field(65536, ge=1, description="rows per streamed batch")
    synthetic_rows: int = Field(10000, ge=1)
    synthetic_shape: list[int] = Field([64], min_length=1, description="feature shape")
    synthetic_classes: int = Field(10, ge=2)
    synthetic_noise: float = Field(1.0, ge=0.0)
    # Generated click logs (source clicks): impressions, users, items (ids < 2**24).
    clicks_rows: int = Field(200_000, ge=1, description="clicks: impressions generated")
    clicks_users: int = Field(5000, ge=1, le=2**24, description="clicks: distinct users")
    clicks_items: int = Field(2000, ge=2, le=2**24, description="clicks: distinct items")
    seed: Seed = Field(0, description="seeds the synthetic and clicks sources")
    # Text sources (text, stdlib) only.
    text_glob: str = Field("*.txt", min_length=1, description="text: which files to read")
    max_bytes: int | None = Field(
        None, ge=1, description="text: stop after this many bytes of files (a byte budget)"
    )
    split_by: Literal["file", "document"] = Field(
        "file",
        description="text: a split holds whole files, or whole documents (blank-line "
        "separated); either way a split never moves when files are added",
    )
    tokenizer: Literal["bytes", "bpe"] = Field(
        "bytes", description="bytes: UTF-8 bytes, no training; bpe: trained at ingest"
    )
    vocab_size: int = Field(2048, ge=260, le=65535, description="bpe: vocabulary size")

    @property
    def source_info(self) -> SourceInfo:
        return SOURCES[self.source]

    @model_validator(mode="after")
    def _features_declared_once(self) -> DataConfig:
        if self.tensor_column and self.feature_columns:
            raise ValueError(
                "set data.tensor_column or data.feature_columns, not both: features come "
                "either from one list column or from several numeric columns"
            )
        shapes = [self.feature_shape or [1], self.synthetic_shape]
        if self.categorical_columns is not None and self.tensor_column:
            raise ValueError(
                "data.categorical_columns needs features from named columns, not "
                "data.tensor_column: list the id columns and (optionally) the numeric ones "
                "in data.feature_columns"
            )
        if any(d < 1 for shape in shapes for d in shape):
            raise ValueError("data.feature_shape and data.synthetic_shape need sizes >= 1")
        return self


class ShardConfig(Section):
    target_shard_mb: float = Field(64.0, gt=0.0, description="approximate size of a shard")
    val_fraction: float = Field(0.15, ge=0.0, lt=1.0)
    test_fraction: float = Field(0.15, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _leave_rows_to_train(self) -> ShardConfig:
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                "shard.val_fraction + shard.test_fraction must be below 1 so that rows are "
                f"left to train on (got {self.val_fraction} + {self.test_fraction})"
            )
        return self
