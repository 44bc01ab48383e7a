"""The `model` section of params.yaml: the built-ins' own keys (no torch imported here).

`name` picks a built-in, `target: package.module:factory` the user's own module; the
other keys belong to that model. Each built-in declares the kinds of data it takes
(which tasks it can learn follows from the tasks' own kinds), what it can be split by
besides data parallelism, and a pydantic schema for its keys. Its module builds it
(training.models.registry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from training.data.options import DataKind
from training.options import Section


class MLPOptions(Section):
    hidden: int = Field(128, ge=1, description="width of each hidden layer")
    depth: int = Field(2, ge=1, description="hidden layers")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    skip: bool = Field(
        True, description="a linear path from input to output beside the hidden layers"
    )


class CNNOptions(Section):
    channels: int = Field(32, ge=1, description="channels of the first stage (doubled after)")
    blocks: int = Field(2, ge=1, description="residual blocks per stage")
    stages: int = Field(2, ge=1, description="stages; each after the first halves the size")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)


class GPTOptions(Section):
    layers: int = Field(4, ge=1, description="transformer blocks")
    heads: int = Field(4, ge=1, description="attention heads per block")
    width: int = Field(128, ge=8, description="embedding width (divisible by heads)")
    context: int = Field(128, ge=2, description="tokens the model attends over")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    tied_embeddings: bool = Field(True, description="the output layer reuses the embedding")

    @model_validator(mode="after")
    def _heads_split_width(self) -> GPTOptions:
        if self.width % self.heads:
            raise ValueError(
                f"model.width ({self.width}) must be divisible by model.heads ({self.heads})"
            )
        return self


class TCNOptions(Section):
    channels: int = Field(32, ge=1, le=4096, description="channels of each convolution")
    layers: int = Field(4, ge=1, le=16, description="causal blocks; block i dilates by 2**i")
    kernel_size: int = Field(3, ge=2, le=64, description="taps of each convolution")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)


class DLRMOptions(Section):
    embedding_dim: int = Field(16, ge=1, le=1024, description="width of every embedding row")
    table_rows: int | list[int] | None = Field(
        None,
        description="rows of each id column's table (ids hashed in by remainder): one "
        "number for every table (capped at the column's id range), a list with one per "
        "data.categorical_columns entry, or null to size them from the data's distinct "
        "counts",
    )
    bottom: list[int] = Field(
        [64], description="hidden widths of the MLP from dense features to embedding_dim"
    )
    top: list[int] = Field(
        [64, 32], description="hidden widths of the MLP from the interactions to the logit"
    )

    @model_validator(mode="after")
    def _positive_sizes(self) -> DLRMOptions:
        rows = self.table_rows if isinstance(self.table_rows, list) else [self.table_rows or 1]
        if min(rows or [0]) < 1:
            raise ValueError(f"model.table_rows needs sizes >= 1 (got {self.table_rows!r})")
        if any(w < 1 for w in self.bottom + self.top):
            raise ValueError("model.bottom and model.top need widths >= 1")
        return self


@dataclass(frozen=True)
class Builtin:
    options: type[Section]
    kinds: tuple[DataKind, ...]  # the data it takes
    # Mesh dimensions beyond data parallelism ("tp", "pp"), and "embeddings" where its
    # embedding tables may be sharded across the ranks (parallel.embedding_sharding).
    splits: frozenset[str] = frozenset()


BUILTINS: dict[str, Builtin] = {
    "mlp": Builtin(MLPOptions, ("table", "image", "series")),
    "cnn": Builtin(CNNOptions, ("image",)),
    # Blocks to shard by columns and rows (tp) and to cut into pipeline stages (pp).
    "gpt": Builtin(GPTOptions, ("tokens",), frozenset({"tp", "pp"})),
    # A causal temporal convolution over a forecasting window's past values.
    "tcn": Builtin(TCNOptions, ("series",)),
    # Tables whose leading features are id codes (data.categorical_columns, clicks);
    # its embedding tables may be sharded over the ranks (parallel.embedding_sharding).
    "dlrm": Builtin(DLRMOptions, ("table",), frozenset({"embeddings"})),
}


def builtin(name: str | None) -> Builtin:
    if name not in BUILTINS:
        raise ValueError(
            f"model.name {name!r} is not a built-in model; choose one of "
            f"{', '.join(BUILTINS)}, or set model.target: package.module:factory "
            "to build your own"
        )
    return BUILTINS[name]


def parse_model_options(name: str | None, options: dict[str, Any]) -> Section:
    """The built-in's options, validated; errors name the key and the model's keys."""
    schema = builtin(name).options
    try:
        return schema(**options)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                problems.append(
                    f"model.{key} is not a key of model {name} (its keys: "
                    f"{', '.join(schema.model_fields)})"
                )
            else:
                where = f"model.{key}: " if key else ""
                problems.append(f"{where}{err['msg']} (got {err.get('input')!r})")
        raise ValueError("; ".join(problems)) from None


class ModelConfig(BaseModel):
    """`name` picks a built-in; `target: package.module:factory` builds the user's own
    module. The remaining keys belong to that model and are validated by it, so this
    section alone is open."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str | None = Field("mlp", description="a built-in: mlp, cnn, gpt, tcn, dlrm")
    target: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="package.module:factory called with the remaining keys",
    )

    @property
    def options(self) -> dict[str, Any]:
        """The model's own keys (everything but name and target)."""
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _one_way_to_build(self) -> ModelConfig:
        if self.target and self.name not in (None, "mlp"):
            raise ValueError(
                "set model.name or model.target, not both (name picks a built-in, target "
                "names your own factory as package.module:function)"
            )
        if not self.target:
            parse_model_options(self.name, self.options)
        return self


def check_model_layout(
    name: str | None, options: dict[str, Any], mesh: dict[str, int], stages: int
) -> None:
    """Raise ValueError naming the keys when the built-in cannot take this mesh."""
    for dim in ("tp", "pp"):
        if mesh[dim] > 1 and dim not in builtin(name).splits:
            raise ValueError(
                f"model {name} supports data parallelism only (parallel.dp_replicate, "
                f"parallel.dp_shard), not parallel.{dim}={mesh[dim]}: tensor and pipeline "
                "parallelism need a model with blocks and a plan, e.g. model.name: gpt"
            )
    if name != "gpt":
        return
    gpt = parse_model_options(name, options)
    tp, pp = mesh["tp"], mesh["pp"]
    if gpt.heads % tp:
        raise ValueError(
            f"parallel.tp={tp} needs model.heads divisible by {tp} (got {gpt.heads}): each "
            "tensor-parallel rank holds whole attention heads"
        )
    if pp > 1 and gpt.layers < stages:
        raise ValueError(
            f"parallel.pp={pp} cuts the model into {stages} stages and needs at least "
            f"{stages} blocks (model.layers is {gpt.layers}); raise model.layers or lower "
            "parallel.pp (or pp_stages_per_rank)"
        )
    if pp > 1 and gpt.tied_embeddings:
        raise ValueError(
            "parallel.pp > 1 puts the embedding and the output layer on different stages, "
            "so they cannot share weights: set model.tied_embeddings: false"
        )
