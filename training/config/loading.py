"""params.yaml plus `section.key=value` overrides, validated into one `Config`.

The CLI, the Prefect flow and every DVC stage go through `load_config`, so a bad value is
rejected the same way everywhere, before anything is written. Keys that moved between
sections fail naming their new place. `write_overrides` records overrides in
params.yaml (as `dvc exp run --set-param` does) atomically, keeping its comments.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from ruamel.yaml import YAML  # dvc's own YAML library: round-trips comments

from training.config.schema import OPEN_SECTIONS, SECTIONS, Config
from training.config.sections import OptimConfig, RuntimeConfig, UpdateConfig
from training.errors import ConfigError


def _moved_keys() -> dict[str, str]:
    """Old key -> where it lives now, for messages."""
    moved = {
        # The first split of `train` into what computes the model and how a job runs.
        **{f"train.{k}": f"runtime.{k}" for k in RuntimeConfig.model_fields},
        **{f"train.{k}": f"optim.{k}" for k in OptimConfig.model_fields},
        "train.hidden": "model.hidden",
        "train.dropout": "model.dropout",
        # The update rule is part of the job, the layout is not.
        "parallel.update": "update.rule",
        **{f"parallel.{k}": f"update.{k}" for k in UpdateConfig.model_fields if k != "rule"},
        # What only evaluation reads.
        **{
            f"task.{k}": f"evaluate.{k}"
            for k in ("prompts", "max_new_tokens", "temperature", "top_k", "baseline_max_rows")
        },
        # Workers on each node, not in the whole job.
        "runtime.world_size": "runtime.procs_per_node",
    }
    moved["train.world_size"] = "runtime.procs_per_node"
    return moved


MOVED_KEYS = _moved_keys()


def _section_fields(section: str) -> list[str]:
    return list(Config.model_fields[section].annotation.model_fields)


def _moved(key: str) -> str:
    return f"; it moved to {MOVED_KEYS[key]}" if key in MOVED_KEYS else ""


def parse_override(text: str) -> tuple[str, str, Any]:
    """`optim.lr=0.01` -> ("optim", "lr", 0.01). Values are parsed as YAML scalars."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"override {text!r} is not of the form section.key=value (e.g. optim.lr=0.01)"
        )
    section, field = parts
    if section not in SECTIONS:
        raise ConfigError(
            f"override {text!r}: unknown section {section!r}; sections are {', '.join(SECTIONS)}"
        )
    if section not in OPEN_SECTIONS and field not in _section_fields(section):
        raise ConfigError(
            f"override {text!r}: unknown key {section}.{field}{_moved(key.strip())}; "
            f"keys in {section} are {', '.join(_section_fields(section))}"
        )
    try:
        value = yaml.load(raw, Loader=Yaml12Loader) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from exc
    except UnicodeEncodeError as exc:  # bytes the terminal's encoding could not decode
        raise ConfigError(
            f"override {text!r}: the value is not valid text in this terminal's encoding "
            f"({exc.reason}); write it in UTF-8"
        ) from exc
    return section, field, value


def _merge(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        section, field, value = parse_override(text)
        current = merged.setdefault(section, {})
        if not isinstance(current, dict):
            raise ConfigError(f"params.yaml: section {section!r} must be a mapping")
        current[field] = value
    return merged


def _explain(exc: ValidationError, source: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            section = str(err["loc"][0]) if len(err["loc"]) > 1 else None
            allowed = _section_fields(section) if section else list(SECTIONS)
            lines.append(f"  {where}: unknown key{_moved(where)}; allowed: {', '.join(allowed)}")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {where}: {err['msg']}{shown}")
    return ConfigError(f"invalid configuration in {source}:\n" + "\n".join(lines))


# libyaml's parser where PyYAML has it (its wheels do): params.yaml is read by the flow,
# every stage and every CLI command, and the pure-Python parser takes ~5x as long. The
# resolvers below stay Python's, so a file both parsers accept reads the same (libyaml
# words its errors differently, and takes a tab before a value that Python's refuses).
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def safe_load(text: str) -> Any:
    """`yaml.safe_load`, with libyaml's parser when PyYAML has it (dvc.lock, a .dvc file)."""
    return yaml.load(text, Loader=SafeLoader)


class Yaml12Loader(SafeLoader):
    """PyYAML reads YAML 1.1, where `1:2` is the base-60 number 62; in YAML 1.2 (and to
    every reader of params.yaml) it is text, e.g. the node range `runtime.nnodes: 1:2`.
    And `1e-5` (an exponent without a dot) is text in YAML 1.1, a float in YAML 1.2: a
    typed key turns the text back into a number, but in a list of sweep choices it
    would stay text."""


_COLON_NUMBERS = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-9_]+)+(?:\.[0-9_]*)?$")
_EXPONENT_FLOATS = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
# Resolvers are tried in order: text first for colon-separated digits, floats for
# exponents, then the rest.
Yaml12Loader.yaml_implicit_resolvers = {
    first: [
        ("tag:yaml.org,2002:str", _COLON_NUMBERS),
        ("tag:yaml.org,2002:float", _EXPONENT_FLOATS),
        *resolvers,
    ]
    if first in "-+0123456789"
    else list(resolvers)
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def read_yaml_mapping(path: Path, missing: str, shape: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping; `missing` and `shape` finish the messages."""
    if not path.is_file():
        raise ConfigError(f"{path} not found: {missing}")
    try:
        raw = yaml.load(path.read_text(), Loader=Yaml12Loader) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be {shape}")
    return raw


def read_params(params_path: Path) -> dict[str, Any]:
    return read_yaml_mapping(
        params_path,
        "every gradline project has a params.yaml",
        f"a mapping of sections ({', '.join(SECTIONS)})",
    )


def load_config(params_path: Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Validate params.yaml plus overrides; raise ConfigError naming every bad key."""
    merged = _merge(read_params(params_path), list(overrides))
    source = params_path.name + (" with --set overrides" if overrides else "")
    return validate(merged, source)


def validate(values: dict[str, Any], source: str) -> Config:
    """The Config of `values` (sections of keys); ConfigError naming every bad key."""
    try:
        return Config.model_validate(values)
    except ValidationError as exc:
        raise _explain(exc, source) from None


def write_overrides(params_path: Path, overrides: list[str] | tuple[str, ...]) -> Config:
    """Record overrides in params.yaml, as `dvc exp run --set-param` does, so that
    `dvc repro` and dvc.lock see exactly the parameters the run used.

    The whole result is validated first; the file is replaced atomically and keeps its
    comments. Returns the validated config.
    """
    config = load_config(params_path, overrides)
    if not overrides:
        return config
    changes: dict[str, dict[str, Any]] = {}
    for text in overrides:
        section, field, _ = parse_override(text)
        # Record the validated value (`1e-2` becomes 0.01), so DVC sees its real type.
        changes.setdefault(section, {})[field] = getattr(getattr(config, section), field)
    update_params_file(params_path, changes)
    return config


def update_params_file(
    params_path: Path, changes: dict[str, dict[str, Any]], replace: frozenset[str] = frozenset()
) -> None:
    """Write `changes` (section -> key -> value) into params.yaml, keeping its comments;
    sections in `replace` keep only the keys given. Atomic: temp file, fsync, rename.
    Callers validate first."""
    rt = YAML()
    rt.preserve_quotes = True
    # Write None as `null`, as people write it, not as an empty value.
    rt.representer.add_representer(
        type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null")
    )
    doc = rt.load(params_path.read_text()) or {}
    for section, values in changes.items():
        if section not in doc or doc[section] is None:
            doc[section] = {}
        if section in replace:
            for stale in [k for k in doc[section] if k not in values]:
                del doc[section][stale]
        for key, value in values.items():
            doc[section][key] = value
    fd, tmp = tempfile.mkstemp(dir=params_path.parent, prefix=".params.", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as handle:
            rt.dump(doc, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, params_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
