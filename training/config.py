"""The one typed config schema, loaded from params.yaml plus `section.key=value` overrides.

The CLI, the Prefect flow and every DVC stage go through `load_config`, so a bad value is
rejected the same way everywhere, before anything is written.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from training.errors import ConfigError


class _Section(BaseModel):
    # extra="forbid" turns a typo in params.yaml into an error instead of a silent default.
    model_config = ConfigDict(extra="forbid", frozen=True)


TABLE_SOURCES = ("digits", "diabetes", "synthetic", "parquet", "csv")
TEXT_SOURCES = ("text", "stdlib")


class DataConfig(_Section):
    source: Literal["digits", "diabetes", "synthetic", "parquet", "csv", "text", "stdlib"] = Field(
        "digits",
        description="digits, diabetes (bundled with scikit-learn), synthetic; parquet or "
        "csv tables and text files under data.path; stdlib: the running Python's own "
        "source code, a text corpus on every machine",
    )
    path: str = Field(
        "data/incoming",
        min_length=1,
        description="parquet/csv/text: a file or a folder of files, relative to the project",
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
        None, ge=2, description="classification: labels must lie in 0..num_classes-1"
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
    # Text sources (text, stdlib) only.
    text_glob: str = Field("*.txt", min_length=1, description="text: which files to read")
    max_bytes: int | None = Field(
        None, ge=1, description="text: stop after this many bytes of files (a byte budget)"
    )
    split_by: Literal["file", "document"] = Field(
        "file",
        description="text: a split holds whole files, or whole documents (blank-line "
        "separated); either way a split never moves when files are added",
    )
    tokenizer: Literal["bytes", "bpe"] = Field(
        "bytes", description="bytes: UTF-8 bytes, no training; bpe: trained at ingest"
    )
    vocab_size: int = Field(2048, ge=260, le=65535, description="bpe: vocabulary size")

    @model_validator(mode="after")
    def _features_declared_once(self) -> DataConfig:
        if self.tensor_column and self.feature_columns:
            raise ValueError(
                "set data.tensor_column or data.feature_columns, not both: features come "
                "either from one list column or from several numeric columns"
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


TaskType = Literal["classification", "regression", "language_modeling"]


class TaskConfig(_Section):
    """What is learned, and so the loss, the metrics, the baseline and the gate."""

    type: TaskType = Field(
        "classification",
        description="classification (integer labels), regression (float labels) or "
        "language_modeling (text sources)",
    )
    prompts: list[str] = Field(
        ["def ", "import ", "class Queue"],
        description="language_modeling: prompts whose sampled continuations are logged",
    )
    max_new_tokens: int = Field(120, ge=1, description="language_modeling: tokens generated")
    temperature: float = Field(0.8, gt=0.0, description="language_modeling: sampling")
    top_k: int | None = Field(40, ge=1, description="language_modeling: sample among the k best")
    baseline_max_rows: int = Field(
        50000, ge=100, description="rows of the train split the baseline is fitted on"
    )


class ModelConfig(BaseModel):
    """`name` picks a built-in; `target: package.module:factory` builds the user's own
    module. The remaining keys belong to that model and are validated by it
    (training.models.params), so this section alone is open."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str | None = Field("mlp", description="a built-in: mlp, cnn, gpt")
    target: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="package.module:factory called with the remaining keys",
    )

    @property
    def options(self) -> dict[str, Any]:
        """The model's own keys (everything but name and target)."""
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _one_way_to_build(self) -> ModelConfig:
        from training.models.params import check_model_options

        if self.target and self.name not in (None, "mlp"):
            raise ValueError(
                "set model.name or model.target, not both (name picks a built-in, target "
                "names your own factory as package.module:function)"
            )
        if self.target:
            return self
        check_model_options(self.name, self.options)
        return self


class OptimConfig(_Section):
    lr: float = Field(0.005, gt=0.0)
    weight_decay: float = Field(0.0001, ge=0.0)
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    warmup_steps: int = Field(20, ge=0, description="linear warmup before the schedule")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine floor, times lr")
    grad_clip: float = Field(1.0, ge=0.0, description="max gradient norm; 0 disables")


class TrainConfig(_Section):
    """What computes the model: these keys (with model, task, optim, shard and the data
    version) are the job's identity and the train stage's DVC params."""

    epochs: int = Field(30, ge=1)
    max_steps: int | None = Field(
        None, ge=1, description="stop after this many optimizer steps (null: all epochs)"
    )
    batch_size: int = Field(64, ge=1, description="global batch per optimizer step")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")
    seed: int = Field(0, ge=0)
    deterministic: bool = Field(True, description="deterministic kernels: bitwise resume")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, fp32 on CPU"
    )
    compile: bool = Field(False, description="torch.compile the model")


class RuntimeConfig(_Section):
    """How a job runs. Never part of the job's identity nor a DVC param: changing a key
    here never retrains and never starts a new MLflow run (a stopped job resumes)."""

    world_size: int = Field(
        2, ge=1, description="worker processes on each node (torchrun's nproc_per_node)"
    )
    nnodes: str = Field("1", description="nodes: N, or MIN:MAX to go on when nodes are lost")
    rdzv_endpoint: str = Field(
        "", description="HOST:PORT of the rendezvous on the first node (empty: this machine)"
    )
    rdzv_id: str = Field("", description="the job's id, the same on every node")
    rdzv_last_call_s: float = Field(
        30.0, ge=0.0, description="after MIN nodes joined, how long to wait for more"
    )
    rdzv_join_timeout_s: float = Field(
        600.0, gt=0.0, description="how long a node waits for the others to join"
    )
    local_addr: str = Field(
        "", description="this node's address as the other nodes reach it (empty: hostname)"
    )
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    threads_per_worker: int = Field(1, ge=1, description="torch intra-op threads per rank")
    loader_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank")
    log_every_steps: int = Field(50, ge=1, description="metrics and time breakdown interval")
    eval_every_steps: int | None = Field(
        None, ge=1, description="validation interval in steps (null: at each epoch's end)"
    )
    control_every_steps: int = Field(10, ge=1, description="steps between preemption checks")
    checkpoint_every_steps: int = Field(100, ge=1)
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept on disk")
    async_checkpoint: bool = Field(True, description="write checkpoints off the hot loop")
    straggler_factor: float = Field(1.5, gt=1.0, description="busy time over the median rank")
    collective_timeout_s: float = Field(300.0, gt=0.0, description="a stalled rank fails then")
    max_restarts: int = Field(3, ge=0, description="elastic restarts after a worker failure")

    @field_validator("nnodes", mode="before")
    @classmethod
    def _count_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) else value

    @property
    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes from `nnodes` ("2" or "1:2")."""
        low, _, high = self.nnodes.partition(":")
        return int(low), int(high or low)

    @model_validator(mode="after")
    def _check_nodes(self) -> RuntimeConfig:
        try:
            low, high = self.node_range
        except ValueError:
            low = high = 0
        if not 1 <= low <= high:
            raise ValueError(
                f"runtime.nnodes={self.nnodes!r}: give a node count (2) or MIN:MAX (1:2) "
                "with 1 <= MIN <= MAX"
            )
        if high > 1 and not (self.rdzv_endpoint and self.rdzv_id):
            raise ValueError(
                f"runtime.nnodes={self.nnodes} needs runtime.rdzv_endpoint (HOST:PORT on the "
                "first node, the same on every node) and runtime.rdzv_id (the same job id on "
                "every node): pass --rdzv-endpoint and --rdzv-id to `gradline stage train`"
            )
        host, _, port = self.rdzv_endpoint.rpartition(":")
        if self.rdzv_endpoint and not (host and port.isdigit()):
            raise ValueError(
                f"runtime.rdzv_endpoint={self.rdzv_endpoint!r}: give HOST:PORT, e.g. node1:29500"
            )
        return self


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first, as ranks are laid out


class ParallelConfig(_Section):
    """How the model is laid out over the ranks: a device mesh of pipeline stages (pp),
    full replicas (dp_replicate), sharded replicas (dp_shard, FSDP2) and tensor-parallel
    groups (tp). Their product is runtime.world_size; one may be -1 to take the rest.
    Like runtime, never part of the job's identity: a job saved under one layout resumes
    under another."""

    dp_replicate: int = Field(
        -1, ge=-1, description="replicas holding all parameters (DDP, or HSDP's outer dim)"
    )
    dp_shard: int = Field(1, ge=-1, description="ranks sharing one replica's state (FSDP2)")
    tp: int = Field(1, ge=-1, description="tensor-parallel ranks per layer")
    pp: int = Field(1, ge=-1, description="pipeline stages")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    pp_microbatches: int = Field(4, ge=1, description="micro-batches per pipeline step")
    pp_stages_per_rank: int = Field(
        2, ge=2, description="interleaved_1f1b: model chunks (virtual stages) per rank"
    )
    activation_checkpointing: Literal["none", "block"] = Field(
        "none", description="block: recompute each block's activations in backward"
    )
    param_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="sharded parameters in compute: auto is bf16 on CUDA, else fp32"
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype gradients are reduced in, when sharded"
    )
    # How the data-parallel replicas combine their work (training.engine.updates). Unlike
    # the layout above, these change what is computed: they are part of the job (UPDATE_KEYS).
    update: Literal["sync", "local_sgd", "diloco", "async"] = Field(
        "sync", description="sync | local_sgd | diloco | async (parameter server)"
    )
    sync_every: int = Field(8, ge=1, description="local_sgd/diloco: local steps per sync (H)")
    sync_warmup_steps: int = Field(
        0, ge=0, description="local_sgd/diloco: steps of every-step sync first (post-local SGD)"
    )
    outer_lr: float = Field(0.7, gt=0, description="diloco: outer SGD learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="diloco: outer Nesterov momentum")
    max_staleness: int = Field(
        2, ge=0, description="async: server steps a gradient may lag (0 is synchronous)"
    )
    grad_compression: Literal["none", "fp16", "powersgd"] = Field(
        "none", description="how data-parallel gradients travel: none | fp16 | powersgd"
    )
    powersgd_rank: int = Field(4, ge=1, description="powersgd: rank of the low-rank factors")
    # Straggler mitigation: same rows, same gradient, only who computes what moves.
    balance: Literal["even", "measured"] = Field(
        "even", description="measured: each rank's batch share follows its throughput"
    )
    balance_every_logs: int = Field(
        2, ge=1, description="measured: re-measure shares every N logging intervals"
    )

    @model_validator(mode="before")
    @classmethod
    def _one_size_takes_the_rest(cls, data: Any) -> Any:
        # dp_replicate takes the rest by default; when another size is set to -1, that
        # one does, and dp_replicate (unless given) is 1.
        takes_rest = isinstance(data, dict) and any(data.get(d) == -1 for d in MESH_DIMS)
        if takes_rest and "dp_replicate" not in data:
            data = {**data, "dp_replicate": 1}
        return data

    @model_validator(mode="after")
    def _degrees_are_sizes(self) -> ParallelConfig:
        degrees = {d: getattr(self, d) for d in MESH_DIMS}
        if any(v == 0 for v in degrees.values()):
            zero = [d for d, v in degrees.items() if v == 0]
            raise ValueError(f"parallel.{zero[0]} must be >= 1, or -1 for the rest")
        if sum(v == -1 for v in degrees.values()) > 1:
            rest = [f"parallel.{d}" for d, v in degrees.items() if v == -1]
            raise ValueError(
                f"only one mesh size may be -1, got {' and '.join(rest)}; give the others "
                "numbers (parallel.dp_replicate is -1 by default: set it to 1 when another "
                "size takes the rest)"
            )
        return self

    def degrees(self, world_size: int) -> dict[str, int]:
        """The mesh sizes for `world_size` ranks, -1 resolved; ValueError when they do not
        multiply to it."""
        given = {d: getattr(self, d) for d in MESH_DIMS}
        fixed = 1
        for value in given.values():
            fixed *= value if value > 0 else 1
        rest = [d for d, v in given.items() if v == -1]
        if rest and world_size % fixed == 0:
            given[rest[0]] = world_size // fixed
        product = 1
        for value in given.values():
            product *= max(value, 1)
        if product != world_size or any(v < 1 for v in given.values()):
            shown = " x ".join(f"{d}={v}" for d, v in self.model_dump().items() if d in given)
            raise ValueError(
                f"the mesh {shown} does not fit runtime.world_size={world_size}: the sizes "
                "must multiply to the world size; set one of them to -1 to take the rest "
                "(e.g. parallel.dp_replicate: -1), or change runtime.world_size"
            )
        return given


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
    train_pool: str = Field(
        "",
        description="Prefect work pool that runs the train stage (its `gradline-train` "
        "deployment, see `gradline deploy-train`); empty: train on this machine",
    )
    mlflow_ui_url: str = Field(
        "http://127.0.0.1:5000",
        description="MLflow UI for links when the tracking store is local (`gradline ui`)",
    )


class Config(_Section):
    data: DataConfig = DataConfig()
    shard: ShardConfig = ShardConfig()
    task: TaskConfig = TaskConfig()
    model: ModelConfig = ModelConfig(name="mlp", hidden=256, depth=2, dropout=0.2)
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    parallel: ParallelConfig = ParallelConfig()
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

    def identity(self) -> dict[str, Any]:
        """What defines the job (with the data version): everything that computes the
        model, nothing about how the job runs."""
        identity = {section: getattr(self, section).model_dump() for section in JOB_SECTIONS}
        update = {key: self.flat()[key] for key in UPDATE_KEYS}
        defaults = {key: _default(key) for key in UPDATE_KEYS}
        # Only when the rule is not the default: jobs from before update rules keep
        # their keys (and resume).
        if update != defaults:
            identity["update"] = update
        return identity

    @model_validator(mode="after")
    def _sections_agree(self) -> Config:
        from training.models.params import check_model_layout, check_model_task

        self._check_layout()
        task, source = self.task.type, self.data.source
        text = source in TEXT_SOURCES
        if text != (task == "language_modeling"):
            raise ValueError(
                f"task.type {task} does not fit data.source {source}: text sources "
                f"({', '.join(TEXT_SOURCES)}) train language models, tables and images "
                "train classification or regression"
            )
        fixed = {"digits": "classification", "diabetes": "regression"}
        if fixed.get(source, task) != task:
            raise ValueError(
                f"data.source {source} is a {fixed[source]} data set; set task.type: "
                f"{fixed[source]}"
            )
        if (
            task == "classification"
            and source in ("parquet", "csv")
            and self.data.num_classes is None
        ):
            raise ValueError(
                f"data.num_classes is required to classify a {source} table: labels are "
                "checked against 0..num_classes-1 (or set task.type: regression)"
            )
        if not self.model.target:
            check_model_task(self.model.name, task)
            check_model_layout(
                self.model.name, self.model.options, self.layout(), self.pipeline_stages()
            )
        return self

    def layout(self) -> dict[str, int]:
        """The resolved mesh sizes: pp, dp_replicate, dp_shard, tp, for the most ranks the
        job can have (every node at its full count); the workers resolve them again for
        the ranks that actually joined."""
        return self.parallel.degrees(self.runtime.world_size * self.runtime.node_range[1])

    def _check_layout(self) -> None:
        """The global batch splits evenly over data-parallel ranks, micro-batches and
        pipeline micro-batches; the layout's options fit each other."""
        mesh, par, train = self.layout(), self.parallel, self.train
        dp = mesh["dp_replicate"] * mesh["dp_shard"]
        share = dp * train.grad_accum_steps
        if train.batch_size % share:
            raise ValueError(
                f"train.batch_size ({train.batch_size}) must be a multiple of the "
                f"data-parallel ranks x train.grad_accum_steps ({dp} x "
                f"{train.grad_accum_steps} = {share}) so every rank and micro-batch gets "
                "the same share"
            )
        if mesh["pp"] > 1:
            if train.grad_accum_steps > 1:
                raise ValueError(
                    "with parallel.pp > 1 the pipeline's micro-batches accumulate gradients: "
                    "set train.grad_accum_steps: 1 and use parallel.pp_microbatches"
                )
            local = train.batch_size // dp
            micro = par.pp_microbatches
            if local % micro or micro < mesh["pp"]:
                raise ValueError(
                    f"parallel.pp_microbatches ({micro}) must divide each data-parallel "
                    f"rank's batch ({local} rows) and be at least parallel.pp ({mesh['pp']})"
                    " so every stage has work"
                )
            if par.pp_schedule == "interleaved_1f1b" and micro % mesh["pp"]:
                raise ValueError(
                    f"parallel.pp_schedule interleaved_1f1b needs parallel.pp_microbatches "
                    f"({micro}) to be a multiple of parallel.pp ({mesh['pp']})"
                )
        sharded = mesh["dp_shard"] > 1
        if not sharded and (par.param_dtype == "bf16" or par.reduce_dtype == "bf16"):
            raise ValueError(
                "parallel.param_dtype and reduce_dtype apply to sharded parameters: set "
                "parallel.dp_shard > 1, or leave them at auto/fp32"
            )
        self._check_update_rule(mesh)
        if train.compile and (mesh["tp"] > 1 or mesh["pp"] > 1 or sharded):
            raise ValueError(
                "train.compile works with plain data parallelism (DDP) only for now: set "
                "train.compile: false to use sharding, tensor or pipeline parallelism"
            )

    def _check_update_rule(self, mesh: dict[str, int]) -> None:
        """Update rules, compression and measured balance act on plain data-parallel
        replicas (DDP); refuse what they cannot be combined with, naming the keys."""
        par, train = self.parallel, self.train
        split = [f"parallel.{d}={mesh[d]}" for d in ("dp_shard", "tp", "pp") if mesh[d] > 1]
        wanted = [
            f"parallel.{key}={value}"
            for key, value, default in (
                ("update", par.update, "sync"),
                ("grad_compression", par.grad_compression, "none"),
                ("balance", par.balance, "even"),
            )
            if value != default
        ]
        if split and wanted:
            raise ValueError(
                f"{wanted[0]} acts on whole replicas (plain data parallelism), not with "
                f"{split[0]}: set {split[0].split('=')[0]}=1, or leave {wanted[0].split('=')[0]} "
                "at its default"
            )
        if par.grad_compression != "none" and par.update != "sync":
            raise ValueError(
                f"parallel.grad_compression={par.grad_compression} compresses the every-step "
                f"gradient all-reduce; parallel.update={par.update} does not make one (it "
                "averages parameters or pushes gradients to a server): use one or the other"
            )
        if par.balance == "measured" and par.update != "sync":
            raise ValueError(
                f"parallel.balance=measured evens out synchronous steps; parallel.update="
                f"{par.update} does not wait for every rank each step: set parallel.balance: "
                "even, or parallel.update: sync"
            )
        if train.compile and (par.update != "sync" or par.balance == "measured"):
            raise ValueError(
                "train.compile works with synchronous, evenly split steps only for now: set "
                "train.compile: false, or parallel.update: sync and parallel.balance: even"
            )

    def pipeline_stages(self, mesh: dict[str, int] | None = None) -> int:
        """Model chunks the pipeline is cut into (pp, or pp x stages per rank)."""
        pp = (mesh or self.layout())["pp"]
        interleaved = self.parallel.pp_schedule == "interleaved_1f1b"
        return pp * self.parallel.pp_stages_per_rank if interleaved and pp > 1 else pp


# What defines a job, with the data version: its key, its DVC params, its MLflow run.
JOB_SECTIONS = ("shard", "task", "model", "optim", "train")
# Sections that say where results are recorded or how a job runs, not what it computes:
# no DVC stage depends on them, so changing them never makes a stage stale...
UNTRACKED_SECTIONS = frozenset({"runtime", "parallel", "registry", "orchestrate"})
# ...except the update rule's keys: local SGD, DiLoCo, async updates and compressed
# gradients compute a different model, so they belong to the job like optim's keys.
UPDATE_KEYS = tuple(
    f"parallel.{k}"
    for k in (
        "update",
        "sync_every",
        "sync_warmup_steps",
        "outer_lr",
        "outer_momentum",
        "max_staleness",
        "grad_compression",
        "powersgd_rank",
    )
)


def _default(key: str) -> Any:
    section, field = key.split(".")
    return Config.model_fields[section].annotation.model_fields[field].default


def is_tracked(key: str) -> bool:
    """Whether `section.key` is part of the job (a DVC param, an MLflow param)."""
    return key.split(".")[0] not in UNTRACKED_SECTIONS or key in UPDATE_KEYS


# Keys that moved when `train` was split; an old params.yaml or --set gets pointed on.
MOVED_KEYS = {
    **{f"train.{k}": f"runtime.{k}" for k in RuntimeConfig.model_fields},
    **{f"train.{k}": f"optim.{k}" for k in OptimConfig.model_fields},
    "train.hidden": "model.hidden",
    "train.dropout": "model.dropout",
}
OPEN_SECTIONS = frozenset({"model"})  # its keys depend on the model; validated there


def _section_fields(section: str) -> list[str]:
    return list(Config.model_fields[section].annotation.model_fields)


def _moved(key: str) -> str:
    return f"; it moved to {MOVED_KEYS[key]}" if key in MOVED_KEYS else ""


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
    if section not in OPEN_SECTIONS and field not in _section_fields(section):
        raise ConfigError(
            f"override {text!r}: unknown key {section}.{field}{_moved(key.strip())}; "
            f"keys in {section} are {', '.join(_section_fields(section))}"
        )
    try:
        value = yaml.load(raw, Loader=Yaml12Loader) if raw.strip() else None
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
            lines.append(f"  {where}: unknown key{_moved(where)}; allowed: {', '.join(allowed)}")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {where}: {err['msg']}{shown}")
    return ConfigError(f"invalid configuration in {source}:\n" + "\n".join(lines))


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where `1:2` is the base-60 number 62; in YAML 1.2 (and to
    every reader of params.yaml) it is text, e.g. the node range `runtime.nnodes: 1:2`."""


_COLON_NUMBERS = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-9_]+)+(?:\.[0-9_]*)?$")
# Resolvers are tried in order: text first for colon-separated digits, then the rest.
Yaml12Loader.yaml_implicit_resolvers = {
    first: [("tag:yaml.org,2002:str", _COLON_NUMBERS), *resolvers]
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
        "a mapping of sections (data, shard, task, model, optim, train, runtime...)",
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
    from ruamel.yaml import YAML  # dvc's own YAML library: round-trips comments

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
