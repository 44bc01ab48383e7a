"""`Config`: every section of params.yaml in one typed value, checked against each other.

What computes the model (data, shard, task, model, optim, train, update) and how a job
runs (runtime, parallel) are separate sections; evaluate, registry and orchestrate say
how results are scored, recorded and scheduled. The checks here are the ones no single
section can make: a task against the data source, a model against the task, a layout
against the batch and the model, an update rule against the layout.
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from training.config.sections import (
    EvaluateConfig,
    OptimConfig,
    OrchestrateConfig,
    ParallelConfig,
    RegistryConfig,
    RuntimeConfig,
    ScoreConfig,
    TrainConfig,
    UpdateConfig,
)
from training.config.sweep import SweepConfig
from training.data.clicks import ID_COLUMNS as CLICK_ID_COLUMNS
from training.data.options import SOURCES, USER_TABLE_SOURCES, DataConfig, ShardConfig
from training.errors import ConfigError
from training.models.options import BUILTINS, ModelConfig, check_model_layout
from training.objectives import Generation, TaskConfig, tasks_learning, tasks_with_labels
from training.options import Section


class Config(Section):
    data: DataConfig = DataConfig()
    shard: ShardConfig = ShardConfig()
    task: TaskConfig = TaskConfig()
    model: ModelConfig = ModelConfig(name="mlp", hidden=256, depth=2, dropout=0.2)
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    update: UpdateConfig = UpdateConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    parallel: ParallelConfig = ParallelConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    registry: RegistryConfig = RegistryConfig()
    orchestrate: OrchestrateConfig = OrchestrateConfig()
    sweep: SweepConfig = SweepConfig()  # what `gradline sweep` searches; no job's part
    score: ScoreConfig = ScoreConfig()

    def flat(self) -> dict[str, Any]:
        """`section.key -> value`, the form MLflow params and DVC param names use."""
        return {
            f"{section}.{key}": value
            for section, values in self.model_dump().items()
            for key, value in values.items()
        }

    def generation(self) -> Generation:
        """How samples are drawn: the evaluate section's prompts and settings, seeded by
        the job's seed, so two evaluations of one job differ only by the model."""
        ev = self.evaluate
        return Generation(
            tuple(ev.prompts), ev.max_new_tokens, ev.temperature, ev.top_k, self.train.seed
        )

    @model_validator(mode="after")
    def _sections_agree(self) -> Config:
        self._check_layout()
        self._check_task_fits_source()
        self._check_forecasting()
        self._check_watched_metric()
        if not self.model.target:
            self._check_model_learns_task()
            check_model_layout(
                self.model.name, self.model.options, self.layout(), self.pipeline_stages()
            )
            self._check_table_rows()
        return self

    def _check_table_rows(self) -> None:
        """A dlrm's per-column table sizes against the id columns the data will have
        (checked again against the manifest when the model is built)."""
        rows = self.model.options.get("table_rows")
        if self.model.name != "dlrm" or not isinstance(rows, list):
            return
        ids = CLICK_ID_COLUMNS if self.data.source == "clicks" else self.data.categorical_columns
        if ids is not None and len(rows) != len(ids):
            raise ValueError(
                f"model.table_rows lists {len(rows)} sizes, but the data has {len(ids)} id "
                f"columns ({', '.join(ids)}); give one size per column in that order, or one "
                "number for all"
            )

    def _check_task_fits_source(self) -> None:
        card, name = self.task.card, self.data.source
        source = SOURCES[name]
        if not card.fits(source.kinds):
            fits = " or ".join(tasks_learning(source.kinds))
            raise ValueError(
                f"task.type {card.name} does not fit data.source {name}: it learns from "
                f"{' or '.join(card.learns_from)} data, and {name} gives "
                f"{' or '.join(source.kinds)} data (set task.type: {fits}, or a source "
                f"whose data it learns from)"
            )
        if source.labels and card.labels != source.labels:
            fits = " or ".join(tasks_with_labels(source.labels))
            raise ValueError(f"data.source {name} is a {fits} data set; set task.type: {fits}")
        classes = card.labels == "classes" and not source.knows_classes
        if classes and self.data.num_classes is None:
            raise ValueError(
                f"data.num_classes is required to classify a {name} table: labels are "
                "checked against 0..num_classes-1 (or set task.type: regression)"
            )

    def _check_forecasting(self) -> None:
        if not self.task.card.learns_series:
            return
        task, data = self.task, self.data
        if data.source in USER_TABLE_SOURCES and not data.time_column:
            raise ValueError(
                f"task.type {self.task.type} on a {data.source} table needs "
                "data.time_column: "
                "the column holding each point's time (dates, or whole-number steps); the "
                "target is data.label_column, covariates data.feature_columns"
            )
        if task.season > task.context:
            raise ValueError(
                f"task.season ({task.season}) is longer than task.context ({task.context}): "
                "the seasonal-naive baseline repeats the last season of the context, so "
                "the context must hold one; raise task.context or lower task.season"
            )

    def _check_watched_metric(self) -> None:
        try:
            self.task.card.validation_metric(self.train.early_stopping_metric)
        except ConfigError as exc:
            raise ValueError(f"train.early_stopping_metric: {exc}") from None

    def _check_model_learns_task(self) -> None:
        name, card = self.model.name, self.task.card
        if not card.fits(BUILTINS[name].kinds):
            fits = [n for n, b in BUILTINS.items() if card.fits(b.kinds)]
            raise ValueError(
                f"model {name} cannot learn task {card.name}; for {card.name} use model.name "
                f"{' or '.join(fits)}"
            )

    def layout(self) -> dict[str, int]:
        """The resolved mesh sizes: pp, dp_replicate, dp_shard, tp, for the most ranks the
        job can have (every node at its full count); the workers resolve them again for
        the ranks that actually joined."""
        return self.parallel.degrees(self.runtime.max_world_size)

    def pipeline_stages(self, mesh: dict[str, int] | None = None) -> int:
        """Model chunks the pipeline is cut into (pp, or pp x stages per rank)."""
        pp = (mesh or self.layout())["pp"]
        interleaved = self.parallel.pp_schedule == "interleaved_1f1b"
        return pp * self.parallel.pp_stages_per_rank if interleaved and pp > 1 else pp

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
        if train.micro_batch == "auto" and (train.grad_accum_steps > 1 or mesh["pp"] > 1):
            raise ValueError(
                "train.micro_batch: auto chooses train.grad_accum_steps itself, and a "
                "pipeline has its own micro-batches: set train.grad_accum_steps: 1 and "
                "parallel.pp: 1, or drop train.micro_batch"
            )
        if mesh["pp"] > 1:
            self._check_pipeline(mesh, train.batch_size // dp)
        sharded = mesh["dp_shard"] > 1
        if not sharded and (par.param_dtype == "bf16" or par.reduce_dtype == "bf16"):
            raise ValueError(
                "parallel.param_dtype and reduce_dtype apply to sharded parameters: set "
                "parallel.dp_shard > 1, or leave them at auto/fp32"
            )
        self._check_update_rule(mesh)
        self._check_embedding_sharding(mesh)
        if train.compile and (mesh["tp"] > 1 or mesh["pp"] > 1 or sharded):
            raise ValueError(
                "train.compile works with plain data parallelism (DDP) only for now: set "
                "train.compile: false to use sharding, tensor or pipeline parallelism"
            )

    def _check_pipeline(self, mesh: dict[str, int], local: int) -> None:
        par = self.parallel
        if self.train.grad_accum_steps > 1:
            raise ValueError(
                "with parallel.pp > 1 the pipeline's micro-batches accumulate gradients: "
                "set train.grad_accum_steps: 1 and use parallel.pp_microbatches"
            )
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

    def _check_embedding_sharding(self, mesh: dict[str, int]) -> None:
        """Embedding tables are sharded over the ranks of a plain data-parallel (DDP) mesh
        whose replicas take every step together; only a model with tables has any."""
        sharding = self.parallel.embedding_sharding
        if sharding == "none":
            return
        key = f"parallel.embedding_sharding={sharding}"
        split = [f"parallel.{d}={mesh[d]}" for d in ("dp_shard", "tp", "pp") if mesh[d] > 1]
        if split:
            raise ValueError(
                f"{key} spreads the tables over the data-parallel (DDP) ranks and keeps the "
                f"dense part replicated; it does not combine with {split[0]}: set "
                f"{split[0].split('=')[0]}=1 (parallel.dp_replicate: -1), or "
                "parallel.embedding_sharding: none"
            )
        if self.update.rule != "sync":
            raise ValueError(
                f"{key} needs update.rule: sync: each table row lives on one rank, so "
                f"replicas cannot step on their own (update.rule={self.update.rule})"
            )
        if self.train.compile:
            raise ValueError(f"{key} does not run under train.compile: set train.compile: false")
        name = self.model.name
        if not self.model.target and "embeddings" not in BUILTINS[name].splits:
            having = [n for n, b in BUILTINS.items() if "embeddings" in b.splits]
            use = f"model.name: {' or '.join(having)}, or " if having else ""
            raise ValueError(
                f"{key} shards a model's embedding tables, and model {name} has none: use "
                f"{use}parallel.embedding_sharding: none"
            )

    def _check_update_rule(self, mesh: dict[str, int]) -> None:
        """Update rules, compression and measured balance act on plain data-parallel
        replicas (DDP); refuse what they cannot be combined with, naming the keys."""
        update, par, train = self.update, self.parallel, self.train
        split = [f"parallel.{d}={mesh[d]}" for d in ("dp_shard", "tp", "pp") if mesh[d] > 1]
        wanted = [
            f"{key}={value}"
            for key, value, default in (
                ("update.rule", update.rule, "sync"),
                ("update.grad_compression", update.grad_compression, "none"),
                ("parallel.balance", par.balance, "even"),
            )
            if value != default
        ]
        if split and wanted:
            raise ValueError(
                f"{wanted[0]} acts on whole replicas (plain data parallelism), not with "
                f"{split[0]}: set {split[0].split('=')[0]}=1, or leave {wanted[0].split('=')[0]} "
                "at its default"
            )
        if update.grad_compression != "none" and update.rule != "sync":
            raise ValueError(
                f"update.grad_compression={update.grad_compression} compresses the every-step "
                f"gradient all-reduce; update.rule={update.rule} does not make one (it "
                "averages parameters or pushes gradients to a server): use one or the other"
            )
        if par.balance == "measured" and update.rule != "sync":
            raise ValueError(
                f"parallel.balance=measured evens out synchronous steps; update.rule="
                f"{update.rule} does not wait for every rank each step: set parallel.balance: "
                "even, or update.rule: sync"
            )
        if train.compile and (update.rule != "sync" or par.balance == "measured"):
            raise ValueError(
                "train.compile works with synchronous, evenly split steps only for now: set "
                "train.compile: false, or update.rule: sync and parallel.balance: even"
            )


SECTIONS = tuple(Config.model_fields)
OPEN_SECTIONS = frozenset({"model"})  # its keys depend on the model; validated there
