"""Parallelism is applied to the model here and nowhere else.

`parallelize` reads the job's mesh (parallel section) and returns a `Parallelized`
model: this rank's model parts with their optimizers, and how to run one step's forward
and backward on this rank's share of a batch. Three layouts:

- `DataParallel`: every rank holds the whole model; DDP all-reduces gradients during
  backward (the default, and what nothing sharded or split means), compressed as
  configured (compression.py), or replicas step locally and sync by an update rule
  (updates.py: local SGD, DiLoCo).
- `AsyncReplicas`: every rank holds the whole model and works on its own; rank 0 also
  hosts a parameter server that applies their gradients (async_ps.py, `update: async`).
- `Sharded`: tensor parallelism (tp), then activation checkpointing, then FSDP2 over the
  data-parallel ranks (dp_shard; HSDP when dp_replicate > 1 too). Each rank holds a
  shard of the parameters, gradients and optimizer state.
- `Pipelined`: the model cut into stages (pp); each stage may itself be tensor-parallel
  and sharded as above.

The order, pipeline split -> tensor plan -> activation checkpointing -> FSDP, is the
one that composes: each step wraps what the previous produced.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from training.engine.comm import CommMeter, WireCounter
from training.engine.compression import GradientReducer
from training.engine.pipeline import Pipeline, cut_stage, stage_indices
from training.engine.sharding import (
    apply_activation_checkpointing,
    apply_fsdp,
    apply_tensor_parallel,
    average_gradients,
)
from training.engine.state import OptimizerGroup, TrainState, clip_grad_norm
from training.engine.topology import Topology
from training.engine.updates import ReplicaState, check_replicas, make_rule
from training.errors import ConfigError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's mean loss (zero where the rank computes none)
    sync_wait: float  # seconds waiting for other ranks in collectives
    bubble: float = 0.0  # seconds a pipeline stage waited for its neighbours
    bytes_sent: float = 0.0  # bytes this rank sent (counted; sampled where metered)


class Parallelized:
    """This rank's model parts, their optimizers, and one step's forward and backward."""

    parts: list[nn.Module]
    optimizer: OptimizerGroup
    topo: Topology
    # Whether running the whole model takes every rank (its weights are spread over them).
    forward_is_collective = True
    # Whether every rank holds every gradient whole after backward (DDP's all-reduce).
    replicated = False

    @property
    def whole(self) -> nn.Module | None:
        """The whole model (None when pipelined): a replica under DDP, callable by every
        rank together when its weights are sharded (`forward_is_collective`)."""
        return self.parts[0]

    @property
    def state(self) -> TrainState:
        return TrainState(self.parts, self.optimizer)

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Validation: the whole model's output (None on ranks that produce none)."""
        return self.whole(x)

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_grad_norm(self.parts, max_norm, self.topo.mesh.get("pp", 1), self.replicated)

    def forward_backward(
        self,
        x,
        y,
        loss_fn: LossFn,
        accum: int,
        autocast,
        measure_comm: bool,
        step: int = 0,
        loss_scale: float = 1.0,
    ) -> StepResult:
        """One step's forward and backward on this rank's share; `loss_scale` weights the
        share's mean loss (uneven shares: see training.engine.balance)."""
        raise NotImplementedError

    def after_step(self, done: int) -> float:
        """After the optimizer step, with `done` steps taken: the update rule's sync, if
        one is due. Returns the bytes this rank sent for it."""
        return 0.0

    def finish(self, done: int) -> float:
        """Before the final checkpoint: replicas become the job's one model."""
        return 0.0

    def checkpoint_info(self) -> dict:
        """What a checkpoint's train state records about how the state was laid out."""
        return {}

    def resume_state(self, train_state: dict):
        """The state to load a checkpoint written with `train_state` into."""
        return self.state

    # Whether steps are synchronous (one loop step per optimizer step on every rank).
    asynchronous = False

    def close(self) -> None:
        """Release what the layout holds beyond the process group (threads, groups)."""


class DataParallel(Parallelized):
    """DDP: a full replica per rank, gradients all-reduced in buckets during backward by
    a communication hook that times them (what backward waits after its last bucket)
    and compresses them as configured. Under local SGD and DiLoCo, steps between syncs
    skip DDP and its all-reduce; the rule averages the replicas every H steps."""

    forward_is_collective = False
    replicated = True

    def __init__(self, model: nn.Module, topo: Topology, compile_model: bool, optim, par) -> None:
        device_ids = [topo.device.index] if topo.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=device_ids)
        self.reducer = GradientReducer(topo.world_size, par.grad_compression, par.powersgd_rank)
        self.reducer.names = {id(p): name for name, p in model.named_parameters()}
        self.reducer.shapes = {name: p.shape for name, p in model.named_parameters()}
        self.ddp.register_comm_hook(None, self.reducer.hook)
        self.rule = make_rule(model, topo.world_size, par)
        self.wire = WireCounter()  # every byte of a step goes through it
        self.call = torch.compile(self.ddp) if compile_model else self.ddp
        self.parts, self.world_size, self.topo = [model], topo.world_size, topo
        self.optimizer = OptimizerGroup(self.parts, optim.lr, optim.weight_decay)
        self.same_replicas = True  # whether the resumed checkpoint had this many replicas

    def forward_backward(
        self, x, y, loss_fn, accum, autocast, measure_comm, step=0, loss_scale=1.0
    ) -> StepResult:
        sync = self.rule.syncs_gradients(step)
        # A local step runs the bare model: DDP's forward would still synchronise.
        module = self.call if sync else self.parts[0]
        loss_sum, sent = torch.zeros((), device=x.device), self.wire.bytes_sent
        with self.wire.active():
            for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
                last = i == accum - 1
                # Only the last micro-batch synchronises; the others accumulate locally.
                quiet = not last and sync
                with self.ddp.no_sync() if quiet else contextlib.nullcontext(), autocast():
                    loss = loss_fn(module(xm).float(), ym) * (loss_scale / accum)
                backward_started = time.perf_counter()
                loss.backward()
                loss_sum += loss.detach()
        wait = self._exposed_wait(backward_started) if sync else 0.0
        return StepResult(loss_sum, wait, bytes_sent=self.wire.bytes_sent - sent)

    def _exposed_wait(self, backward_started: float) -> float:
        """Seconds the last backward spent waiting for the other ranks after launching
        its last gradient bucket (communication not hidden behind compute)."""
        if self.world_size == 1:
            return 0.0
        return max(0.0, time.perf_counter() - max(self.reducer.last_launch, backward_started))

    def after_step(self, done: int) -> float:
        return self._counted(self.rule.after_step, done)

    def finish(self, done: int) -> float:
        return self._counted(self.rule.finish, done)

    def _counted(self, sync, done: int) -> float:
        """Run an update rule's sync; return the bytes it sent."""
        sent = self.wire.bytes_sent
        with self.wire.active():
            sync(done)
        return self.wire.bytes_sent - sent

    @property
    def state(self) -> ReplicaState:
        inner = TrainState(self.parts, self.optimizer)
        dp = self.topo.dp_rank, self.topo.dp_size
        return ReplicaState(inner, self.rule, self.reducer, *dp, same_size=self.same_replicas)

    def checkpoint_info(self) -> dict:
        return {"replicas": self.topo.dp_size, "replicas_differ": self.rule.local}

    def resume_state(self, train_state: dict) -> ReplicaState:
        written = train_state.get("replicas")
        self.same_replicas = check_replicas(self.rule, written, self.topo.dp_size)
        state = self.state
        self.same_replicas = True  # what this job writes from now on is per this size
        return state


class _Metered(Parallelized):
    """Layouts whose communication happens inside forward and backward (all-gathers,
    reduce-scatters, tensor-parallel all-reduces): its time is counted by a CommMeter on
    sampled steps, and the latest sample stands for the steps in between."""

    comm_seconds = 0.0
    comm_bytes = 0.0

    @contextlib.contextmanager
    def _metered(self, measure: bool):
        if not measure:
            yield
            return
        with CommMeter() as meter:
            yield
        self.comm_seconds, self.comm_bytes = meter.seconds, meter.bytes_sent


class Sharded(_Metered):
    """Tensor parallelism and/or FSDP2 (HSDP) over one model."""

    def __init__(self, model: nn.Module, mesh, topo: Topology, par, optim) -> None:
        shape_model(model, mesh, topo, par, pipelined=False)
        self.parts, self.mesh, self.topo = [model], mesh, topo
        self.optimizer = OptimizerGroup(self.parts, optim.lr, optim.weight_decay)

    def forward_backward(
        self, x, y, loss_fn, accum, autocast, measure_comm, step=0, loss_scale=1.0
    ) -> StepResult:
        model, fsdp = self.parts[0], self.topo.mesh["dp_shard"] > 1
        loss_sum = torch.zeros((), device=x.device)
        with self._metered(measure_comm):
            for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
                if fsdp:  # reduce-scatter only after the last micro-batch
                    model.set_requires_gradient_sync(i == accum - 1)
                with autocast():
                    loss = loss_fn(model(xm).float(), ym) / accum
                loss.backward()
                loss_sum += loss.detach()
            replicate_gradients(self.parts, self.mesh, self.topo)
        return StepResult(loss_sum, self.comm_seconds, bytes_sent=self.comm_bytes)


class Pipelined(_Metered):
    """Pipeline stages (each possibly tensor-parallel and sharded) run by a schedule."""

    def __init__(self, build, mesh, topo: Topology, par, optim, stages: int, loss_fn) -> None:
        pp_rank = topo.coordinate("pp")
        indices = stage_indices(pp_rank, topo.mesh["pp"], stages)
        self.parts = []
        for index in indices:
            part = cut_stage(build(), index, stages)
            shape_model(part, mesh, topo, par, pipelined=True)
            self.parts.append(part)
        self.mesh, self.topo = mesh, topo
        self.optimizer = OptimizerGroup(self.parts, optim.lr, optim.weight_decay)
        self.pipeline = Pipeline(
            self.parts,
            indices,
            stages,
            par.pp_schedule,
            par.pp_microbatches,
            lambda output, target: loss_fn(output.float(), target),
            mesh["pp"].get_group(),
            topo.device,
        )

    @property
    def whole(self) -> None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.pipeline.forward(x)

    def forward_backward(
        self, x, y, loss_fn, accum, autocast, measure_comm, step=0, loss_scale=1.0
    ) -> StepResult:
        with self._metered(measure_comm), autocast():
            loss, wall, compute = self.pipeline.step(x, y)
        started = time.perf_counter()
        replicate_gradients(self.parts, self.mesh, self.topo)
        averaged = time.perf_counter() - started
        # Idle time in the schedule is the bubble; collectives inside the stages'
        # compute (tp, fsdp) are sync wait, as sampled.
        inner = min(self.comm_seconds, compute)
        bubble = max(0.0, wall - compute)
        loss = loss if loss is not None else torch.zeros((), device=x.device)
        return StepResult(loss, inner + averaged, bubble, self.comm_bytes)


class AsyncReplicas(Parallelized):
    """Asynchronous updates: workers push gradients to a parameter server on rank 0 and
    pull its parameters, between barriers (see training.engine.async_ps). The loop runs
    segments (training.engine.async_loop) instead of synchronous steps."""

    forward_is_collective = False
    replicated = True
    asynchronous = True

    def __init__(self, model: nn.Module, topo: Topology, cfg, before_step) -> None:
        from training.engine.async_ps import AsyncUpdates

        optim, self.topo, self.parts = cfg.optim, topo, [model]

        def make_optimizer(server_model: nn.Module) -> OptimizerGroup:
            return OptimizerGroup([server_model], optim.lr, optim.weight_decay)

        self.ps = AsyncUpdates(
            model,
            make_optimizer,
            topo.rank,
            topo.world_size,
            cfg.parallel.max_staleness,
            before_step,
            timeout_s=cfg.runtime.collective_timeout_s,
        )
        # The loop reads the learning rate from here: the server's on rank 0.
        self.optimizer = self.ps.server_optimizer or OptimizerGroup(self.parts, optim.lr, 0.0)

    @property
    def state(self) -> AsyncState:
        return AsyncState(self.ps, self.topo.is_main)

    def resume_state(self, train_state: dict) -> AsyncState:
        if train_state.get("world_size") != self.topo.world_size:
            raise ConfigError(
                f"this async job was checkpointed with {train_state.get('world_size')} "
                f"workers, each at its own place in the data; resume it with "
                f"runtime.world_size={train_state.get('world_size')}, or start a new job"
            )
        return AsyncState(self.ps, self.topo.is_main, loading=True)

    def close(self) -> None:
        self.ps.close()


class AsyncState:
    """An async job's checkpoint state: the server's model and optimizer, and its own
    state (version, each worker's next gradient, the bucket) as one blob, all written by
    rank 0. Every rank reads the blob back (workers learn where they are from it)."""

    def __init__(self, ps, is_main: bool, loading: bool = False) -> None:
        self.ps, self.is_main, self.loading = ps, is_main, loading

    def state_dict(self) -> dict:
        import io

        state: dict = {"async": io.BytesIO()} if self.loading else {}
        if self.is_main:  # only rank 0 writes the blob; every rank reads it back
            state.update(TrainState([self.ps.server_model], self.ps.server_optimizer).state_dict())
            if not self.loading:
                state["async"] = io.BytesIO()
                torch.save(self.ps.state_dict(), state["async"])
        return state

    def load_state_dict(self, state: dict) -> None:
        import io

        blob = state["async"]
        if isinstance(blob, io.BytesIO):
            blob.seek(0)
            blob = torch.load(blob, weights_only=False)  # written by this class
        if self.is_main:
            TrainState([self.ps.server_model], self.ps.server_optimizer).load_state_dict(state)
        self.ps.load_state_dict(blob)


def shape_model(model: nn.Module, mesh, topo: Topology, par, pipelined: bool) -> None:
    """Tensor plan, activation checkpointing, then FSDP2, on one model part (built on
    the host), in place; its parameters end on this rank's device. Under FSDP only the
    rank's shards ever reach the device, so a model need not fit on one."""
    if topo.mesh["tp"] > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if par.activation_checkpointing == "block":
        apply_activation_checkpointing(model)
    if topo.mesh["dp_shard"] > 1:
        param_dtype = par.param_dtype
        if param_dtype == "auto":
            param_dtype = "bf16" if topo.device.type == "cuda" else "fp32"
        dims = ("dp_replicate", "dp_shard") if topo.mesh["dp_replicate"] > 1 else ("dp_shard",)
        # Under a pipeline each micro-batch would all-gather again: keep the blocks
        # gathered from forward to backward instead.
        apply_fsdp(model, mesh[dims], param_dtype, par.reduce_dtype, not pipelined)
    else:  # FSDP moved its shards; otherwise move what the tensor plan left whole
        model.to(topo.device)


def replicate_gradients(parts: list[nn.Module], mesh, topo: Topology) -> None:
    """Replicas not joined by FSDP (dp_replicate without dp_shard) average here."""
    if topo.mesh["dp_replicate"] > 1 and topo.mesh["dp_shard"] == 1:
        average_gradients(parts, mesh["dp_replicate"].get_group(), topo.mesh["dp_replicate"])


def build_mesh(topo: Topology):
    from torch.distributed.device_mesh import init_device_mesh

    from training.config import MESH_DIMS

    return init_device_mesh(
        topo.device.type,
        tuple(topo.mesh[d] for d in MESH_DIMS),
        mesh_dim_names=MESH_DIMS,
    )


def is_plain_data_parallel(mesh: dict[str, int]) -> bool:
    return mesh["dp_shard"] == 1 and mesh["tp"] == 1 and mesh["pp"] == 1


def parallelize(
    build: Callable[[], nn.Module], cfg, topo: Topology, loss_fn, before_step=None
) -> Parallelized:
    """This rank's share of the model for the job's layout. `build()` returns a freshly
    initialised whole model, the same on every rank (seeded). `before_step(version,
    params)`: what an async server does before each of its optimizer steps."""
    if cfg.parallel.update == "async":
        return AsyncReplicas(build().to(topo.device), topo, cfg, before_step)
    if is_plain_data_parallel(topo.mesh):
        model = build().to(topo.device)
        return DataParallel(model, topo, cfg.train.compile, cfg.optim, cfg.parallel)
    mesh = build_mesh(topo)
    if topo.mesh["pp"] > 1:
        stages = cfg.pipeline_stages(topo.mesh)
        return Pipelined(build, mesh, topo, cfg.parallel, cfg.optim, stages, loss_fn)
    return Sharded(build(), mesh, topo, cfg.parallel, cfg.optim)
