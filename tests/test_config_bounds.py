"""Every numeric key of the schema refuses nan, infinities and values out of its range,
naming the key; every value in range is taken. Name and URL keys refuse what MLflow,
Prefect or a browser would choke on. Keys and ranges are read from the schema itself,
so a key added later is covered without editing this file."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Literal, Union, get_args, get_origin

import annotated_types as at
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import AfterValidator
from pydantic.fields import FieldInfo

from training.config import Config
from training.config.loading import validate
from training.errors import ConfigError
from training.models.options import MLPOptions
from training.options import INT64_MAX, Section, _a_name, _a_web_url, _an_experiment

from .conftest import copy_project

# The model section is open: its keys are the built-in model's (mlp by default).
SECTIONS: dict[str, type[Section]] = {
    name: field.annotation for name, field in Config.model_fields.items() if name != "model"
}
SECTIONS["model"] = MLPOptions
# Rules that tie a key to another key of its section: a value in the key's own range may
# still be refused with the others at their defaults. Acceptance is checked where they hold.
JOINT = {
    "shard.val_fraction": lambda v: v + 0.15 < 1,
    "shard.test_fraction": lambda v: v + 0.15 < 1,
    **{f"parallel.{d}": lambda v: v != 0 for d in ("dp_replicate", "dp_shard", "tp", "pp")},
}


def _number_type(field: FieldInfo) -> type | None:
    kind = field.annotation
    if get_origin(kind) in (Union, types.UnionType):
        kind = next(a for a in get_args(kind) if a is not type(None))
    if kind is bool or get_origin(kind) is Literal:
        return None
    return kind if kind in (int, float) else None


def _bounds(field: FieldInfo) -> tuple[float | None, bool, float | None, bool]:
    """(low, low is excluded, high, high is excluded) from the field's constraints."""
    low = high = None
    low_open = high_open = False
    for rule in field.metadata:
        if isinstance(rule, at.Ge):
            low, low_open = rule.ge, False
        elif isinstance(rule, at.Gt):
            low, low_open = rule.gt, True
        elif isinstance(rule, at.Le):
            high, high_open = rule.le, False
        elif isinstance(rule, at.Lt):
            high, high_open = rule.lt, True
    return low, low_open, high, high_open


NUMERIC = {
    f"{section}.{key}": (kind, _bounds(field))
    for section, schema in SECTIONS.items()
    for key, field in schema.model_fields.items()
    if (kind := _number_type(field)) is not None
}


def _validators(field: FieldInfo) -> set:
    return {m.func for m in field.metadata if isinstance(m, AfterValidator)}


def _keys_checked_by(check) -> list[str]:
    return [
        f"{section}.{key}"
        for section, schema in SECTIONS.items()
        for key, field in schema.model_fields.items()
        if check in _validators(field)
    ]


def _rejected_naming(key: str, value) -> str:
    section, name = key.split(".")
    with pytest.raises(ConfigError) as refused:
        validate({section: {name: value}}, "params.yaml")
    message = str(refused.value)
    assert f"{key}:" in message, message
    return message


def _accepted(key: str, value) -> None:
    section, name = key.split(".")
    assume(JOINT.get(key, lambda _: True)(value))
    schema = SECTIONS[section]
    assert getattr(schema.model_validate({name: value}), name) == value


def test_the_schema_has_the_keys_this_file_relies_on() -> None:
    # A reader of the schema that found nothing would pass every test below vacuously.
    assert {"optim.lr", "optim.weight_decay", "train.seed", "runtime.threads_per_worker"} <= (
        NUMERIC.keys()
    )
    assert len(NUMERIC) > 50
    assert "registry.model_name" in _keys_checked_by(_a_name)
    assert _keys_checked_by(_a_web_url) == ["orchestrate.mlflow_ui_url"]


FAST = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.parametrize("key", sorted(NUMERIC))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused_naming_the_key(key, value) -> None:
    _rejected_naming(key, value)


@pytest.mark.parametrize("key", sorted(NUMERIC))
@FAST
@given(data=st.data())
def test_numbers_out_of_range_are_refused_naming_the_key(key, data) -> None:
    kind, (low, low_open, high, high_open) = NUMERIC[key]
    sides = []
    if low is not None:
        sides.append(
            st.integers(max_value=math.ceil(low) - (0 if low_open else 1))
            if kind is int
            else st.floats(max_value=low, exclude_max=not low_open, allow_nan=False)
        )
    if kind is float and high is not None:
        sides.append(st.floats(min_value=high, exclude_min=not high_open, allow_nan=False))
    if kind is int:  # an int too big for torch, numpy and Arrow, or above the key's bound
        top = INT64_MAX if high is None else math.floor(high) + (0 if high_open else 1)
        sides.append(st.integers(min_value=top + (1 if high is None else 0)))
    value = data.draw(st.one_of(sides))
    assume(not (isinstance(value, float) and math.isinf(value)))  # covered above
    _rejected_naming(key, value)


@pytest.mark.parametrize("key", sorted(NUMERIC))
@FAST
@given(data=st.data())
def test_numbers_in_range_are_taken(key, data) -> None:
    kind, (low, low_open, high, high_open) = NUMERIC[key]
    if kind is int:
        first = -INT64_MAX if low is None else math.ceil(low) + (1 if low_open else 0)
        last = INT64_MAX if high is None else math.floor(high) - (1 if high_open else 0)
        value = data.draw(st.integers(first, last))
    else:
        value = data.draw(
            st.floats(
                min_value=low,
                max_value=high,
                exclude_min=low_open and low is not None,
                exclude_max=high_open and high is not None,
                allow_nan=False,
                allow_infinity=False,
            )
        )
    _accepted(key, value)


BAD_NAMES = ["a/b", "it's", 'say "x"', "a:b", "../up", "-leading", "tab\there"]


@pytest.mark.parametrize("key", _keys_checked_by(_a_name))
@pytest.mark.parametrize("name", BAD_NAMES)
def test_names_the_registry_or_prefect_refuse_are_refused(key, name) -> None:
    assert "is not a name the model registry takes" in _rejected_naming(key, name)


@pytest.mark.parametrize("key", _keys_checked_by(_a_name))
@FAST
@given(name=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_ -]{0,30}", fullmatch=True))
def test_plain_names_are_taken(key, name) -> None:
    _accepted(key, name)


@pytest.mark.parametrize("name", ["it's", 'a"b', "back\\slash", "line\nbreak"])
def test_experiment_names_that_break_a_search_are_refused(name) -> None:
    _rejected_naming("registry.experiment", name)
    _accepted("registry.experiment", "/Shared/team/gradline")


@pytest.mark.parametrize(
    "url",
    ["javascript:alert(1)", "file:///etc/passwd", "data:text/html,x", "127.0.0.1:5000",
     "http://", "http://host:99999"],
)  # fmt: skip
def test_urls_that_are_not_web_addresses_are_refused(url) -> None:
    assert "mlflow_ui_url" in _rejected_naming("orchestrate.mlflow_ui_url", url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:5000", "https://mlflow.example.org/x"])
def test_web_addresses_are_taken(url) -> None:
    _accepted("orchestrate.mlflow_ui_url", url)


def test_experiment_check_is_the_one_used() -> None:
    assert _keys_checked_by(_an_experiment) == ["registry.experiment"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("override", ["optim.lr=inf", "optim.weight_decay=.nan"])
def test_the_cli_refuses_an_infinite_override_and_writes_nothing(tmp_path, override) -> None:
    project = copy_project(tmp_path / "gradline")
    params = project / "params.yaml"
    before = params.read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env["PREFECT_HOME"] = str(tmp_path / ".prefect-home")
    gradline = str(Path(sys.executable).parent / "gradline")
    proc = subprocess.run(
        [gradline, "run", "--set", override],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{override.split('=')[0]}: Input should be a finite number" in proc.stderr
    assert params.read_text() == before
    for output in ("data/raw", "data/shards", "mlflow/mlflow.db"):
        assert not (project / output).exists(), output
