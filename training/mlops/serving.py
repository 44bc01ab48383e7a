"""The trained model as an MLflow model anyone can call: `mlflow.pyfunc.load_model(uri)`.

The pyfunc model packs the model folder (weights, spec, tokenizer) as an artifact and
the `training` package (and a user model's own code) as code, and predicts on raw
inputs as its task says (training.objectives: `serve` and `signature`):
- tables: a DataFrame with the feature columns (DataSpec.column_names) -> class ids
  (classification) or values in the label's units (regression);
- images: a float32 array (N, *feature_shape) -> class ids or values;
- language models: a DataFrame with a "prompt" column -> a DataFrame with a "text"
  column, the sampled continuation; generation settings (max_new_tokens, temperature,
  top_k (0: no limit), seed) are signature params defaulting to the evaluate section's.
`Predictor` does the work without MLflow; the pyfunc class (model_from_code.py, logged
as source: no pickle) only adapts it. mlflow is imported inside functions (an optional
dependency), so importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import training
from training.config import Config
from training.data.tokenizer import load_tokenizer
from training.evaluation import TestData
from training.mlops.registry import Incompatible
from training.mlops.tracking import client, fluent_store
from training.models.folder import TOKENIZER_FILE, load_model_dir
from training.objectives import Generation, objective_for
from training.tempdirs import owned_temporary_directory

MODEL_DIR_ARTIFACT = "model_dir"


class Predictor:
    """Raw inputs -> predictions for one model folder (no MLflow here)."""

    def __init__(self, folder: Path) -> None:
        self.model, self.spec = load_model_dir(Path(folder))
        data = self.spec.data_spec
        tokenizer = load_tokenizer(Path(folder) / TOKENIZER_FILE) if data.kind == "tokens" else None
        self.objective = objective_for(self.spec.task, data, tokenizer)

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        return self.objective.serve(self.model, model_input, params)


# The pyfunc model's source: MLflow logs this file and runs it on load (models-from-code),
# so the registry holds no pickled object.
MODEL_CODE = Path(__file__).with_name("model_from_code.py")


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


def _requirements(data_kind: str) -> list[str]:
    """Pinned, given explicitly: inferring them costs seconds and guesses wrong."""
    names = ["torch", "numpy", "pandas", "pydantic", "pyyaml"]
    if data_kind == "tokens":
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
    generation: Generation,
    *,
    name: str = "model",
) -> str:
    """Log the model folder as a pyfunc model into the run `run_id`; return its model URI.

    `generation`: a generative task's defaults for its params and its example prompts.
    The run's status is left as it is (no run is started or ended here).
    """
    import mlflow.pyfunc
    from mlflow.models import Model

    predictor = Predictor(Path(model_dir))
    signature, example = predictor.objective.signature(generation)
    code = [Path(training.__file__).parent]
    requirements = _requirements(predictor.spec.data_spec.kind)
    target = predictor.spec.model.get("target")
    if target:
        path, requirement = _user_code(target)
        code += [path] if path else []
        requirements += [requirement] if requirement else []
    # Model.log takes the run id itself, where mlflow.pyfunc.log_model needs an active run
    # (and ending that would mark the run finished). The logged model belongs to the
    # current experiment, so make that the run's.
    experiment_id = client(tracking_uri).get_run(run_id).info.experiment_id
    with (
        fluent_store(tracking_uri),
        owned_temporary_directory("gradline-code-") as staging,
    ):
        mlflow.set_experiment(experiment_id=experiment_id)
        info = Model.log(
            artifact_path=None,
            name=name,
            flavor=mlflow.pyfunc,
            run_id=run_id,
            python_model=str(MODEL_CODE),
            artifacts={MODEL_DIR_ARTIFACT: str(model_dir)},
            code_paths=_stage_code(code, Path(staging)),
            pip_requirements=requirements,
            signature=signature,
            input_example=example,
        )
    return info.model_uri


@contextlib.contextmanager
def downloaded_model(model_uri: str, tracking_uri: str) -> Iterator[tuple[Path, Any]]:
    """The model folder of a model logged by `log_pyfunc_model`, downloaded from any model
    URI (models:/name@alias, models:/<model id>, runs:/<run>/model) for the `with` block,
    and its MLflow `Model` (signature, params). Nothing in it is loaded here."""
    from mlflow.models import Model

    import mlflow

    # The whole fluent state, not just download_artifacts' URI arguments: a registered
    # version's source (models:/<model id>) is resolved again through the process-wide
    # tracking URI.
    with fluent_store(tracking_uri), owned_temporary_directory("gradline-model-") as tmp:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=tmp))
        logged = Model.load(str(local))
        flavor = logged.flavors["python_function"]
        yield local / flavor["artifacts"][MODEL_DIR_ARTIFACT]["path"], logged


def load_registered_model(model_uri: str, tracking_uri: str):
    """The model (eval mode, CPU) and ModelSpec of a model logged by `log_pyfunc_model`.
    Only the model folder is read, as load_model_dir reads it; no pickled class is loaded."""
    with downloaded_model(model_uri, tracking_uri) as (folder, _):
        return load_model_dir(folder)


def rescore_champion(
    cfg: Config, shards: Path, model_uri: str, metric: str, tracking_uri: str
) -> float:
    """A registered model's gate metric on the current test split, by the same routine
    as the evaluate stage; Incompatible when it cannot take the current data."""
    model, spec = load_registered_model(model_uri, tracking_uri)
    test = TestData.open(cfg, shards)
    if problem := test.unfit(spec, cfg.task.type):
        raise Incompatible(problem)
    return test.score(model, cfg.evaluate.batch_size).metrics[metric]
