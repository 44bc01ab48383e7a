"""The one place a model is built: a built-in by name, or the user's own by target.

`build_model` gives the module the output its task needs (the task's objective says
how many outputs, and how they map back to the label's units) and wraps it so that it
takes raw inputs and predicts in the label's units (training.models.standardize). Each
built-in's entry says which data it takes (training.models.options), so a mismatch is a
ConfigError before any worker starts (`check_buildable`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from training.data.spec import DataSpec
from training.errors import ConfigError
from training.models.cnn import ResNet
from training.models.dlrm import DLRM
from training.models.gpt import GPT
from training.models.level import LevelRelative
from training.models.mlp import MLP
from training.models.options import (
    BUILTINS,
    DLRMOptions,
    ModelConfig,
    builtin,
    parse_model_options,
)
from training.models.standardize import Standardized
from training.models.tcn import TCN
from training.models.user import build_user_model
from training.objectives import objective_for, tasks_learning


def table_rows(options: DLRMOptions, data: DataSpec) -> tuple[int, ...]:
    """Rows of each id column's embedding table: model.table_rows, else sized from the
    data (DataSpec.default_table_rows); ConfigError when they do not match the data."""
    if not data.num_categorical:
        raise ConfigError(
            "model dlrm needs id columns, but the data has none: set "
            "data.categorical_columns to the columns holding ids (user, item, ...) or "
            "use data.source: clicks"
        )
    rows = options.table_rows
    if rows is None:
        return data.default_table_rows()
    if isinstance(rows, int):
        bounds = data.categorical_bound or (rows,) * data.num_categorical
        return tuple(min(rows, max(1, bound)) for bound in bounds)
    if len(rows) != data.num_categorical:
        raise ConfigError(
            f"model.table_rows lists {len(rows)} sizes, but the data has "
            f"{data.num_categorical} id columns ({', '.join(data.categorical_columns)}); "
            "give one size per column in that order, or one number for all"
        )
    return tuple(rows)


# How each built-in is built from (its options, the data, the output size).
BUILDERS: dict[str, Callable[[Any, DataSpec, int], nn.Module]] = {
    "mlp": lambda o, data, out: MLP(
        int(np.prod(data.feature_shape)),
        out,
        hidden=o.hidden,
        depth=o.depth,
        dropout=o.dropout,
        skip=o.skip,
    ),
    "cnn": lambda o, data, out: ResNet(
        data.feature_shape,
        out,
        channels=o.channels,
        stages=o.stages,
        blocks=o.blocks,
        dropout=o.dropout,
    ),
    "gpt": lambda o, data, out: GPT(
        out,
        layers=o.layers,
        heads=o.heads,
        width=o.width,
        context=o.context,
        dropout=o.dropout,
        tied_embeddings=o.tied_embeddings,
    ),
    "tcn": lambda o, data, out: _tcn(o, data, out),
    "dlrm": lambda o, data, out: DLRM(
        table_rows(o, data),
        data.num_dense,
        out,
        embedding_dim=o.embedding_dim,
        bottom=o.bottom,
        top=o.top,
    ),
}


def _tcn(options: Any, data: DataSpec, horizon: int) -> nn.Module:
    """A window's features are its context, then its covariates (training.data.series)."""
    width = int(np.prod(data.feature_shape))
    context = int((data.forecast or {}).get("context", width))
    return TCN(
        context,
        width - context,
        horizon,
        channels=options.channels,
        layers=options.layers,
        kernel_size=options.kernel_size,
        dropout=options.dropout,
    )


# In words, for error messages: what each kind of data is.
KIND_NEEDS = {
    "table": "table features",
    "image": "image-shaped features, (H, W) or (C, H, W) per example (data.feature_shape)",
    "tokens": "token ids from a text source (data.source: text or stdlib)",
    "series": "forecasting windows of a time series (task.type: forecasting)",
}


def _data_in_words(data: DataSpec) -> str:
    if data.kind == "tokens":
        return f"token ids (vocabulary {data.vocab_size})"
    return f"{data.kind} features of shape {list(data.feature_shape)}"


def _build_builtin(model_cfg: ModelConfig, task: str, data: DataSpec, size: int) -> nn.Module:
    try:
        entry = builtin(model_cfg.name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if task not in _tasks(model_cfg.name):
        fits = [name for name in BUILTINS if task in _tasks(name)]
        raise ConfigError(
            f"model {model_cfg.name} cannot learn task {task}; for {task} use model.name "
            f"{' or '.join(fits)}"
        )
    if data.kind not in entry.kinds:
        fits = [n for n, b in BUILTINS.items() if data.kind in b.kinds and task in _tasks(n)]
        fix = f"use model.name {' or '.join(fits)}" if fits else "set model.target"
        if "image" in entry.kinds and data.kind == "table":
            fix += " or give the features an image shape (data.feature_shape, e.g. [8, 8])"
        needs = " or ".join(KIND_NEEDS[kind] for kind in entry.kinds)
        raise ConfigError(
            f"model {model_cfg.name} needs {needs}, but the data holds "
            f"{_data_in_words(data)}; {fix}"
        )
    try:
        options = parse_model_options(model_cfg.name, model_cfg.options)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return BUILDERS[model_cfg.name](options, data, size)


def _tasks(name: str) -> list[str]:
    return tasks_learning(BUILTINS[name].kinds)


def build_model(model_cfg: ModelConfig, task: str, data: DataSpec) -> nn.Module:
    """The model for `task` on `data`: takes raw inputs, predicts in the label's units.

    Its output is what the task's objective asks for (`output_shape`): logits per class,
    one value per row, or logits per token. Tables are standardized inside the model
    (train-split statistics as buffers), and outputs the task scales (regression) are
    mapped back into the label's units; images and tokens pass as they are. Built-ins come
    back unwrapped when nothing is to be done, so their parameter names stay their own.
    """
    objective = objective_for(task, data)
    size = objective.output_size
    if model_cfg.target:
        model = build_user_model(model_cfg.target, model_cfg.options, task, data, size)
    else:
        model = _build_builtin(model_cfg, task, data, size)
    if data.kind == "series":
        # Windows are already scaled per series (training.data.series); the model sees
        # them relative to their last value (training.models.level).
        return LevelRelative(model, int((data.forecast or {}).get("context", 1)))
    # Dense features are standardized; id codes pass unchanged (feature_scaling).
    scaling = data.feature_scaling() if data.kind == "table" else None
    labels = objective.label_scaling()
    if scaling is None and labels is None:
        return model
    return Standardized(
        model,
        feature_mean=scaling[0] if scaling else None,
        feature_std=scaling[1] if scaling else None,
        label_mean=labels[0] if labels else None,
        label_std=labels[1] if labels else None,
    )


def context_length(model_cfg: ModelConfig, data_kind: str) -> int | None:
    """Tokens per training window for token data (None for other data): the gpt's
    `context`, or `model.context` of a user's model, which must declare it (it is
    passed to the factory like the section's other keys)."""
    if data_kind != "tokens":
        return None
    if not model_cfg.target:
        try:
            options = parse_model_options(model_cfg.name, model_cfg.options)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        context = getattr(options, "context", None)
        if context is None:
            raise ConfigError(f"model {model_cfg.name} takes no token windows (no context)")
        return int(context)
    context = model_cfg.options.get("context")
    if not isinstance(context, int) or isinstance(context, bool) or context < 2:
        raise ConfigError(
            f"model.target {model_cfg.target!r} learns from token ids, so the model section "
            "needs model.context: the tokens per training window (an integer >= 2, got "
            f"{context!r}); your factory receives it too"
        )
    return context


def example_input(model_cfg: ModelConfig, data: DataSpec, batch: int = 2) -> np.ndarray:
    """A batch the model takes (training.data.spec.DataSpec.example), its token windows
    no longer than the model's context."""
    return data.example(batch, context_length(model_cfg, data.kind))


def check_buildable(
    model_cfg: ModelConfig, task: str, data: DataSpec, mesh: dict[str, int] | None = None
) -> None:
    """Build the model and run an example batch through it; raise ConfigError (exit 2)
    when it cannot be built for this task and data, when its output has the wrong shape,
    or when it cannot be split as the mesh asks (tp needs the model's
    tensor_parallel_plan(), pp its pipeline_stage()). Meant for the train stage, before
    any worker starts."""
    example = example_input(model_cfg, data)
    model = build_model(model_cfg, task, data)
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
    expected = objective_for(task, data).output_shape(example.shape)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"{what} returned {got} for an input of shape {list(example.shape)}; {task} "
            f"needs an output of shape {list(expected)}"
        )
