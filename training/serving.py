"""The trained model as an MLflow model anyone can call: `mlflow.pyfunc.load_model(uri)`.

The pyfunc model packs the model folder (weights, spec, tokenizer) as an artifact and
the `training` package (and a user model's own code) as code, and predicts on raw
inputs:
- tables: a DataFrame with the feature columns (DataSpec.feature_names, else f0..fN-1)
  -> class ids (classification) or values in the label's units (regression);
- images: a float32 array (N, *feature_shape) -> class ids or values;
- language models: a DataFrame with a "prompt" column -> a DataFrame with a "text"
  column, the sampled continuation; generation settings (max_new_tokens, temperature,
  top_k (0: no limit), seed) are signature params defaulting to the task's settings.
`Predictor` does the work without MLflow; the pyfunc class only adapts it. mlflow is
imported inside functions, so importing this module costs nothing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from training.data.spec import DataSpec

MODEL_DIR_ARTIFACT = "model_dir"
PREDICT_BATCH_ROWS = 1024  # rows per forward pass: bounds memory on big inputs
GENERATION_KEYS = ("max_new_tokens", "temperature", "top_k", "seed")


def feature_columns(data: DataSpec) -> list[str]:
    """The column names a table model's pyfunc input has."""
    size = int(np.prod(data.feature_shape))
    if data.feature_names and len(data.feature_names) == size:
        return list(data.feature_names)
    return [f"f{i}" for i in range(size)]


def generation_settings(generation: dict[str, Any]) -> dict[str, Any]:
    """max_new_tokens, temperature, top_k (0: none) and seed, with typed defaults."""
    return {
        "max_new_tokens": int(generation.get("max_new_tokens", 120)),
        "temperature": float(generation.get("temperature", 0.8)),
        "top_k": int(generation.get("top_k") or 0),
        "seed": int(generation.get("seed", 0)),
    }


class Predictor:
    """Raw inputs -> predictions for one model folder (no MLflow here)."""

    def __init__(self, folder: Path) -> None:
        from training.models.folder import TOKENIZER_FILE, load_model_dir

        self.model, self.spec = load_model_dir(Path(folder))
        self.data = self.spec.data_spec
        self.tokenizer = None
        if self.spec.task == "language_modeling":
            from training.data.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(Path(folder) / TOKENIZER_FILE)

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        if self.spec.task == "language_modeling":
            return self._generate(model_input, params or {})
        return self._predict_rows(self._features(model_input))

    def _features(self, model_input: Any) -> np.ndarray:
        """Rows as float32 (N, *feature_shape): a DataFrame (columns by name where they
        carry the feature names, else in order) or an array, flattened or not."""
        import pandas as pd

        shape = tuple(self.data.feature_shape)
        if isinstance(model_input, pd.DataFrame):
            names = feature_columns(self.data)
            if set(names) <= set(model_input.columns):
                model_input = model_input[names]
            model_input = model_input.to_numpy()
        rows = np.asarray(model_input, dtype=np.float32)
        if rows.ndim < 2 or int(np.prod(rows.shape[1:])) != int(np.prod(shape)):
            raise ValueError(
                f"expected rows of {int(np.prod(shape))} features (shape {list(shape)}), got "
                f"an input of shape {list(rows.shape)}"
            )
        return rows.reshape(len(rows), *shape)

    def _predict_rows(self, rows: np.ndarray) -> np.ndarray:
        """Class ids (int64) or values in the label's units (float32), one per row."""
        import torch

        classify = self.spec.task == "classification"
        outputs = [np.zeros(0, dtype=np.int64 if classify else np.float32)]
        with torch.no_grad():
            for start in range(0, len(rows), PREDICT_BATCH_ROWS):
                out = self.model(torch.from_numpy(rows[start : start + PREDICT_BATCH_ROWS]))
                outputs.append((out.argmax(dim=1) if classify else out.float()).numpy())
        return np.concatenate(outputs)

    def _generate(self, model_input: Any, params: dict[str, Any]):
        """Each prompt's continuation, sampled with a generator seeded by `seed` alone, so
        a prompt gets the same text whatever else is in the batch."""
        import pandas as pd
        import torch

        from training.models.gpt import generate

        settings = generation_settings(params)
        if isinstance(model_input, pd.DataFrame):
            prompts = model_input["prompt"].tolist()
        elif isinstance(model_input, str):
            prompts = [model_input]
        else:
            prompts = list(model_input)
        context = self.spec.model.get("context") or getattr(self.model, "context", None)
        texts = []
        for prompt in prompts:
            # A prompt starts a document, and in training documents follow an end-of-document
            # id; so does the prompt here (an empty prompt samples a document from its start).
            ids = [self.tokenizer.eot, *self.tokenizer.encode(str(prompt))]
            generator = torch.Generator().manual_seed(settings["seed"])
            out = generate(
                self.model,
                torch.tensor([ids], dtype=torch.long),
                settings["max_new_tokens"],
                settings["temperature"],
                settings["top_k"] or None,
                context,
                generator=generator,
            )
            new = out[0, len(ids) :].tolist()
            if self.tokenizer.eot in new:  # the document ended: stop the text there
                new = new[: new.index(self.tokenizer.eot)]
            texts.append(self.tokenizer.decode(new))
        return pd.DataFrame({"text": texts})


def _python_model():
    """The pyfunc class, defined here so that mlflow is imported only when it is used
    (cloudpickle stores a class defined in a function by value; its methods reach
    `Predictor` through the `training` package shipped as code)."""
    import mlflow.pyfunc

    class GradlineModel(mlflow.pyfunc.PythonModel):
        # The input is a table, an image array or prompts, described by an explicit
        # signature: MLflow's switch that stops it asking for predict's type hints (its own
        # chat models set it too). Were it gone, only a warning would come back.
        _skip_type_hint_validation = True

        def load_context(self, context) -> None:
            self.predictor = Predictor(Path(context.artifacts[MODEL_DIR_ARTIFACT]))

        def predict(self, context, model_input, params=None):
            return self.predictor.predict(model_input, params)

    return GradlineModel()


def _signature_and_example(predictor: Predictor, generation: dict[str, Any], prompts):
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema, TensorSpec

    from training.models.registry import example_input

    spec, data = predictor.spec, predictor.data
    if spec.task == "language_modeling":
        settings = generation_settings(generation)
        types = {"max_new_tokens": "long", "temperature": "double", "top_k": "long"}
        params = ParamSchema(
            [ParamSpec(key, types.get(key, "long"), settings[key]) for key in GENERATION_KEYS]
        )
        signature = ModelSignature(
            inputs=Schema([ColSpec("string", "prompt")]),
            outputs=Schema([ColSpec("string", "text")]),
            params=params,
        )
        return signature, pd.DataFrame({"prompt": list(prompts or ["Hello"])[:2]})
    rows = example_input(spec.model_config, spec.task, data)
    output = TensorSpec(np.dtype(np.int64 if spec.task == "classification" else np.float32), (-1,))
    if data.kind == "table":
        names = feature_columns(data)
        inputs = Schema([ColSpec("double", name) for name in names])
        example = pd.DataFrame(rows.reshape(len(rows), -1).astype(np.float64), columns=names)
    else:
        inputs = Schema([TensorSpec(np.dtype(np.float32), (-1, *data.feature_shape))])
        example = rows
    return ModelSignature(inputs=inputs, outputs=Schema([output])), example


def _under(path: Path, *keys: str) -> bool:
    roots = {Path(sysconfig.get_paths()[key]).resolve() for key in keys}
    return any(root in path.resolve().parents for root in roots)


def _user_code(target: str) -> tuple[Path | None, str | None]:
    """How a user model's top-level module or package travels with the model: its folder
    (or file) shipped as code, or, for an installed distribution, a pip requirement.
    (None, None): nothing to add (the standard library, or gradline's own package)."""
    top = target.partition(":")[0].split(".")[0]
    found = importlib.util.find_spec(top)
    if top == "training" or found is None or found.origin in ("built-in", "frozen"):
        return None, None
    if found.submodule_search_locations:  # a package (maybe a namespace package)
        path = Path(next(iter(found.submodule_search_locations)))
    else:
        path = Path(found.origin)
    if _under(path, "purelib", "platlib") or "site-packages" in path.parts:
        dists = importlib.metadata.packages_distributions().get(top) or []
        if dists:
            return None, f"{dists[0]}=={importlib.metadata.version(dists[0])}"
    elif _under(path, "stdlib", "platstdlib"):
        return None, None
    return path, None


def _requirements(task: str) -> list[str]:
    """Pinned, given explicitly: inferring them costs seconds and guesses wrong."""
    names = ["torch", "numpy", "pandas", "pydantic", "pyyaml"]
    if task == "language_modeling":
        names.append("tokenizers")
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in names]


def _stage_code(paths: list[Path], staging: Path) -> list[str]:
    """Copies of the code folders without caches (code_paths copies what it is given)."""
    staged = []
    for path in paths:
        target = staging / path.name
        if path.is_dir():
            shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, target)
        staged.append(str(target))
    return staged


def log_pyfunc_model(
    tracking_uri: str,
    run_id: str,
    model_dir: Path,
    generation: dict[str, Any] | None = None,
    *,
    prompts: list[str] | None = None,
    name: str = "model",
) -> str:
    """Log the model folder as a pyfunc model into the run `run_id`; return its model URI.

    `generation` holds the task's max_new_tokens, temperature, top_k and seed: the
    defaults of a language model's params. `prompts` give its input example. The run's
    status is left as it is (no run is started or ended here).
    """
    import mlflow.pyfunc
    from mlflow.models import Model

    import training

    predictor = Predictor(Path(model_dir))
    signature, example = _signature_and_example(predictor, generation or {}, prompts)
    code = [Path(training.__file__).parent]
    requirements = _requirements(predictor.spec.task)
    target = predictor.spec.model.get("target")
    if target:
        path, requirement = _user_code(target)
        code += [path] if path else []
        requirements += [requirement] if requirement else []
    mlflow.set_tracking_uri(tracking_uri)
    # Model.log takes the run id itself, where mlflow.pyfunc.log_model needs an active run
    # (and ending that would mark the run finished). The logged model belongs to the
    # current experiment, so make that the run's.
    mlflow.set_experiment(experiment_id=mlflow.MlflowClient().get_run(run_id).info.experiment_id)
    with tempfile.TemporaryDirectory(prefix="gradline-code-") as staging:
        info = Model.log(
            artifact_path=None,
            name=name,
            flavor=mlflow.pyfunc,
            run_id=run_id,
            python_model=_python_model(),
            artifacts={MODEL_DIR_ARTIFACT: str(model_dir)},
            code_paths=_stage_code(code, Path(staging)),
            pip_requirements=requirements,
            signature=signature,
            input_example=example,
        )
    return info.model_uri


def load_registered_model(model_uri: str, tracking_uri: str | None = None):
    """The model (eval mode, CPU) and ModelSpec of a model logged by `log_pyfunc_model`,
    from any model URI (models:/name@alias, models:/<model id>, runs:/<run>/model). Only
    the model folder is read, as load_model_dir reads it; no pickled class is loaded."""
    from mlflow.models import Model

    import mlflow
    from training.models.folder import load_model_dir

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    with tempfile.TemporaryDirectory(prefix="gradline-model-") as tmp:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=tmp))
        flavor = Model.load(str(local)).flavors["python_function"]
        return load_model_dir(local / flavor["artifacts"][MODEL_DIR_ARTIFACT]["path"])
