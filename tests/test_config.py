"""Config validation: every bad key or value is named, and nothing is written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from training.config import Config, load_config, parse_override, write_overrides
from training.config.jobspec import SECTION_USES, job_key, use
from training.config.schema import SECTIONS
from training.errors import ConfigError

from .conftest import REPO


@pytest.fixture
def params(tmp_path: Path) -> Path:
    target = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", target)
    return target


def test_shipped_params_match_schema_defaults(params: Path) -> None:
    # params.yaml is the documented default: it must validate and equal the schema's.
    assert load_config(params) == Config()


def test_unknown_key_in_file_is_named(params: Path) -> None:
    params.write_text(params.read_text().replace("  lr: 0.005", "  lr: 0.005\n  lrr: 1"))
    with pytest.raises(ConfigError, match=r"optim\.lrr: unknown key; allowed: .*lr"):
        load_config(params)


def test_wrong_type_in_file_is_named(params: Path) -> None:
    params.write_text(params.read_text().replace("epochs: 30", "epochs: many"))
    with pytest.raises(ConfigError, match=r"train\.epochs: .*integer.*'many'"):
        load_config(params)


def test_unknown_section_is_named(params: Path) -> None:
    params.write_text(params.read_text() + "\nextras:\n  a: 1\n")
    with pytest.raises(ConfigError, match=r"extras: unknown key; allowed: data, shard"):
        load_config(params)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lr", "not of the form section.key=value"),
        ("trian.lr=1", "unknown section 'trian'"),
        ("train.rate=1", r"unknown key train\.rate; keys in train are epochs"),
        ("train.world_size=1", r"train\.world_size; it moved to runtime\.procs_per_node"),
        ("runtime.world_size=1", r"runtime\.world_size; it moved to runtime\.procs_per_node"),
        ("parallel.update=async", r"parallel\.update; it moved to update\.rule"),
        ("parallel.sync_every=4", r"parallel\.sync_every; it moved to update\.sync_every"),
        ("task.prompts=[a]", r"task\.prompts; it moved to evaluate\.prompts"),
        ("task.baseline_max_rows=100", r"it moved to evaluate\.baseline_max_rows"),
        ("optim.lr=-1", r"optim\.lr: Input should be greater than 0"),
        ("optim.name=adam", r"optim\.name: Input should be 'adamw' or 'sgd'"),
        ("optim.momentum=1", r"optim\.momentum: Input should be less than 1"),
        # What would fail only after training, or on every retry, fails here.
        ("registry.model_name=a/b", r"'a/b' is not a name the model registry takes"),
        ("registry.model_name=it's", r"is not a name the model registry takes"),
        ("train.seed=18446744073709551616", r"train\.seed: Input should be less than or equal"),
        ("runtime.rdzv_endpoint=host:70000", r"a port from 1 to 65535"),
        (
            "runtime.procs_per_node=3",
            r"multiple of the data-parallel ranks x train\.grad_accum_steps",
        ),
        ("parallel.tp=2", r"model mlp supports data parallelism only"),
        ("parallel.dp_shard=3", r"does not fit the job's 2 workers"),
        ("parallel.pp_schedule=zigzag", r"parallel\.pp_schedule"),
        ("shard.test_fraction=0.9", "must be below 1"),
        ("runtime.backend=mpi", r"runtime\.backend: Input should be 'auto', 'gloo' or 'nccl'"),
        ("model.name=resnet", r"model\.name 'resnet' is not a built-in model; choose one of mlp"),
        ("model.layers=2", r"model\.layers is not a key of model mlp \(its keys: hidden"),
        ("model.name=gpt", r"model\.hidden is not a key of model gpt \(its keys: layers"),
        ("task.type=regression", r"data\.source digits is a classification or click data set"),
        (
            "task.type=language_modeling",
            r"task\.type language_modeling does not fit data\.source digits: it learns from tokens",
        ),
    ],
)
def test_bad_override_is_rejected(params: Path, override: str, message: str) -> None:
    before = params.read_text()
    with pytest.raises(ConfigError, match=message):
        write_overrides(params, [override])
    assert params.read_text() == before  # nothing written


def test_override_values_parse_as_yaml() -> None:
    assert parse_override("optim.lr=0.01") == ("optim", "lr", 0.01)
    assert parse_override("model.layers=6") == ("model", "layers", 6)  # the model's own key
    assert parse_override("data.max_rows=null") == ("data", "max_rows", None)
    assert parse_override("registry.model_name=my-model") == ("registry", "model_name", "my-model")


def test_an_override_that_is_not_text_is_named() -> None:
    """Bytes a terminal could not decode reach argv as surrogates: a ConfigError naming
    the override, not a traceback from the YAML parser."""
    with pytest.raises(ConfigError, match=r"registry\.model_name=.*not valid text.*UTF-8"):
        parse_override("registry.model_name=caf\udce9")


def test_yaml_is_read_by_c_parsers() -> None:
    """Every DVC command reads dvc.yaml, dvc.lock and params.yaml with ruamel.yaml, and
    gradline reads params.yaml and dvc.lock with PyYAML: both through their C parsers
    (ruamel.yaml.clib, libyaml), ~4-5x faster than their pure-Python ones, which a
    missing or no longer used extension would silently fall back to."""
    import yaml
    from ruamel.yaml import YAML

    from training.config.loading import SafeLoader, Yaml12Loader, safe_load

    assert YAML(typ="safe").Parser.__name__ == "CParser"  # as DVC's loads make it
    assert SafeLoader is yaml.CSafeLoader and issubclass(Yaml12Loader, yaml.CSafeLoader)
    # The YAML 1.2 readings the resolvers add hold on the C parser too.
    assert yaml.load("a: 1:2\nb: 1e-5\nc: [1e3, 0.5]", Loader=Yaml12Loader) == {
        "a": "1:2",
        "b": 1e-5,
        "c": [1000.0, 0.5],
    }
    assert safe_load("stages: {x: {outs: [{path: m, md5: ab}]}}")["stages"]["x"]["outs"]


def test_overrides_are_recorded_keeping_comments(params: Path) -> None:
    cfg = write_overrides(params, ["train.seed=7", "data.max_rows=100"])
    assert cfg.train.seed == 7 and cfg.data.max_rows == 100
    text = params.read_text()
    assert "  seed: 7" in text and "max_rows: 100" in text
    assert "# global batch per optimizer step, split evenly across ranks" in text
    assert load_config(params) == cfg  # the file alone now reproduces the run
    write_overrides(params, ["data.max_rows=null", "optim.lr=1e-2"])
    assert "max_rows: null" in params.read_text()
    assert "  lr: 0.01" in params.read_text()


def test_examples_rewrite_the_computing_sections_and_validate(params: Path) -> None:
    from training.examples import EXAMPLES, apply_example

    runtime_before = load_config(params).runtime
    for name in EXAMPLES:
        cfg = apply_example(params, name)
        assert load_config(params) == cfg
        assert cfg.registry.model_name.startswith("gradline-")
    # Back to the default: nothing of the GPT example is left behind.
    cfg = apply_example(params, "digits-mlp")
    assert cfg.model.options == {"hidden": 256, "depth": 2, "dropout": 0.2}
    assert cfg.data.max_bytes is None and cfg.train.max_steps is None
    assert cfg.runtime.procs_per_node == runtime_before.procs_per_node
    assert "# global batch per optimizer step, split evenly across ranks" in params.read_text()


def test_unknown_example_is_named(params: Path) -> None:
    from training.examples import apply_example

    before = params.read_text()
    with pytest.raises(ConfigError, match="no example named 'cifar'; examples: digits-mlp"):
        apply_example(params, "cifar")
    assert params.read_text() == before


def test_a_moved_key_in_the_file_names_its_new_place(params: Path) -> None:
    params.write_text(params.read_text().replace("parallel:\n", "parallel:\n  update: async\n", 1))
    with pytest.raises(
        ConfigError, match=r"parallel\.update: unknown key; it moved to update\.rule"
    ):
        load_config(params)


def test_sgd_with_momentum_is_an_optimizer(params: Path) -> None:
    cfg = load_config(params, ["optim.name=sgd", "optim.momentum=0.8"])
    assert (cfg.optim.name, cfg.optim.momentum) == ("sgd", 0.8)


def test_job_identity_leaves_out_how_the_job_runs() -> None:
    base = Config()
    runtime = base.model_copy(
        update={
            "runtime": base.runtime.model_copy(update={"procs_per_node": 4, "log_every_steps": 7})
        }
    )
    assert job_key(runtime, "md5") == job_key(base, "md5")
    optim = base.model_copy(update={"optim": base.optim.model_copy(update={"lr": 0.1})})
    assert job_key(optim, "md5") != job_key(base, "md5")
    assert job_key(base, "other-md5") != job_key(base, "md5")


def test_every_key_has_one_use_and_is_a_param_exactly_when_it_changes_data_or_model() -> None:
    # A new section without a use would have no owner; a key that changes the model but
    # is only a tag would hide what defines a run in the MLflow UI.
    assert set(SECTION_USES) == set(SECTIONS)
    for key in Config().flat():
        key_use = use(key)
        changes_result = key_use.decides_data or key_use.in_job_key
        # Keys of another command (`gradline score`) are no part of a training run at all.
        expected = "param" if changes_result else ("none" if key.startswith("score.") else "tag")
        assert key_use.mlflow == expected, key


def test_update_rule_is_part_of_the_job_and_balance_is_not() -> None:
    base = Config()

    def with_(section: str, **values) -> Config:
        changed = getattr(base, section).model_copy(update=values)
        return base.model_copy(update={section: changed})

    assert job_key(with_("update", rule="local_sgd"), "md5") != job_key(base, "md5")
    assert job_key(with_("update", grad_compression="fp16"), "md5") != job_key(base, "md5")
    assert job_key(with_("parallel", balance="measured"), "md5") == job_key(base, "md5")
    # What only evaluation reads changes no job: the prompts are not the model's.
    assert job_key(with_("evaluate", prompts=["x"]), "md5") == job_key(base, "md5")


@pytest.mark.parametrize(
    ("update", "parallel", "message"),
    [
        ({"rule": "async"}, {"tp": 2}, "update.rule=async acts on whole replicas"),
        ({}, {"balance": "measured", "dp_shard": 2}, "not with parallel.dp_shard=2"),
        ({"rule": "local_sgd", "grad_compression": "powersgd"}, {}, "use one or the other"),
        ({"rule": "async"}, {"balance": "measured"}, "parallel.balance=measured evens out"),
        ({"rule": "diloco", "outer_momentum": 1.0}, {}, "outer_momentum"),
    ],
)
def test_update_rules_that_cannot_combine_are_refused_by_name(update, parallel, message) -> None:
    raw = {
        "model": {"name": "gpt", "layers": 2, "heads": 2, "width": 32, "context": 16},
        "data": {"source": "stdlib"},
        "task": {"type": "language_modeling"},
        "update": update,
        "parallel": parallel,
    }
    with pytest.raises(ValueError, match=message):
        Config.model_validate(raw)
