"""Layouts where every rank holds the whole model: DDP replicas and async workers.

- `DataParallel`: DDP all-reduces gradients during backward (the default, and what
  nothing sharded or split means), compressed as configured (compression.py); under
  local SGD and DiLoCo (updates.py) replicas step on their own and the rule averages
  them every H steps.
- `AsyncReplicas`: every rank computes gradients on its own replica and rank 0's
  parameter server applies them (async_ps.py, `update.rule: async`); its rule is the
  `ParameterServer`, which the loop drives like any other.
"""

from __future__ import annotations

import contextlib
import io
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from training.config import Config
from training.engine.async_ps import AsyncUpdates
from training.engine.comm import WireCounter
from training.engine.compression import GradientReducer
from training.engine.layouts import LayoutBase
from training.engine.state import OptimizerGroup, TrainState, clip_grad_norm
from training.engine.steps import LearningRate, StepInputs, StepResult
from training.engine.topology import Topology
from training.engine.updates import ParameterServer, ReplicaState, check_replicas, make_rule
from training.errors import ConfigError


class DataParallel(LayoutBase):
    """DDP: a full replica per rank, gradients all-reduced in buckets during backward by
    a communication hook that times them (what backward waits after its last bucket)
    and compresses them as configured. Under local SGD and DiLoCo, steps between syncs
    skip DDP and its all-reduce; the rule averages the replicas every H steps."""

    forward_is_collective = False
    replicated = True

    def __init__(self, model: nn.Module, topo: Topology, cfg: Config, loss_fn, autocast) -> None:
        update = cfg.update
        super().__init__(
            [model], topo, cfg, loss_fn, autocast, make_rule(model, topo.world_size, update)
        )
        device_ids = [topo.device.index] if topo.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=device_ids)
        self.reducer = GradientReducer(
            topo.world_size, update.grad_compression, update.powersgd_rank
        )
        self.reducer.names = {id(p): name for name, p in model.named_parameters()}
        self.reducer.shapes = {name: p.shape for name, p in model.named_parameters()}
        self.ddp.register_comm_hook(None, self.reducer.hook)
        self.wire = WireCounter()  # every byte of a step goes through it
        self.call = torch.compile(self.ddp) if cfg.train.compile else self.ddp
        self.same_replicas = True  # whether the resumed checkpoint had this many replicas

    def forward_backward(self, inputs: StepInputs) -> StepResult:
        sync, accum = self.rule.syncs_gradients(inputs.step), inputs.micro_batches
        # A local step runs the bare model: DDP's forward would still synchronise.
        module = self.call if sync else self.parts[0]
        loss_sum, sent = torch.zeros((), device=inputs.x.device), self.wire.bytes_sent
        scale = inputs.loss_scale / accum
        with self.wire.active():
            pieces = zip(inputs.x.chunk(accum), inputs.y.chunk(accum), strict=True)
            for i, (xm, ym) in enumerate(pieces):
                # Only the last micro-batch synchronises; the others accumulate locally.
                quiet = i < accum - 1 and sync
                with self.ddp.no_sync() if quiet else contextlib.nullcontext(), self.autocast():
                    loss = self.loss_fn(module(xm).float(), ym) * scale
                backward_started = time.perf_counter()
                loss.backward()
                loss_sum += loss.detach()
        wait = self._exposed_wait(backward_started) if sync else 0.0
        return StepResult(loss_sum, wait, bytes_sent=self.wire.bytes_sent - sent)

    def _exposed_wait(self, backward_started: float) -> float:
        """Seconds the last backward spent waiting for the other ranks after launching
        its last gradient bucket (communication not hidden behind compute)."""
        if self.topo.world_size == 1:
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
        self.same_replicas = check_replicas(self.rule, written, self.topo)
        state = self.state
        self.same_replicas = True  # what this job writes from now on is per this size
        return state


class AsyncReplicas(LayoutBase):
    """Asynchronous updates: each rank's replica computes gradients that rank 0's
    parameter server applies; between barriers the ranks do not wait for each other
    (see training.engine.async_ps). The server's optimizer steps with the job's learning
    rate schedule and clipping; the replicas' own step is the server's."""

    forward_is_collective = False
    replicated = True

    def __init__(
        self,
        model: nn.Module,
        topo: Topology,
        cfg: Config,
        loss_fn,
        autocast,
        schedule: LearningRate,
    ) -> None:
        optim, clip = cfg.optim, cfg.optim.grad_clip

        def before_server_step(version: int, _params) -> None:
            # The same schedule and clipping as a synchronous step.
            self.server.server_optimizer.set_lr(schedule(version))
            if clip:
                clip_grad_norm([self.server.server_model], clip, replicated=True)

        self.server = AsyncUpdates(
            model,
            lambda server_model: OptimizerGroup([server_model], optim),
            topo.rank,
            topo.world_size,
            cfg.update.max_staleness,
            before_server_step,
            timeout_s=cfg.runtime.collective_timeout_s,
        )
        super().__init__([model], topo, cfg, loss_fn, autocast, ParameterServer(self.server))
        if self.server.server_optimizer is not None:
            # The learning rate the loop logs is the server's (rank 0).
            self.optimizer = self.server.server_optimizer

    def forward_backward(self, inputs: StepInputs) -> StepResult:
        """One gradient on this rank's replica (the server applies it)."""
        model, accum = self.parts[0], inputs.micro_batches
        loss_sum = torch.zeros((), device=inputs.x.device)
        for xm, ym in zip(inputs.x.chunk(accum), inputs.y.chunk(accum), strict=True):
            with self.autocast():
                loss = self.loss_fn(model(xm).float(), ym) / accum
            loss.backward()
            loss_sum += loss.detach()
        return StepResult(loss_sum, 0.0)

    def optimizer_step(self, lr: float, grad_clip: float) -> bool:
        raise RuntimeError("an async job's optimizer steps on the parameter server")

    @property
    def state(self) -> AsyncState:
        return AsyncState(self.server, self.topo.is_main)

    def resume_state(self, train_state: dict) -> AsyncState:
        written = train_state.get("world_size")
        if written != self.topo.world_size:
            raise ConfigError(
                f"this async job was checkpointed with {written} workers, each at its own "
                f"place in the data; resume it with {self.topo.per_node(written)}, or start "
                "a new job"
            )
        return AsyncState(self.server, self.topo.is_main, loading=True)

    def close(self) -> None:
        self.server.close()


class AsyncState:
    """An async job's checkpoint state: the server's model and optimizer, and its own
    state (version, each worker's next gradient, the bucket) as one blob, all written by
    rank 0. Every rank reads the blob back (workers learn where they are from it)."""

    def __init__(self, ps: AsyncUpdates, is_main: bool, loading: bool = False) -> None:
        self.ps, self.is_main, self.loading = ps, is_main, loading

    def state_dict(self) -> dict:
        state: dict = {"async": io.BytesIO()} if self.loading else {}
        if self.is_main:  # only rank 0 writes the blob; every rank reads it back
            state.update(TrainState([self.ps.server_model], self.ps.server_optimizer).state_dict())
            if not self.loading:
                state["async"] = io.BytesIO()
                torch.save(self.ps.state_dict(), state["async"])
        return state

    def load_state_dict(self, state: dict) -> None:
        blob = state["async"]
        if isinstance(blob, io.BytesIO):
            blob.seek(0)
            # Numbers, lists and one tensor: weights_only refuses anything that runs code.
            blob = torch.load(blob, weights_only=True)
        if self.is_main:
            TrainState([self.ps.server_model], self.ps.server_optimizer).load_state_dict(state)
        self.ps.load_state_dict(blob)
