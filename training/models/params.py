"""The built-in models' own keys, validated with the config (no torch imported here).

Each built-in names the tasks it can learn and a pydantic schema for its keys in the
`model:` section of params.yaml; its module builds it (training.models.registry).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MLPOptions(_Options):
    hidden: int = Field(128, ge=1, description="width of each hidden layer")
    depth: int = Field(2, ge=1, description="hidden layers")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    skip: bool = Field(
        True, description="a linear path from input to output beside the hidden layers"
    )


class CNNOptions(_Options):
    channels: int = Field(32, ge=1, description="channels of the first stage (doubled after)")
    blocks: int = Field(2, ge=1, description="residual blocks per stage")
    stages: int = Field(2, ge=1, description="stages; each after the first halves the size")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)


class GPTOptions(_Options):
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


BUILTINS: dict[str, tuple[type[_Options], tuple[str, ...]]] = {
    "mlp": (MLPOptions, ("classification", "regression")),
    "cnn": (CNNOptions, ("classification", "regression")),
    "gpt": (GPTOptions, ("language_modeling",)),
}


def _entry(name: str | None) -> tuple[type[_Options], tuple[str, ...]]:
    if name not in BUILTINS:
        raise ValueError(
            f"model.name {name!r} is not a built-in model; choose one of "
            f"{', '.join(BUILTINS)}, or set model.target: package.module:factory "
            "to build your own"
        )
    return BUILTINS[name]


def parse_model_options(name: str | None, options: dict[str, Any]) -> _Options:
    """The built-in's options, validated; errors name the key and the model's keys."""
    schema, _ = _entry(name)
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


def check_model_options(name: str | None, options: dict[str, Any]) -> None:
    parse_model_options(name, options)


def check_model_task(name: str | None, task: str) -> None:
    _, tasks = _entry(name)
    if task not in tasks:
        fits = [n for n, (_, t) in BUILTINS.items() if task in t]
        raise ValueError(
            f"model {name} cannot learn task {task}; for {task} use model.name {' or '.join(fits)}"
        )


# What each built-in can be split by, besides data parallelism (DDP, FSDP): gpt has
# blocks to shard by columns and rows (tp) and to cut into pipeline stages (pp).
LAYOUTS = {"mlp": frozenset(), "cnn": frozenset(), "gpt": frozenset({"tp", "pp"})}


def check_model_layout(
    name: str | None, options: dict[str, Any], mesh: dict[str, int], stages: int
) -> None:
    """Raise ValueError naming the keys when the model cannot take this mesh."""
    for dim in ("tp", "pp"):
        if mesh[dim] > 1 and dim not in LAYOUTS.get(name, frozenset()):
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
