"""The trained model as a folder: weights, what rebuilds them, and the tokenizer.

    model.pt        the state_dict (loaded with weights_only=True: no code runs on load)
    spec.json       {"task": ..., "model": the model section, "data": DataSpec.to_dict()}
    tokenizer.json  language models only: the tokenizer their ids belong to

The folder is written aside and swapped in whole, so a crash never leaves half a model.
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.atomic import atomic_dir
from training.data.spec import DataSpec
from training.errors import ProjectError
from training.models.options import ModelConfig
from training.models.registry import build_model

MODEL_WEIGHTS = "model.pt"
MODEL_SPEC = "spec.json"
TOKENIZER_FILE = "tokenizer.json"


class UnsafeModelFile(ProjectError):
    """model.pt is not a plain state_dict: weights_only loading refused an object in it."""


def _refused_part(exc: pickle.UnpicklingError) -> str:
    """The line of torch's long refusal that names what was refused."""
    for line in str(exc).splitlines():
        if "WeightsUnpickler error:" in line:
            refused = line.split("WeightsUnpickler error:", 1)[1].strip()
            return refused.split(" was not an allowed global", 1)[0].rstrip(".")
    return "an object weights_only loading does not accept"


@dataclass(frozen=True)
class ModelSpec:
    """Everything that rebuilds the architecture, as plain JSON-able values."""

    task: str
    model: dict[str, Any]  # the model section: name or target, and the model's own keys
    data: dict[str, Any]  # DataSpec.to_dict()

    @classmethod
    def create(cls, task: str, model_cfg: ModelConfig, data: DataSpec) -> ModelSpec:
        return cls(task=task, model=model_cfg.model_dump(), data=data.to_dict())

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.model_validate(self.model)

    @property
    def data_spec(self) -> DataSpec:
        return DataSpec.from_dict(self.data)

    def to_dict(self) -> dict[str, Any]:
        # Through JSON so tuples become lists: the dict equals what spec.json holds.
        return json.loads(json.dumps({"task": self.task, "model": self.model, "data": self.data}))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelSpec:
        return cls(task=values["task"], model=dict(values["model"]), data=dict(values["data"]))


def save_model_dir(
    model: nn.Module, spec: ModelSpec, folder: Path, tokenizer_file: Path | None = None
) -> None:
    """Write the folder atomically. `model` is the module build_model returned (not a
    DDP or compiled wrapper); language models need the tokenizer their ids come from."""
    if spec.data_spec.kind == "tokens" and tokenizer_file is None:
        raise ValueError("a token model's folder needs its tokenizer: pass tokenizer_file")
    state = {key: value.detach().cpu() for key, value in model.state_dict().items()}
    with atomic_dir(Path(folder)) as staging:
        torch.save(state, staging / MODEL_WEIGHTS)
        (staging / MODEL_SPEC).write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, staging / TOKENIZER_FILE)


def read_model_spec(folder: Path) -> ModelSpec:
    path = Path(folder) / MODEL_SPEC
    if not path.is_file():
        raise ProjectError(
            f"{path} not found: {folder} is not a trained model folder (the train stage "
            "writes one; run `gradline run` or `dvc repro train`)"
        )
    try:
        return ModelSpec.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ProjectError(f"{path} is not a model spec ({exc}); train the model again") from None


def load_model_dir(folder: Path) -> tuple[nn.Module, ModelSpec]:
    """The model in eval mode on the CPU, and its spec. A user model's factory must be
    importable here too (ConfigError otherwise)."""
    spec = read_model_spec(folder)
    model = build_model(spec.model_config, spec.task, spec.data_spec)
    weights = Path(folder) / MODEL_WEIGHTS
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    except pickle.UnpicklingError as exc:
        raise UnsafeModelFile(
            f"{weights} holds more than tensors ({_refused_part(exc)}), so gradline will not "
            "load it: unpickling it could run code. Do not unpickle it yourself "
            "unless you wrote it. Train the model again (gradline run), "
            "or save a plain state_dict there: torch.save(model.state_dict(), path)"
        ) from None
    except (OSError, RuntimeError) as exc:
        raise ProjectError(
            f"cannot load {weights} into the model its spec describes: {exc}; train it again"
        ) from None
    model.eval()
    return model, spec
