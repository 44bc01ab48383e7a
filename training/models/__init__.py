"""Models: built-ins (mlp, cnn, gpt) in a registry, or the user's own by `model.target`.

Modules, each with one job:
    params       the built-ins' keys in params.yaml and the tasks they learn (no torch)
    registry     build_model, example_input, check_buildable, context_length: the one
                 place models are built
    standardize  tables standardized and regression de-standardized inside the model
    mlp, cnn, gpt the built-in architectures (gpt also samples: gpt.generate)
    user         importing and calling the user's factory
    folder       ModelSpec and the saved model folder (save_model_dir, load_model_dir)

Model code holds no distributed code: parallel wrappers are applied to a built model.
The names below are imported on first use, so `import training.models.params` (done by
the config) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_model": "training.models.registry",
    "check_buildable": "training.models.registry",
    "context_length": "training.models.registry",
    "example_input": "training.models.registry",
    "output_size": "training.models.registry",
    "ModelSpec": "training.models.folder",
    "save_model_dir": "training.models.folder",
    "load_model_dir": "training.models.folder",
    # A model logged by training.serving, read back from MLflow (mlflow imported on use).
    "load_registered_model": "training.serving",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
