"""The sections of params.yaml that say how the model is trained, how a job runs, and
where its results go. The data, task and model sections belong to the packages that
read them (training.data.options, training.objectives, training.models.options).

Which of these keys define the job and which only describe a run is decided in one
place: training.config.jobspec.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from training.options import (
    ONE_YEAR_S,
    ExperimentName,
    Fraction,
    Name,
    OptionalName,
    RetryCount,
    Seconds,
    Section,
    Seed,
    ThreadCount,
    WebUrl,
    WorkerCount,
)

_NOTIFY = re.compile(r"env:[A-Za-z_][A-Za-z0-9_]*|block:[a-z0-9][a-z0-9-]*")


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = Field(
        "adamw", description="adamw, or sgd (with optim.momentum, Nesterov when above 0)"
    )
    lr: float = Field(0.005, gt=0.0)
    weight_decay: float = Field(
        0.0001, ge=0.0, description="adamw: decoupled decay; sgd: L2 added to the gradient"
    )
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="sgd: momentum (0: plain SGD)")
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    warmup_steps: int = Field(20, ge=0, description="linear warmup before the schedule")
    min_lr_ratio: Fraction = Field(0.1, ge=0.0, le=1.0, description="cosine floor, times lr")
    grad_clip: float = Field(1.0, ge=0.0, description="max gradient norm; 0 disables")


class TrainConfig(Section):
    epochs: int = Field(30, ge=1)
    max_steps: int | None = Field(
        None, ge=1, description="stop after this many optimizer steps (null: all epochs)"
    )
    batch_size: int = Field(64, ge=1, description="global batch per optimizer step")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")
    micro_batch: Literal["auto"] | None = Field(
        None,
        description="auto: the largest per-rank micro-batch that fits the device (or "
        "train.memory_budget_mb), with grad_accum_steps set to keep the global batch",
    )
    memory_budget_mb: float | None = Field(
        None,
        gt=0.0,
        description="memory one rank may use, for micro_batch: auto (unset: the GPU's free "
        "memory, or this host's available memory shared by its ranks)",
    )
    seed: Seed = 0
    deterministic: bool = Field(True, description="deterministic kernels: bitwise resume")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, fp32 on CPU"
    )
    compile: bool = Field(False, description="torch.compile the model")
    max_nonfinite_steps: int = Field(
        10,
        ge=1,
        le=1_000_000,
        description="steps in a row whose loss or gradient is NaN or infinite (each skipped "
        "on every rank) before the job stops as diverged",
    )
    # Early stopping and checkpoint selection (training.engine.selection) watch one
    # validation metric; they are job keys because they change which model comes out.
    early_stopping_patience: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="validations in a row without improvement before the job stops early "
        "(null: train every step)",
    )
    early_stopping_min_delta: float = Field(
        0.0,
        ge=0.0,
        description="an improvement of the watched metric smaller than this does not count",
    )
    early_stopping_metric: str = Field(
        "",
        max_length=64,
        description="the validation metric early stopping and select: best watch (empty: the "
        "gate's metric on validation, e.g. val_accuracy)",
    )
    select: Literal["best", "last"] = Field(
        "best",
        description="which checkpoint becomes the model: best (by the watched validation "
        "metric) or last",
    )


UpdateRule = Literal["sync", "local_sgd", "diloco", "async"]


class UpdateConfig(Section):
    """How the data-parallel replicas combine their work (training.engine.updates).
    Unlike the layout (parallel), the rule changes what is computed: it is part of the
    job."""

    rule: UpdateRule = Field(
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


class RuntimeConfig(Section):
    """How a job runs (training.config.jobspec): changing a key here never retrains and
    never starts a new MLflow run (a stopped job resumes)."""

    procs_per_node: WorkerCount = Field(
        2, ge=1, description="worker processes on each node (torchrun's nproc_per_node)"
    )
    nnodes: str = Field("1", description="nodes: N, or MIN:MAX to go on when nodes are lost")
    rdzv_endpoint: str = Field(
        "", description="HOST:PORT of the rendezvous on the first node (empty: this machine)"
    )
    rdzv_id: OptionalName = Field("", description="the job's id, the same on every node")
    rdzv_last_call_s: Seconds = Field(
        30.0, ge=0.0, description="after MIN nodes joined, how long to wait for more"
    )
    rdzv_join_timeout_s: Seconds = Field(
        600.0, gt=0.0, description="how long a node waits for the others to join"
    )
    local_addr: str = Field(
        "", description="this node's address as the other nodes reach it (empty: hostname)"
    )
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    threads_per_worker: ThreadCount = Field(1, description="torch intra-op threads per rank")
    pin_cpu_cores: bool = Field(
        False,
        description="pin each local rank to its own CPU cores (threads_per_worker of them, "
        "local rank r from core r * threads_per_worker): no rank's threads migrate onto "
        "another's core (CPU training, benchmarks)",
    )
    loader_workers: WorkerCount = Field(0, ge=0, description="DataLoader worker processes per rank")
    log_every_steps: int = Field(50, ge=1, description="metrics and time breakdown interval")
    eval_every_steps: int | None = Field(
        None, ge=1, description="validation interval in steps (null: at each epoch's end)"
    )
    control_every_steps: int = Field(10, ge=1, description="steps between preemption checks")
    checkpoint_every_steps: int = Field(100, ge=1)
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept on disk")
    async_checkpoint: bool = Field(True, description="write checkpoints off the hot loop")
    straggler_factor: float = Field(1.5, gt=1.0, description="busy time over the median rank")
    peak_tflops: float | None = Field(
        None,
        gt=0.0,
        description="peak TFLOP/s of one rank's device for MFU; unset: a table of known GPUs, "
        "or the measured matmul rate on a CPU",
    )
    collective_timeout_s: Seconds = Field(300.0, gt=0.0, description="a stalled rank fails then")
    max_restarts: RetryCount = Field(3, description="elastic restarts after a worker failure")

    @field_validator("nnodes", mode="before")
    @classmethod
    def _count_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) else value

    @property
    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes from `nnodes` ("2" or "1:2")."""
        low, _, high = self.nnodes.partition(":")
        return int(low), int(high or low)

    @property
    def max_world_size(self) -> int:
        """Workers of the whole job when every node it may have has joined."""
        return self.procs_per_node * self.node_range[1]

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
        if self.rdzv_endpoint and not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(
                f"runtime.rdzv_endpoint={self.rdzv_endpoint!r}: give HOST:PORT with a port "
                "from 1 to 65535, e.g. node1:29500"
            )
        return self


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first, as ranks are laid out


class ParallelConfig(Section):
    """How the model is laid out over the ranks: a device mesh of pipeline stages (pp),
    full replicas (dp_replicate), sharded replicas (dp_shard, FSDP2) and tensor-parallel
    groups (tp). Their product is the job's world size (runtime.procs_per_node on each
    node); one may be -1 to take the rest. Like runtime, how a job runs: a job saved
    under one layout resumes under another."""

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
    # Straggler mitigation: same rows, same gradient, only who computes what moves.
    balance: Literal["even", "measured"] = Field(
        "even", description="measured: each rank's batch share follows its throughput"
    )
    balance_every_logs: int = Field(
        2, ge=1, description="measured: re-measure shares every N logging intervals"
    )
    # Embedding tables (models with an EmbeddingTables, e.g. dlrm) spread over the
    # data-parallel ranks; the dense part stays DDP (training.engine.embedding_sharding).
    embedding_sharding: Literal["none", "table", "row"] = Field(
        "none",
        description="table: each embedding table whole on one rank (balanced by bytes); "
        "row: each table's rows in contiguous blocks over the ranks; none: every rank "
        "holds every table",
    )
    embedding_budget_mb: float = Field(
        0.0,
        ge=0.0,
        le=1e9,
        description="a rank's budget for embedding state (weights + optimizer state), MB; "
        "tables that do not fit fail before training (0: no limit)",
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
                f"the mesh {shown} does not fit the job's {world_size} workers: the sizes "
                "must multiply to the world size (runtime.procs_per_node times the nodes); "
                "set one of them to -1 to take the rest (e.g. parallel.dp_replicate: -1), "
                "or change runtime.procs_per_node"
            )
        return given


class EvaluateConfig(Section):
    """How the trained model is scored and shown; changing these re-runs evaluation only."""

    batch_size: int = Field(512, ge=1)
    baseline_max_rows: int = Field(
        50000, ge=100, description="rows of the train split the baseline is fitted on"
    )
    prompts: list[str] = Field(
        ["def ", "import ", "class Queue"],
        description="language_modeling: prompts whose sampled continuations are shown",
    )
    max_new_tokens: int = Field(120, ge=1, description="language_modeling: tokens generated")
    temperature: float = Field(0.8, gt=0.0, description="language_modeling: sampling")
    top_k: int | None = Field(40, ge=1, description="language_modeling: sample among the k best")
    bootstrap_replicates: int = Field(
        1000,
        ge=0,
        description="resamples of the test split behind each metric's 95 % interval in the "
        "model card (0: no intervals)",
    )
    bootstrap_seed: int = Field(0, ge=0, description="seed of those resamples")


class RegistryConfig(Section):
    experiment: ExperimentName = Field("gradline", description="MLflow experiment")
    model_name: Name = Field("gradline-digits", description="registered model")


class OrchestrateConfig(Section):
    device_limit: Name = Field(
        "gradline-devices",
        description="Prefect global concurrency limit holding one slot per training device",
    )
    device_slots: int = Field(
        0,
        ge=0,
        description="slots the limit gets when gradline creates it (0: GPUs here, else CPUs)",
    )
    quota_wait_s: Seconds = Field(
        3600.0,
        gt=0,
        description="how long a run waits for its device slots before it gives up, naming "
        "the quota (a run holding them, or slots a killed run leaked)",
    )
    slot_lease_s: Seconds = Field(
        60.0,
        ge=60.0,  # the Prefect server's minimum
        description="how long the lease on a run's device slots lasts; the run renews it "
        "while it lives, so a run that died gives its slots back at most this long after",
    )
    tracking_wait_s: Seconds = Field(
        600.0,
        gt=0,
        description="how long registration waits for an MLflow tracking server that does "
        "not answer (the job's records wait in its journal) before it fails, naming what "
        "is kept and that `gradline sync` ships it and registers",
    )
    stop_grace_s: Seconds = Field(
        120.0,
        gt=0,
        description="after Ctrl-C or SIGTERM, how long `gradline run` waits for the run to "
        "stop (training checkpoints first) before it kills what is left",
    )
    stage_retries: RetryCount = Field(2, description="retries of a stage that crashed")
    preemption_retries: RetryCount = Field(
        10, description="retries of a stage stopped by a preemption (exit 75)"
    )
    retry_delay_s: Seconds = Field(5.0, ge=0.0)
    train_pool: OptionalName = Field(
        "",
        description="Prefect work pool that runs the train stage (its `gradline-train` "
        "deployment, see `gradline deploy-train`); empty: train on this machine",
    )
    mlflow_ui_url: WebUrl = Field(
        "http://127.0.0.1:5000",
        description="MLflow UI for links when the tracking store is local (`gradline ui`)",
    )
    notify: str = Field(
        "",
        description="where the alert webhook's URL is kept: env:NAME (an environment "
        "variable) or block:NAME (a Prefect Secret block); empty: no alerts",
    )

    stale_after_h: float = Field(
        48.0,
        ge=0.003,
        le=ONE_YEAR_S / 3600,
        description="with alerts on, a served deployment with a schedule and no "
        "successful run for this many hours is reported as stale",
    )
    drift: Literal["warn", "block"] = Field(
        "warn",
        description="new data that drifted from the champion's past a threshold: warn, "
        "or block (the run stops before training; `gradline run --accept-drift` accepts it)",
    )
    drift_psi_threshold: float = Field(
        0.2,
        gt=0.0,
        description="a table's feature or label drifted when its PSI against the "
        "champion's data is above this (0.1-0.25: a moderate shift, above: a major one)",
    )
    drift_js_threshold: float = Field(
        0.1,
        gt=0.0,
        le=1.0,
        description="text drifted when the Jensen-Shannon divergence (bits) of its byte "
        "unigrams against the champion's data is above this",
    )

    @field_validator("notify")
    @classmethod
    def _a_place_not_a_url(cls, notify: str) -> str:
        if notify and not _NOTIFY.fullmatch(notify):
            hint = (
                "params.yaml is committed, and a webhook URL is a credential: put it in an "
                "environment variable and give env:NAME, or in a Prefect Secret block and "
                "give block:NAME"
                if "://" in notify
                else "give env:NAME (an environment variable holding the webhook URL) or "
                "block:NAME (a Prefect Secret block holding it)"
            )
            raise ValueError(f"{notify!r} is not where a webhook URL is kept: {hint}")
        return notify


class ScoreConfig(Section):
    """`gradline score`: predictions of a registered model version on new rows. Like
    `registry`, no stage reads it and no job key holds it (training/config/jobspec.py)."""

    model: str = Field(
        "",
        max_length=600,
        description="the model version: NAME@ALIAS or NAME/VERSION; empty: "
        "<registry.model_name>@champion",
    )
    input: str = Field(
        "data/new",
        min_length=1,
        description="a folder (or one file) of new rows, relative to the project: Parquet or "
        "CSV tables; for a language model also *.txt files, one prompt each",
    )
    output: str = Field(
        "data/scores/predictions.parquet",
        pattern=r"\.parquet$",
        description="the predictions' Parquet file, inside the project (DVC tracks it); bad "
        "rows go to <name>.quarantine.parquet beside it",
    )
    on_bad_rows: Literal["fail", "quarantine"] = Field(
        "fail",
        description="fail: invalid rows stop the command, nothing is written; quarantine: "
        "they are set aside with their reason and the rest is scored",
    )
    format: Literal["auto", "parquet", "csv", "text"] = Field(
        "auto", description="what the input files are; auto: the kind found in the folder"
    )
    key_column: str | None = Field(
        None,
        description="the column identifying a row, copied to the output; null: "
        "data.key_column or `id` when the input has one, else the file and row number",
    )
    tensor_column: str | None = Field(
        None,
        description="one list column holding each row's features; null: data.tensor_column "
        "when a parquet/csv table sets one, else the model's feature columns by name",
    )
    prompt_column: str = Field("prompt", min_length=1, description="language models' tables")
    batch_rows: int = Field(
        8192,
        ge=1,
        le=1 << 24,
        description="rows read, checked, predicted and written at a time (memory stays about "
        "one batch, whatever the input's size; lower it for wide rows such as images)",
    )
    # Language models: how continuations are sampled; null keeps the registered model's
    # own defaults (its signature's params, the evaluate section it was trained with).
    max_new_tokens: int | None = Field(None, ge=1, le=1 << 20)
    temperature: float | None = Field(None, ge=0.0)
    top_k: int | None = Field(None, ge=0)
    seed: Seed | None = None
