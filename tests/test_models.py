"""Models: the registry's built-ins and user targets, standardization inside the model,
GPT's causality and sampling, the saved model folder, and MLflow pyfunc models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from pydantic import ValidationError

from training.config import ModelConfig
from training.data.spec import DataSpec
from training.data.tokenizer import ByteTokenizer
from training.errors import ConfigError, DataError, ProjectError
from training.mlops.serving import load_registered_model
from training.models.folder import ModelSpec, load_model_dir, save_model_dir
from training.models.gpt import GPT
from training.models.registry import build_model, check_buildable, context_length, example_input
from training.models.standardize import Standardized
from training.objectives import Generation
from training.objectives.language_modeling import generate

REPO = Path(__file__).resolve().parents[1]

MEAN = tuple(float(v) for v in np.linspace(-5, 50, 12))
STD = tuple(float(v) for v in np.linspace(0.5, 20, 12))
TABLE = DataSpec("table", (12,), 3, feature_mean=MEAN, feature_std=STD)
TABLE_REG = DataSpec(
    "table", (12,), None, feature_mean=MEAN, feature_std=STD, label_mean=150.0, label_std=70.0
)
IMAGE = DataSpec("image", (8, 8), 10)
IMAGE_CHW = DataSpec("image", (3, 6, 6), None, label_mean=-2.0, label_std=0.5)
TOKENS = DataSpec("tokens", vocab_size=50)

SMALL = {
    "mlp": {"hidden": 16, "depth": 2},
    "cnn": {"channels": 4, "stages": 2, "blocks": 1},
    "gpt": {"layers": 2, "heads": 2, "width": 16, "context": 12},
}


def model_cfg(name: str, **options) -> ModelConfig:
    return ModelConfig(name=name, **{**SMALL[name], **options})


def user_cfg(factory: str, **options) -> ModelConfig:
    return ModelConfig(target=f"tests.user_models:{factory}", **options)


def run(model: torch.nn.Module, x: np.ndarray) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(x))


# --- built-ins: data kinds, tasks, output shapes -----------------------------------------


@pytest.mark.parametrize(
    ("name", "task", "data", "shape"),
    [
        ("mlp", "classification", TABLE, (2, 3)),
        ("mlp", "regression", TABLE_REG, (2,)),
        ("mlp", "classification", IMAGE, (2, 10)),
        ("cnn", "classification", IMAGE, (2, 10)),
        ("cnn", "regression", IMAGE_CHW, (2,)),
        ("gpt", "language_modeling", TOKENS, (2, 12, 50)),
    ],
)
def test_builtins_build_for_their_data_with_the_tasks_output(name, task, data, shape):
    cfg = model_cfg(name)
    check_buildable(cfg, task, data)
    x = example_input(cfg, data)
    assert x.dtype == (np.int64 if data.kind == "tokens" else np.float32)
    assert tuple(run(build_model(cfg, task, data), x).shape) == shape


def test_the_cnn_takes_flattened_rows_too():
    cfg = model_cfg("cnn")
    model = build_model(cfg, "classification", IMAGE)
    x = example_input(cfg, IMAGE)
    assert torch.equal(run(model, x), run(model, x.reshape(2, 64)))


def test_a_model_the_task_cannot_use_is_a_config_error_naming_the_fix():
    with pytest.raises(ConfigError, match=r"model gpt cannot learn task classification.*mlp"):
        build_model(model_cfg("gpt"), "classification", TABLE)
    with pytest.raises(ConfigError, match=r"model cnn needs image-shaped.*feature_shape"):
        build_model(model_cfg("cnn"), "classification", TABLE)
    with pytest.raises(ConfigError, match=r"model mlp cannot learn task language_modeling"):
        build_model(model_cfg("mlp"), "language_modeling", TOKENS)
    # The task's objective refuses data it cannot learn before any model is built.
    with pytest.raises(DataError, match=r"no num_classes \(float labels\?\); set task\.type"):
        build_model(model_cfg("mlp"), "classification", TABLE_REG)


def test_a_bad_option_names_the_key():
    with pytest.raises(ValidationError, match=r"model\.hiden is not a key of model mlp"):
        ModelConfig(name="mlp", hiden=3)
    with pytest.raises(ValidationError, match=r"model\.width \(30\).*model\.heads \(4\)"):
        ModelConfig(name="gpt", width=30, heads=4)
    with pytest.raises(ValidationError, match=r"model\.channels"):
        ModelConfig(name="cnn", channels=0)


def test_context_length_is_the_language_models_window():
    assert context_length(model_cfg("mlp"), "table") is None
    assert context_length(model_cfg("gpt"), "tokens") == 12
    assert context_length(ModelConfig(name="gpt"), "tokens") == 128  # the default
    user = user_cfg("tiny_language_model", context=32)
    assert context_length(user, "tokens") == 32
    with pytest.raises(ConfigError, match=r"needs model\.context"):
        check_buildable(user_cfg("tiny_language_model"), "language_modeling", TOKENS)


# --- standardization inside the model ------------------------------------------------------


def test_tables_are_standardized_inside_the_model():
    model = build_model(model_cfg("mlp"), "classification", TABLE)
    assert isinstance(model, Standardized)
    raw = example_input(model_cfg("mlp"), TABLE, batch=5)
    standardized = (raw - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    assert torch.allclose(run(model, raw), run(model.model, standardized), atol=1e-5)


def test_regression_predicts_in_the_labels_units():
    model = build_model(model_cfg("mlp"), "regression", TABLE_REG)
    raw = example_input(model_cfg("mlp"), TABLE_REG, batch=5)
    standardized = (raw - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    inner = run(model.model, standardized)
    assert inner.shape == (5, 1)
    assert torch.allclose(run(model, raw), inner[:, 0] * 70.0 + 150.0, atol=1e-4)


def test_images_and_tokens_pass_as_they_are():
    assert not isinstance(build_model(model_cfg("cnn"), "classification", IMAGE), Standardized)
    assert isinstance(build_model(model_cfg("gpt"), "language_modeling", TOKENS), GPT)
    wrapped = build_model(model_cfg("cnn"), "regression", IMAGE_CHW)
    assert isinstance(wrapped, Standardized) and not wrapped.scales_features


def test_a_constant_feature_is_centred_not_divided_by_zero():
    data = DataSpec("table", (2,), 2, feature_mean=(3.0, 1.0), feature_std=(0.0, 2.0))
    model = build_model(model_cfg("mlp"), "classification", data)
    out = run(model, np.array([[3.0, 1.0], [4.0, 5.0]], np.float32))
    assert torch.isfinite(out).all()


# --- GPT -------------------------------------------------------------------------------


def tiny_gpt(**options) -> GPT:
    torch.manual_seed(0)
    return build_model(model_cfg("gpt", **options), "language_modeling", TOKENS).eval()


def test_gpt_is_causal():
    model = tiny_gpt()
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 50
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert torch.equal(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_gpt_ties_or_unties_its_embeddings():
    tied = tiny_gpt()
    assert tied.head.weight is tied.token_embedding.weight
    untied = tiny_gpt(tied_embeddings=False)
    assert untied.head.weight is not untied.token_embedding.weight


def test_generate_is_reproducible_with_a_seeded_generator_and_crops_to_context():
    model = tiny_gpt()
    prompt = torch.randint(0, 50, (2, 20))  # longer than the context of 12

    def sample(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return generate(model, prompt, 15, temperature=1.0, top_k=5, context=12, generator=g)

    first = sample(0)
    assert first.shape == (2, 35) and torch.equal(first[:, :20], prompt)
    assert torch.equal(first, sample(0))
    assert not torch.equal(first, sample(1))
    greedy = generate(model, prompt, 5, temperature=0.0)
    assert torch.equal(greedy, generate(model, prompt, 5, temperature=1.0, top_k=1))


def test_generate_restores_training_mode():
    model = tiny_gpt(dropout=0.1).train()
    generate(model, torch.zeros((1, 1), dtype=torch.long), 2)
    assert model.training


# --- user targets ----------------------------------------------------------------------


def test_a_user_factory_gets_the_data_keywords_it_names_and_its_own_keys():
    model = build_model(user_cfg("tiny_net", hidden=5), "classification", TABLE)
    assert isinstance(model, Standardized)  # user models take raw rows too
    assert model.model[1].out_features == 5
    check_buildable(user_cfg("tiny_net", hidden=5), "classification", TABLE)
    check_buildable(user_cfg("tiny_language_model", context=8), "language_modeling", TOKENS)
    check_buildable(user_cfg("tiny_net"), "regression", TABLE_REG)  # (B, 1) -> (B,)


def test_a_factory_taking_kwargs_is_offered_every_data_keyword():
    model = build_model(user_cfg("records_keywords", extra=1), "classification", IMAGE)
    assert model.received == {
        "task": "classification",
        "data_kind": "image",
        "input_shape": (8, 8),
        "output_size": 10,
        "num_classes": 10,
        "vocab_size": None,
        "extra": 1,
    }


@pytest.mark.parametrize(
    ("target", "options", "message"),
    [
        ("no_such_package_xyz.models:build", {}, r"no module named 'no_such_package_xyz'.*install"),
        ("tests.user_models:missing", {}, r"has no attribute 'missing'.*tiny_net"),
        (
            "tests.user_models:NOT_CALLABLE",
            {},
            r"NOT_CALLABLE is not callable.*a function or class",
        ),
        ("tests.user_models:raises", {}, r"raised ValueError: hidden must be even.*fix"),
        ("tests.user_models:not_a_module", {}, r"returned a dict.*torch\.nn\.Module"),
        ("tests.user_models:tiny_net", {"width": 3}, r"model\.width is not a parameter.*hidden"),
        ("tests.user_models:needs_depth", {}, r"needs the argument 'depth'.*model\.depth"),
        ("tests.user_models:tiny_net", {"output_size": 3}, r"model\.output_size clashes"),
    ],
)
def test_user_target_failures_are_config_errors_that_say_what_to_fix(target, options, message):
    with pytest.raises(ConfigError, match=message) as caught:
        build_model(ModelConfig(target=target, **options), "classification", TABLE)
    assert target in str(caught.value)


def test_a_user_module_whose_import_fails_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "broken_models.py").write_text("import not_installed_dep_xyz\n")
    (tmp_path / "bad_syntax_models.py").write_text("def build(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"imports 'not_installed_dep_xyz'.*install"):
        build_model(ModelConfig(target="broken_models:build"), "classification", TABLE)
    with pytest.raises(ConfigError, match=r"importing bad_syntax_models raised SyntaxError"):
        build_model(ModelConfig(target="bad_syntax_models:build"), "classification", TABLE)


def test_a_wrong_output_shape_fails_the_build_check():
    with pytest.raises(ConfigError, match=r"returned \[2, 3\].*needs an output of shape \[2, 10\]"):
        check_buildable(user_cfg("wrong_output"), "classification", IMAGE)


# --- the model folder ------------------------------------------------------------------


def test_model_folder_round_trip(tmp_path):
    cfg = model_cfg("mlp")
    torch.manual_seed(0)
    model = build_model(cfg, "regression", TABLE_REG)
    spec = ModelSpec.create("regression", cfg, TABLE_REG)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "stale.txt").write_text("from an older run")
    save_model_dir(model, spec, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["model.pt", "spec.json"]
    saved = json.loads((folder / "spec.json").read_text())
    assert saved["task"] == "regression" and saved["model"]["hidden"] == 16
    assert DataSpec.from_dict(saved["data"]) == TABLE_REG
    loaded, loaded_spec = load_model_dir(folder)
    assert loaded_spec == ModelSpec.from_dict(spec.to_dict()) and not loaded.training
    x = example_input(cfg, TABLE_REG, batch=4)
    assert torch.equal(run(model, x), run(loaded, x))


def test_a_language_model_folder_holds_its_tokenizer(tmp_path):
    cfg = model_cfg("gpt")
    spec = ModelSpec.create("language_modeling", cfg, TOKENS)
    with pytest.raises(ValueError, match="tokenizer"):
        save_model_dir(tiny_gpt(), spec, tmp_path / "lm")
    ByteTokenizer().save(tmp_path / "tok.json")
    save_model_dir(tiny_gpt(), spec, tmp_path / "lm", tmp_path / "tok.json")
    assert (tmp_path / "lm" / "tokenizer.json").read_text() == (tmp_path / "tok.json").read_text()


def test_loading_a_missing_folder_says_how_to_make_one(tmp_path):
    with pytest.raises(ProjectError, match="train stage"):
        load_model_dir(tmp_path / "nothing")


# --- MLflow pyfunc ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tracking(tmp_path_factory):
    """A sqlite tracking store in a temp folder and one run to log models into."""
    import mlflow

    base = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{base}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("models", artifact_location=(base / "art").as_uri())
    return uri, client.create_run(experiment).info.run_id, base


DEFAULT_GENERATION = Generation(("def ",), 120, 0.8, 40, 0)


def log_and_load(tracking, tmp_path, cfg, task, data, model=None, generation=DEFAULT_GENERATION):
    import mlflow
    from training.mlops.serving import log_pyfunc_model

    uri, run_id, base = tracking
    model = model if model is not None else build_model(cfg, task, data)
    tokenizer = None
    if task == "language_modeling":
        tokenizer = tmp_path / "tokenizer.json"
        ByteTokenizer().save(tokenizer)
    save_model_dir(model, ModelSpec.create(task, cfg, data), tmp_path / "model", tokenizer)
    model_uri = log_pyfunc_model(uri, run_id, tmp_path / "model", generation)
    # Logged into the run's experiment, with its artifacts in that experiment's store.
    client = mlflow.MlflowClient(uri)
    logged = client.get_logged_model(model_uri.rpartition("/")[2])
    assert logged.source_run_id == run_id
    assert logged.experiment_id == client.get_run(run_id).info.experiment_id
    assert logged.artifact_location.startswith((base / "art").as_uri())
    assert client.get_run(run_id).info.status == "RUNNING"  # left as it was
    mlflow.set_tracking_uri(uri)
    return model, mlflow.pyfunc.load_model(model_uri), model_uri


def test_a_table_model_predicts_classes_from_named_columns(tracking, tmp_path):
    names = tuple(f"col_{i}" for i in range(12))
    data = DataSpec("table", (12,), 3, feature_mean=MEAN, feature_std=STD, feature_names=names)
    cfg = model_cfg("mlp")
    model, loaded, _ = log_and_load(tracking, tmp_path, cfg, "classification", data)
    rows = example_input(cfg, data, batch=6)
    expected = run(model, rows).argmax(1).numpy()
    frame = pd.DataFrame(rows.astype(np.float64), columns=names)
    assert np.array_equal(loaded.predict(frame), expected)
    # Columns are matched by name, not position.
    assert np.array_equal(loaded.predict(frame[list(reversed(names))]), expected)
    assert loaded.metadata.signature.inputs.input_names() == list(names)
    # The unwrapped model also takes a plain 2-D array.
    assert np.array_equal(loaded.unwrap_python_model().predictor.predict(rows), expected)


def test_the_logged_model_holds_no_pickle(tracking, tmp_path):
    # Logged from code: the registry keeps the model's source, not a pickled object
    # that would run whatever its writer chose on load.
    import mlflow

    data = DataSpec("table", (12,), 3, feature_mean=MEAN, feature_std=STD)
    _, _, model_uri = log_and_load(tracking, tmp_path, model_cfg("mlp"), "classification", data)
    local = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path / "dl")))
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavor["model_code_path"].endswith("model_from_code.py"), flavor
    pickles = [p for p in local.rglob("*") if p.suffix in (".pkl", ".pickle", ".cloudpickle")]
    assert pickles == []


def test_a_regression_model_predicts_values_in_the_labels_units(tracking, tmp_path):
    cfg = model_cfg("mlp")
    model, loaded, _ = log_and_load(tracking, tmp_path, cfg, "regression", TABLE_REG)
    rows = example_input(cfg, TABLE_REG, batch=4)
    frame = pd.DataFrame(rows.astype(np.float64), columns=[f"f{i}" for i in range(12)])
    predicted = loaded.predict(frame)
    assert predicted.dtype == np.float32 and predicted.shape == (4,)
    assert np.allclose(predicted, run(model, rows).numpy(), atol=1e-4)


def test_an_image_model_predicts_classes_from_arrays(tracking, tmp_path):
    cfg = model_cfg("cnn")
    model, loaded, model_uri = log_and_load(tracking, tmp_path, cfg, "classification", IMAGE)
    images = np.random.default_rng(0).uniform(0, 16, (5, 8, 8)).astype(np.float32)
    expected = run(model, images).argmax(1).numpy()
    assert np.array_equal(loaded.predict(images), expected)
    # The registry gate reads the model folder back from MLflow, without pyfunc.
    again, spec = load_registered_model(model_uri, tracking[0])
    assert spec.task == "classification" and torch.equal(run(again, images), run(model, images))
    flat = images.reshape(5, 64)
    assert np.array_equal(loaded.unwrap_python_model().predictor.predict(flat), expected)


def test_a_language_model_turns_prompts_into_text_with_generation_params(tracking, tmp_path):
    cfg = model_cfg("gpt", layers=1)
    generation = Generation(("def ", "x = "), 6, 0.8, None, 3)
    data = DataSpec("tokens", vocab_size=257)  # the byte tokenizer's
    _, loaded, _ = log_and_load(
        tracking, tmp_path, cfg, "language_modeling", data, generation=generation
    )
    params = {p.name: p.default for p in loaded.metadata.signature.params.params}
    assert params == {"max_new_tokens": 6, "temperature": 0.8, "top_k": 0, "seed": 3}
    prompts = pd.DataFrame({"prompt": ["def ", "", "def "]})
    out = loaded.predict(prompts)
    assert list(out.columns) == ["text"] and len(out) == 3
    assert out["text"][0] == out["text"][2]  # a prompt's sample does not depend on the batch
    again = loaded.predict(prompts, params={"seed": 3})
    assert out.equals(again)
    longer = loaded.predict(prompts, params={"max_new_tokens": 20, "temperature": 0.0})
    assert 0 < len(longer["text"][0]) <= 20  # at most one character per byte


def test_a_user_model_trains_saves_logs_and_loads_elsewhere(tracking, tmp_path):
    cfg = user_cfg("tiny_net", hidden=8)
    data = TABLE
    torch.manual_seed(0)
    model = build_model(cfg, "classification", data)
    rows = torch.from_numpy(example_input(cfg, data, batch=32))
    labels = torch.arange(32) % 3
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(rows), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    _, loaded, model_uri = log_and_load(tracking, tmp_path, cfg, "classification", data, model)
    frame = pd.DataFrame(rows.numpy().astype(np.float64), columns=[f"f{i}" for i in range(12)])
    expected = run(model, rows.numpy()).argmax(1).numpy()
    assert np.array_equal(loaded.predict(frame), expected)
    # In a fresh interpreter outside the repository, where `tests` is not importable:
    # the user's package must have been packed with the model.
    frame.to_parquet(tmp_path / "rows.parquet")
    script = (
        "import sys, mlflow, numpy as np, pandas as pd\n"
        f"mlflow.set_tracking_uri({tracking[0]!r})\n"
        f"m = mlflow.pyfunc.load_model({model_uri!r})\n"
        f"print(list(m.predict(pd.read_parquet({str(tmp_path / 'rows.parquet')!r}))))\n"
        "print(sys.modules['tests'].__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed, tests_file = done.stdout.strip().splitlines()[-2:]
    assert printed == str(list(expected))
    assert not tests_file.startswith(str(REPO))


def test_a_user_models_code_travels_as_files_or_as_a_requirement():
    from training.mlops.serving import _user_code

    assert _user_code("tests.user_models:tiny_net") == (REPO / "tests", None)
    assert _user_code("json.decoder:JSONDecoder") == (None, None)  # the standard library
    assert _user_code("training.models.mlp:MLP") == (None, None)  # shipped anyway
    path, requirement = _user_code("numpy.random:default_rng")
    assert path is None and requirement == f"numpy=={np.__version__}"
