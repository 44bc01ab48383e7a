"""The one typed config schema, loaded from params.yaml plus `section.key=value` overrides.

The CLI, the Prefect flow and every DVC stage go through `load_config`, so a bad value is
rejected the same way everywhere, before anything is written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from training.errors import ConfigError


class _Section(BaseModel):
    # extra="forbid" turns a typo in params.yaml into an error instead of a silent default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataConfig(_Section):
    source: Literal["digits", "synthetic", "parquet", "csv"] = Field(
        "digits", description="where rows come from"
    )
    path: str = Field(
        "data/incoming",
        min_length=1,
        description="parquet/csv: a file or a folder of files, relative to the project",
    )
    label_column: str = Field("label", min_length=1)
    feature_columns: list[str] | None = Field(
        None, description="numeric feature columns; null: every column but label and key"
    )
    tensor_column: str | None = Field(
        None, description="one fixed-shape list column holding all features instead"
    )
    feature_shape: list[int] | None = Field(
        None, description="shape of tensor_column's values, e.g. [8, 8]"
    )
    key_column: str | None = Field(
        None, description="a unique row key; null: a hash of the row's contents"
    )
    num_classes: int | None = Field(
        None, ge=2, description="labels must lie in 0..num_classes-1 (parquet/csv)"
    )
    on_invalid: Literal["fail", "quarantine"] = Field(
        "fail", description="quarantine: bad rows go to data/quarantine/ with a reason"
    )
    duplicates: Literal["keep", "reject"] = Field(
        "keep", description="reject: a repeated key (or repeated row) is an invalid row"
    )
    max_rows: int | None = Field(
        None, ge=1, description="keep only the first N source rows (null keeps all)"
    )
    read_batch_rows: int = Field(65536, ge=1, description="rows per streamed batch")
    synthetic_rows: int = Field(10000, ge=1)
    synthetic_shape: list[int] = Field([64], min_length=1, description="feature shape")
    synthetic_classes: int = Field(10, ge=2)
    synthetic_noise: float = Field(1.0, ge=0.0)
    seed: int = Field(0, ge=0, description="seeds the synthetic source")

    @model_validator(mode="after")
    def _features_declared_once(self) -> DataConfig:
        if self.tensor_column and self.feature_columns:
            raise ValueError(
                "set data.tensor_column or data.feature_columns, not both: features come "
                "either from one list column or from several numeric columns"
            )
        if self.source in ("parquet", "csv") and self.num_classes is None:
            raise ValueError(
                f"data.num_classes is required for source {self.source!r}: labels are "
                "checked against 0..num_classes-1"
            )
        shapes = [self.feature_shape or [1], self.synthetic_shape]
        if any(d < 1 for shape in shapes for d in shape):
            raise ValueError("data.feature_shape and data.synthetic_shape need sizes >= 1")
        return self


class ShardConfig(_Section):
    target_shard_mb: float = Field(64.0, gt=0.0, description="approximate size of a shard")
    val_fraction: float = Field(0.15, ge=0.0, lt=1.0)
    test_fraction: float = Field(0.15, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _leave_rows_to_train(self) -> ShardConfig:
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                "shard.val_fraction + shard.test_fraction must be below 1 so that rows are "
                f"left to train on (got {self.val_fraction} + {self.test_fraction})"
            )
        return self


class TrainConfig(_Section):
    world_size: int = Field(2, ge=1, description="worker processes (one per GPU on CUDA)")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    epochs: int = Field(30, ge=1)
    batch_size: int = Field(64, ge=1, description="global batch per optimizer step")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")
    lr: float = Field(0.003, gt=0.0)
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    warmup_steps: int = Field(20, ge=0, description="linear warmup before the schedule")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine floor, times lr")
    weight_decay: float = Field(0.0001, ge=0.0)
    grad_clip: float = Field(1.0, ge=0.0, description="max gradient norm; 0 disables")
    hidden: int = Field(128, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int = Field(0, ge=0)
    deterministic: bool = Field(True, description="deterministic kernels: bitwise resume")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, fp32 on CPU"
    )
    compile: bool = Field(False, description="torch.compile the model")
    checkpoint_every_steps: int = Field(100, ge=1)
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept on disk")
    async_checkpoint: bool = Field(True, description="write checkpoints off the hot loop")
    log_every_steps: int = Field(50, ge=1, description="metrics and time breakdown interval")
    control_every_steps: int = Field(10, ge=1, description="steps between preemption checks")
    straggler_factor: float = Field(1.5, gt=1.0, description="busy time over the median rank")
    collective_timeout_s: float = Field(300.0, gt=0.0, description="a stalled rank fails then")
    max_restarts: int = Field(3, ge=0, description="elastic restarts after a worker failure")
    threads_per_worker: int = Field(1, ge=1, description="torch intra-op threads per rank")
    loader_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank")

    @model_validator(mode="after")
    def _batch_splits_evenly(self) -> TrainConfig:
        share = self.world_size * self.grad_accum_steps
        if self.batch_size % share:
            raise ValueError(
                f"train.batch_size ({self.batch_size}) must be a multiple of "
                f"train.world_size x train.grad_accum_steps ({share}) so every rank and "
                "micro-batch gets the same share"
            )
        return self


class EvaluateConfig(_Section):
    batch_size: int = Field(512, ge=1)


class RegistryConfig(_Section):
    experiment: str = Field("gradline", min_length=1, description="MLflow experiment")
    model_name: str = Field("gradline-digits", min_length=1, description="registered model")


class OrchestrateConfig(_Section):
    device_limit: str = Field(
        "gradline-devices",
        min_length=1,
        description="Prefect global concurrency limit holding one slot per training device",
    )
    device_slots: int = Field(
        0,
        ge=0,
        description="slots the limit gets when gradline creates it (0: GPUs here, else CPUs)",
    )
    stage_retries: int = Field(2, ge=0, description="retries of a stage that crashed")
    retry_delay_s: float = Field(5.0, ge=0.0)
    mlflow_ui_url: str = Field(
        "http://127.0.0.1:5000",
        description="MLflow UI for links when the tracking store is local (`gradline ui`)",
    )


class Config(_Section):
    data: DataConfig = DataConfig()
    shard: ShardConfig = ShardConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    registry: RegistryConfig = RegistryConfig()
    orchestrate: OrchestrateConfig = OrchestrateConfig()

    def flat(self) -> dict[str, Any]:
        """`section.key -> value`, the form MLflow params and DVC param names use."""
        return {
            f"{section}.{key}": value
            for section, values in self.model_dump().items()
            for key, value in values.items()
        }


# Sections that say where results are recorded, not how they are computed: no DVC stage
# depends on them, so changing them never makes a stage stale.
UNTRACKED_SECTIONS = frozenset({"registry", "orchestrate"})


def _section_fields(section: str) -> list[str]:
    return list(Config.model_fields[section].annotation.model_fields)


def parse_override(text: str) -> tuple[str, str, Any]:
    """`train.lr=0.01` -> ("train", "lr", 0.01). Values are parsed as YAML scalars."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"override {text!r} is not of the form section.key=value (e.g. train.lr=0.01)"
        )
    section, field = parts
    if section not in Config.model_fields:
        raise ConfigError(
            f"override {text!r}: unknown section {section!r}; "
            f"sections are {', '.join(Config.model_fields)}"
        )
    if field not in _section_fields(section):
        raise ConfigError(
            f"override {text!r}: unknown key {section}.{field}; "
            f"keys in {section} are {', '.join(_section_fields(section))}"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from exc
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
            allowed = _section_fields(section) if section else list(Config.model_fields)
            lines.append(f"  {where}: unknown key; allowed: {', '.join(allowed)}")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {where}: {err['msg']}{shown}")
    return ConfigError(f"invalid configuration in {source}:\n" + "\n".join(lines))


def read_yaml_mapping(path: Path, missing: str, shape: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping; `missing` and `shape` finish the messages."""
    if not path.is_file():
        raise ConfigError(f"{path} not found: {missing}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be {shape}")
    return raw


def read_params(params_path: Path) -> dict[str, Any]:
    return read_yaml_mapping(
        params_path,
        "every gradline project has a params.yaml",
        "a mapping of sections (data, shard, train...)",
    )


def load_config(params_path: Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Validate params.yaml plus overrides; raise ConfigError naming every bad key."""
    merged = _merge(read_params(params_path), list(overrides))
    source = params_path.name + (" with --set overrides" if overrides else "")
    try:
        return Config.model_validate(merged)
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
    from ruamel.yaml import YAML  # dvc's own YAML library: round-trips comments

    rt = YAML()
    rt.preserve_quotes = True
    # Write None as `null`, as people write it, not as an empty value.
    rt.representer.add_representer(
        type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null")
    )
    doc = rt.load(params_path.read_text()) or {}
    for text in overrides:
        section, field, _ = parse_override(text)
        if section not in doc or doc[section] is None:
            doc[section] = {}
        # Record the validated value (`1e-2` becomes 0.01), so DVC sees its real type.
        doc[section][field] = getattr(getattr(config, section), field)
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
    return config
