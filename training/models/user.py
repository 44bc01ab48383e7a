"""The user's own model: `model.target: package.module:factory` in params.yaml.

The factory is called with keyword arguments, and returns a torch.nn.Module:
- every key of the model section but `name` and `target`, as given;
- those of the data keywords below that it names as parameters (all of them if it takes
  **kwargs), so a factory asks only for what it uses:
    task         "classification", "regression" or "language_modeling"
    data_kind    "table", "image" or "tokens"
    input_shape  one example's feature shape, e.g. (64,) or (8, 8); () for tokens
    output_size  outputs per example (per token for language models): the number of
                 classes, 1 for regression, the vocabulary size for language models
    num_classes  classification: the number of classes, else None
    vocab_size   language_modeling: the vocabulary size, else None

What the module computes: classification (B, *input_shape) -> logits (B, num_classes);
regression -> (B, 1) or (B,); language modeling token ids (B, T) -> logits (B, T, V).
Table features arrive standardized, and regression targets are standardized: gradline
wraps the module so the saved model takes raw rows and predicts in the label's units.

Every failure (import, attribute, call, result) is a ConfigError that says what to fix.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from training.data.spec import DataSpec
from training.errors import ConfigError

DATA_KEYWORDS = ("task", "data_kind", "input_shape", "output_size", "num_classes", "vocab_size")


def split_target(target: str) -> tuple[str, str]:
    module, sep, attribute = target.partition(":")
    if not sep or not module or not attribute:
        raise ConfigError(
            f"model.target {target!r} must be package.module:factory, e.g. "
            "my_models.nets:build (a function in an importable module)"
        )
    return module, attribute


def import_factory(target: str) -> Callable[..., Any]:
    """The factory `target` names. The current folder (the project, where stages run) is
    searched after the installed packages, so a package beside params.yaml is found."""
    module_name, attribute = split_target(target)
    here = str(Path.cwd())
    if here not in sys.path:
        sys.path.append(here)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(
                f"model.target {target!r}: no module named {missing!r}. Put the package in "
                f"the project folder ({here}) or install it into this environment "
                "(pip install -e path/to/it), and check the spelling of the target"
            ) from None
        raise ConfigError(
            f"model.target {target!r}: importing {module_name} failed because it imports "
            f"{missing!r}, which is not installed; install it (pip install ...)"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"model.target {target!r}: importing {module_name} raised "
            f"{type(exc).__name__}: {exc}; fix the module so that it imports"
        ) from None
    factory = getattr(module, attribute, None)
    if factory is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(
            f"model.target {target!r}: module {module_name} has no attribute {attribute!r}; "
            f"its public callables: {', '.join(found) or 'none'}"
        )
    if not callable(factory):
        raise ConfigError(
            f"model.target {target!r}: {attribute} is not callable (it is the "
            f"{type(factory).__name__} {factory!r}); point model.target at a function or "
            "class that builds the model"
        )
    return factory


def data_keywords(task: str, data: DataSpec, output_size: int) -> dict[str, Any]:
    return {
        "task": task,
        "data_kind": data.kind,
        "input_shape": tuple(data.feature_shape),
        "output_size": output_size,
        "num_classes": data.num_classes,
        "vocab_size": data.vocab_size,
    }


def _arguments(
    target: str, factory: Callable[..., Any], options: dict[str, Any], offered: dict[str, Any]
) -> dict[str, Any]:
    """The keyword arguments `factory` is called with; mismatches named key by key."""
    clash = sorted(set(options) & set(offered))
    if clash:
        raise ConfigError(
            f"model.{clash[0]} clashes with a value gradline passes to {target} from the "
            f"data ({', '.join(DATA_KEYWORDS)}); rename that key in the model section"
        )
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer everything
        return {**offered, **options}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    named = {n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    if not takes_any:
        unknown = [key for key in options if key not in named]
        if unknown:
            raise ConfigError(
                f"model.{unknown[0]} is not a parameter of {target} (its parameters: "
                f"{', '.join(parameters) or 'none'}); remove the key or add the parameter"
            )
    arguments = {k: v for k, v in offered.items() if takes_any or k in named}
    arguments.update(options)
    for name, parameter in parameters.items():
        required = parameter.default is inspect.Parameter.empty and parameter.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        if required and name not in arguments:
            raise ConfigError(
                f"{target} needs the argument {name!r}: add model.{name} to the model "
                f"section of params.yaml (gradline itself passes {', '.join(DATA_KEYWORDS)})"
            )
    return arguments


def build_user_model(
    target: str, options: dict[str, Any], task: str, data: DataSpec, output_size: int
) -> nn.Module:
    factory = import_factory(target)
    arguments = _arguments(target, factory, options, data_keywords(task, data, output_size))
    try:
        model = factory(**arguments)
    except Exception as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
        raise ConfigError(
            f"model.target {target!r}: calling it with ({shown}) raised "
            f"{type(exc).__name__}: {exc}; fix the factory or the model section's keys"
        ) from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.target {target!r} returned a {type(model).__name__}; it must return a "
            "torch.nn.Module"
        )
    return model
