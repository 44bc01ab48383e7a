"""What every layout shares, and the layouts that split the model across ranks.

`LayoutBase` holds this rank's model parts and their optimizers and implements the
`Layout` seam (training.engine.steps) around them: the optimizer step with clipping and
the learning rate, the update rule's syncs, the checkpoint state. The layouts here are:

- `Sharded`: tensor parallelism (tp), then activation checkpointing, then FSDP2 over the
  data-parallel ranks (dp_shard; HSDP when dp_replicate > 1 too). Each rank holds a
  shard of the parameters, gradients and optimizer state.
- `Pipelined`: the model cut into stages (pp); each stage may itself be tensor-parallel
  and sharded as above.

Whole replicas (DDP, the parameter server's workers) are in training.engine.replicas.
The order, pipeline split -> tensor plan -> activation checkpointing -> FSDP, is the
one that composes: each step wraps what the previous produced.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from training.config import Config, ParallelConfig
from training.engine.comm import CommMeter
from training.engine.nonfinite import step_is_finite
from training.engine.pipeline import Pipeline, cut_stage, stage_indices
from training.engine.sharding import (
    apply_activation_checkpointing,
    apply_fsdp,
    apply_tensor_parallel,
    average_gradients,
)
from training.engine.state import OptimizerGroup, TrainState, clip_grad_norm
from training.engine.steps import LossFn, StepInputs, StepResult, UpdateRule
from training.engine.topology import Topology
from training.engine.updates import SyncEveryStep

Autocast = Callable[[], contextlib.AbstractContextManager]


class LayoutBase:
    """This rank's model parts, their optimizers, and the update rule that combines the
    replicas' work (synchronous unless a layout says otherwise)."""

    # Whether running the whole model takes every rank (its weights are spread over them).
    forward_is_collective = True
    # Whether every rank holds every gradient whole after backward (DDP's all-reduce).
    replicated = False
    # Ids of parameters only this rank holds, whole (sharded embedding rows).
    held_alone: frozenset[int] = frozenset()

    def __init__(
        self,
        parts: list[nn.Module],
        topo: Topology,
        cfg: Config,
        loss_fn: LossFn,
        autocast: Autocast,
        rule: UpdateRule | None = None,
    ) -> None:
        self.parts, self.topo, self.loss_fn, self.autocast = parts, topo, loss_fn, autocast
        self.optimizer = OptimizerGroup(parts, cfg.optim)
        self.rule: UpdateRule = rule or SyncEveryStep()

    @property
    def whole(self) -> nn.Module | None:
        """The whole model (None when pipelined): a replica under DDP, callable by every
        rank together when its weights are sharded (`forward_is_collective`)."""
        return self.parts[0]

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def state(self):
        return TrainState(self.parts, self.optimizer)

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.whole(x)

    def optimizer_step(self, lr: float, grad_clip: float) -> bool:
        self.optimizer.set_lr(lr)
        # The norm is taken even without clipping: it is where a non-finite gradient shows.
        limit = grad_clip or math.inf
        norm = clip_grad_norm(
            self.parts, limit, self.topo.shape.pp, self.replicated, self.held_alone
        )
        stepped = step_is_finite(norm)
        if stepped:  # else the weights and the optimizer's state stay as they were
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stepped

    def after_step(self, done: int) -> float:
        self.rule.after_step(done)
        return 0.0

    def finish(self, done: int) -> float:
        self.rule.finish(done)
        return 0.0

    def checkpoint_info(self) -> dict:
        return {}

    def resume_state(self, train_state: dict):
        return self.state

    def close(self) -> None:
        """Release what the layout holds beyond the process group (threads, groups)."""


class _Metered(LayoutBase):
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

    def __init__(self, model: nn.Module, topo: Topology, cfg: Config, loss_fn, autocast) -> None:
        shape_model(model, topo, cfg.parallel, pipelined=False)
        super().__init__([model], topo, cfg, loss_fn, autocast)

    def forward_backward(self, inputs: StepInputs) -> StepResult:
        model, fsdp, accum = self.parts[0], self.topo.shape.dp_shard > 1, inputs.micro_batches
        loss_sum = torch.zeros((), device=inputs.x.device)
        with self._metered(inputs.measure_comm):
            pieces = zip(inputs.x.chunk(accum), inputs.y.chunk(accum), strict=True)
            for i, (xm, ym) in enumerate(pieces):
                if fsdp:  # reduce-scatter only after the last micro-batch
                    model.set_requires_gradient_sync(i == accum - 1)
                with self.autocast():
                    loss = self.loss_fn(model(xm).float(), ym) / accum
                loss.backward()
                loss_sum += loss.detach()
            replicate_gradients(self.parts, self.topo)
        return StepResult(loss_sum, self.comm_seconds, bytes_sent=self.comm_bytes)


class Pipelined(_Metered):
    """Pipeline stages (each possibly tensor-parallel and sharded) run by a schedule."""

    def __init__(
        self, build: Callable[[], nn.Module], topo: Topology, cfg: Config, loss_fn, autocast
    ) -> None:
        stages = cfg.pipeline_stages(topo.shape.as_dict())
        indices = stage_indices(topo.coordinate("pp"), topo.shape.pp, stages)
        parts = []
        for index in indices:
            part = cut_stage(build(), index, stages)
            shape_model(part, topo, cfg.parallel, pipelined=True)
            parts.append(part)
        super().__init__(parts, topo, cfg, loss_fn, autocast)
        par = cfg.parallel
        self.pipeline = Pipeline(
            self.parts,
            indices,
            stages,
            par.pp_schedule,
            par.pp_microbatches,
            lambda output, target: loss_fn(output.float(), target),
            topo.device_mesh["pp"].get_group(),
            topo.device,
        )

    @property
    def whole(self) -> None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.pipeline.forward(x)

    def forward_backward(self, inputs: StepInputs) -> StepResult:
        with self._metered(inputs.measure_comm), self.autocast():
            loss, wall, compute = self.pipeline.step(inputs.x, inputs.y)
        started = time.perf_counter()
        replicate_gradients(self.parts, self.topo)
        averaged = time.perf_counter() - started
        # Idle time in the schedule is the bubble; collectives inside the stages'
        # compute (tp, fsdp) are sync wait, as sampled.
        inner = min(self.comm_seconds, compute)
        bubble = max(0.0, wall - compute)
        loss = loss if loss is not None else torch.zeros((), device=inputs.x.device)
        return StepResult(loss, inner + averaged, bubble, self.comm_bytes)


def shape_model(model: nn.Module, topo: Topology, par: ParallelConfig, pipelined: bool) -> None:
    """Tensor plan, activation checkpointing, then FSDP2, on one model part (built on
    the host), in place; its parameters end on this rank's device. Under FSDP only the
    rank's shards ever reach the device, so a model need not fit on one."""
    shape, mesh = topo.shape, topo.device_mesh
    if shape.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if par.activation_checkpointing == "block":
        apply_activation_checkpointing(model)
    if shape.dp_shard > 1:
        param_dtype = par.param_dtype
        if param_dtype == "auto":
            param_dtype = "bf16" if topo.device.type == "cuda" else "fp32"
        dims = ("dp_replicate", "dp_shard") if shape.dp_replicate > 1 else ("dp_shard",)
        # Under a pipeline each micro-batch would all-gather again: keep the blocks
        # gathered from forward to backward instead.
        apply_fsdp(model, mesh[dims], param_dtype, par.reduce_dtype, not pipelined)
    else:  # FSDP moved its shards; otherwise move what the tensor plan left whole
        model.to(topo.device)


def replicate_gradients(parts: list[nn.Module], topo: Topology) -> None:
    """Replicas not joined by FSDP (dp_replicate without dp_shard) average here."""
    shape = topo.shape
    if shape.dp_replicate > 1 and shape.dp_shard == 1:
        group = topo.device_mesh["dp_replicate"].get_group()
        average_gradients(parts, group, shape.dp_replicate)
