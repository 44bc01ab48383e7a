"""Small user model factories, named by `model.target` in tests (tests.user_models:NAME).

`tiny_net` is what a user would write; the others fail in the ways the model registry
must report as configuration errors.
"""

from __future__ import annotations

import math

from torch import nn


def tiny_net(input_shape: tuple[int, ...], output_size: int, hidden: int = 16) -> nn.Module:
    """One hidden layer over the flattened features (asks only for the data it uses)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, output_size),
    )


def tiny_language_model(vocab_size: int, context: int = 0, width: int = 8) -> nn.Module:
    """Token ids (B, T) -> logits (B, T, vocab_size), each position on its own (so it
    ignores `context`, the window length gradline trains it on)."""
    return nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))


def records_keywords(**kwargs) -> nn.Module:
    """Takes **kwargs, so it is offered every data keyword; keeps them to be inspected."""
    model = nn.Linear(math.prod(kwargs["input_shape"]), kwargs["output_size"])
    model.received = kwargs
    return model


def needs_depth(input_shape: tuple[int, ...], output_size: int, depth: int) -> nn.Module:
    return nn.Linear(math.prod(input_shape), output_size)


def raises(**kwargs) -> nn.Module:
    raise ValueError("hidden must be even")


def not_a_module(**kwargs) -> dict:
    return {"weights": [1, 2, 3]}


def wrong_output(input_shape: tuple[int, ...]) -> nn.Module:
    """Ignores output_size: three outputs whatever the task needs."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 3))


NOT_CALLABLE = 42
