"""The one place a model is built: a built-in by name, or the user's own by target.

`build_model` gives the module the output size the task needs and wraps it so that it
takes raw inputs and predicts in the label's units (training.models.standardize). Each
built-in's entry says which data it takes and which tasks it learns, so a mismatch is a
ConfigError before any worker starts (`check_buildable`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from training.data.spec import DataKind, DataSpec
from training.errors import ConfigError
from training.models.cnn import ResNet
from training.models.gpt import GPT
from training.models.mlp import MLP
from training.models.params import BUILTINS, parse_model_options
from training.models.standardize import Standardized
from training.models.user import build_user_model

if TYPE_CHECKING:
    from training.config import ModelConfig

# Tokens in the example input of a language model (fewer when its context is shorter).
EXAMPLE_TOKENS = 16


@dataclass(frozen=True)
class ModelEntry:
    """A built-in: what it takes and how it is built. Its options schema and tasks live in
    training.models.params (read by the config without importing torch)."""

    name: str
    kinds: tuple[DataKind, ...]  # the data it takes
    needs: str  # the same, in words, for error messages
    build: Callable[[Any, DataSpec, int], nn.Module]  # (options, data, output size)

    @property
    def options_schema(self) -> type:
        return BUILTINS[self.name][0]

    @property
    def tasks(self) -> tuple[str, ...]:
        return BUILTINS[self.name][1]


REGISTRY: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            "mlp",
            ("table", "image"),
            "features of any shape (flattened)",
            lambda o, data, out: MLP(
                int(np.prod(data.feature_shape)),
                out,
                hidden=o.hidden,
                depth=o.depth,
                dropout=o.dropout,
                skip=o.skip,
            ),
        ),
        ModelEntry(
            "cnn",
            ("image",),
            "image-shaped features, (H, W) or (C, H, W) per example (data.feature_shape)",
            lambda o, data, out: ResNet(
                data.feature_shape,
                out,
                channels=o.channels,
                stages=o.stages,
                blocks=o.blocks,
                dropout=o.dropout,
            ),
        ),
        ModelEntry(
            "gpt",
            ("tokens",),
            "token ids from a text source (data.source: text or stdlib)",
            lambda o, data, out: GPT(
                out,
                layers=o.layers,
                heads=o.heads,
                width=o.width,
                context=o.context,
                dropout=o.dropout,
                tied_embeddings=o.tied_embeddings,
            ),
        ),
    )
}


def model_entry(name: str | None) -> ModelEntry:
    if name not in REGISTRY:
        raise ConfigError(
            f"model.name {name!r} is not a built-in model; choose one of "
            f"{', '.join(REGISTRY)}, or set model.target: package.module:factory"
        )
    return REGISTRY[name]


def output_size(task: str, data: DataSpec) -> int:
    """Outputs per example (per token for language models) that `task` needs."""
    if task == "classification":
        if not data.num_classes:
            raise ConfigError(
                "classification needs the number of classes, and the data has none: set "
                "data.num_classes, or task.type: regression for float labels"
            )
        return int(data.num_classes)
    if task == "regression":
        return 1
    if task == "language_modeling":
        if not data.vocab_size:
            raise ConfigError(
                "language_modeling needs token data with a vocabulary: use a text source "
                "(data.source: text or stdlib)"
            )
        return int(data.vocab_size)
    raise ConfigError(
        f"task.type {task!r} is unknown; use classification, regression or language_modeling"
    )


def _data_in_words(data: DataSpec) -> str:
    if data.kind == "tokens":
        return f"token ids (vocabulary {data.vocab_size})"
    return f"{data.kind} features of shape {list(data.feature_shape)}"


def _build_builtin(model_cfg: ModelConfig, task: str, data: DataSpec, size: int) -> nn.Module:
    entry = model_entry(model_cfg.name)
    if task not in entry.tasks:
        fits = [name for name, e in REGISTRY.items() if task in e.tasks]
        raise ConfigError(
            f"model {entry.name} cannot learn task {task}; for {task} use model.name "
            f"{' or '.join(fits)}"
        )
    if data.kind not in entry.kinds:
        fits = [name for name, e in REGISTRY.items() if data.kind in e.kinds and task in e.tasks]
        fix = f"use model.name {' or '.join(fits)}" if fits else "set model.target"
        if entry.name == "cnn":
            fix += " or give the features an image shape (data.feature_shape, e.g. [8, 8])"
        raise ConfigError(
            f"model {entry.name} needs {entry.needs}, but the data holds "
            f"{_data_in_words(data)}; {fix}"
        )
    try:
        options = parse_model_options(entry.name, model_cfg.options)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return entry.build(options, data, size)


def build_model(model_cfg: ModelConfig, task: str, data: DataSpec) -> nn.Module:
    """The model for `task` on `data`: takes raw inputs, predicts in the label's units.

    classification: (B, *feature_shape) float32 -> logits (B, num_classes)
    regression:     (B, *feature_shape) float32 -> values (B,) in the label's units
    language_modeling: ids (B, T) int64 -> logits (B, T, vocab_size)
    Tables are standardized inside the model (train-split statistics as buffers); images
    and tokens pass as they are. Built-ins come back unwrapped when nothing is to be done
    (images classified, language models), so their parameter names stay their own.
    """
    size = output_size(task, data)
    if model_cfg.target:
        model = build_user_model(model_cfg.target, model_cfg.options, task, data, size)
    else:
        model = _build_builtin(model_cfg, task, data, size)
    scale_features = data.kind == "table" and data.feature_mean is not None
    if not scale_features and task != "regression":
        return model
    return Standardized(
        model,
        feature_mean=data.feature_mean if scale_features else None,
        feature_std=data.feature_std if scale_features else None,
        label_mean=(data.label_mean or 0.0) if task == "regression" else None,
        label_std=data.label_std if task == "regression" else None,
    )


def context_length(model_cfg: ModelConfig, task: str) -> int | None:
    """Tokens per training window for a language model (None for other tasks): the gpt's
    `context`, or `model.context` of a user's language model, which must declare it (it
    is passed to the factory like the section's other keys)."""
    if task != "language_modeling":
        return None
    if not model_cfg.target:
        try:
            options = parse_model_options(model_cfg.name, model_cfg.options)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return int(options.context)
    context = model_cfg.options.get("context")
    if not isinstance(context, int) or isinstance(context, bool) or context < 2:
        raise ConfigError(
            f"model.target {model_cfg.target!r} learns language_modeling, so the model "
            "section needs model.context: the tokens per training window (an integer >= 2, "
            f"got {context!r}); your factory receives it too"
        )
    return context


def example_input(model_cfg: ModelConfig, task: str, data: DataSpec, batch: int = 2) -> np.ndarray:
    """A batch the model takes, for the MLflow signature and a build check: float32
    features in their raw shape (near the train split's values for tables), or int64
    token ids (B, T)."""
    rng = np.random.default_rng(0)
    if data.kind == "tokens":
        length = min(context_length(model_cfg, task) or EXAMPLE_TOKENS, EXAMPLE_TOKENS)
        return rng.integers(0, data.vocab_size or 2, size=(batch, length), dtype=np.int64)
    rows = rng.standard_normal((batch, *data.feature_shape))
    if data.kind == "table" and data.feature_mean is not None:
        rows = rows * np.asarray(data.feature_std) + np.asarray(data.feature_mean)
    return rows.astype(np.float32)


def expected_output_shape(task: str, data: DataSpec, example: np.ndarray) -> tuple[int, ...]:
    size = output_size(task, data)
    if task == "regression":
        return (example.shape[0],)
    if task == "language_modeling":
        return (*example.shape, size)
    return (example.shape[0], size)


def check_buildable(
    model_cfg: ModelConfig, task: str, data: DataSpec, mesh: dict[str, int] | None = None
) -> None:
    """Build the model and run an example batch through it; raise ConfigError (exit 2)
    when it cannot be built for this task and data, when its output has the wrong shape,
    or when it cannot be split as the mesh asks (tp needs the model's
    tensor_parallel_plan(), pp its pipeline_stage()). Meant for the train stage, before
    any worker starts."""
    context_length(model_cfg, task)
    model = build_model(model_cfg, task, data)
    example = example_input(model_cfg, task, data)
    what = model_cfg.target or f"model {model_cfg.name}"
    for dim, method in (("tp", "tensor_parallel_plan"), ("pp", "pipeline_stage")):
        if (mesh or {}).get(dim, 1) > 1 and not callable(getattr(model, method, None)):
            raise ConfigError(
                f"{what} has no {method}(): a model without one cannot use "
                f"parallel.{dim}={mesh[dim]}; set parallel.{dim}: 1 (data parallelism, "
                f"parallel.dp_shard, works for any model) or give the module {method}()"
            )
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.from_numpy(example))
    except Exception as exc:
        raise ConfigError(
            f"{what} failed on an example batch of shape {list(example.shape)} "
            f"({example.dtype}): {type(exc).__name__}: {exc}"
        ) from exc
    expected = expected_output_shape(task, data, example)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"{what} returned {got} for an input of shape {list(example.shape)}; {task} "
            f"needs an output of shape {list(expected)}"
        )
