"""Update rules: how data-parallel replicas combine their work (`update.rule`).

Every rule is an `UpdateRule` (training.engine.steps): the loop asks it to `advance`
from one barrier to the next. The synchronous rules take every step in lockstep:

- sync: every step, gradients are averaged over the replicas before the optimizer
  steps (DDP); replicas stay identical. Each step waits for the slowest rank and pays a
  full gradient all-reduce.
- local_sgd (post-local SGD, Lin et al. 2018): after `sync_warmup_steps` synchronous
  steps, each replica steps on its own gradients and every `sync_every` (H) steps the
  replicas average their parameters: one all-reduce of the parameters per H steps, so
  1/H of sync's bytes. Optimizer states stay local.
- diloco (Douillard et al. 2023, arXiv 2311.08105): the same local phase with the inner
  optimizer (`optim.name`); every H steps the averaged change of the replicas since the last
  sync (the pseudo-gradient, anchor - mean of the replicas) is applied to the anchor by an
  outer SGD with Nesterov momentum (`outer_lr`, `outer_momentum`), and every replica
  restarts from the new anchor.
- async: workers push gradients to a parameter server on rank 0 and pull its
  parameters without waiting for each other (training.engine.async_ps); `advance` runs
  one segment of the server between barriers.

Between syncs replicas differ, so their checkpoints keep every replica's model and
optimizer (`ReplicaState`): a job resumes exactly, on the same number of replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from training.config import UpdateConfig
from training.engine.async_ps import AsyncUpdates
from training.engine.steps import Segment, StepWork
from training.engine.topology import Topology
from training.errors import ConfigError


class Rule:
    """What a rule does unless it says otherwise: every rank takes every step together
    (`advance` runs them through the loop's work), gradients are averaged each step,
    nothing happens between steps, and there is no state of its own."""

    name = "sync"
    local = False  # whether replicas may differ between syncs
    lockstep = True  # every rank takes every step together (so may stop at any step)

    def advance(self, start: int, until: int, work: StepWork) -> Segment:
        return Segment(until, [work.step(n) for n in range(start, until)])

    def syncs_gradients(self, step: int) -> bool:
        return True

    def after_step(self, done: int) -> None:
        pass

    def finish(self, done: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class SyncEveryStep(Rule):
    """sync: DDP averages gradients in every backward; nothing to do between steps."""


class LocalSGD(SyncEveryStep):
    name = "local_sgd"
    local = True

    def __init__(self, model: nn.Module, world_size: int, every: int, warmup: int) -> None:
        self.params = [p for p in model.parameters()]
        self.world_size, self.every, self.warmup = world_size, every, warmup

    def syncs_gradients(self, step: int) -> bool:
        return step < self.warmup

    def _due(self, done: int) -> bool:
        return done > self.warmup and (done - self.warmup) % self.every == 0

    def after_step(self, done: int) -> None:
        if self._due(done):
            self._sync()

    def finish(self, done: int) -> None:
        # Local steps since the last sync are averaged in too: the job's model is one.
        if done > self.warmup and (done - self.warmup) % self.every != 0:
            self._sync()

    def _average(self) -> torch.Tensor:
        """The mean of the replicas' parameters, flat (one all-reduce)."""
        flat = nn.utils.parameters_to_vector(p.detach() for p in self.params)
        if self.world_size > 1:
            dist.all_reduce(flat)
            flat.div_(self.world_size)
        if flat.is_cuda:  # the sync's time is the loop's sync wait, not the next compute
            torch.cuda.synchronize(flat.device)
        return flat

    def _sync(self) -> None:
        with torch.no_grad():
            nn.utils.vector_to_parameters(self._average(), self.params)


class DiLoCo(LocalSGD):
    name = "diloco"

    def __init__(self, model: nn.Module, world_size: int, update: UpdateConfig) -> None:
        super().__init__(model, world_size, update.sync_every, update.sync_warmup_steps)
        # The anchor: the replicas' common starting point of the current local phase.
        self.anchor = [nn.Parameter(p.detach().clone()) for p in self.params]
        momentum = update.outer_momentum
        self.outer = torch.optim.SGD(
            self.anchor, lr=update.outer_lr, momentum=momentum, nesterov=momentum > 0
        )
        self.outer_steps = 0
        self.names = [name for name, _ in model.named_parameters()]

    def after_step(self, done: int) -> None:
        if done == self.warmup and done > 0:  # warmup over: the local phase starts here
            with torch.no_grad():
                for a, p in zip(self.anchor, self.params, strict=True):
                    a.copy_(p)
        super().after_step(done)

    def _sync(self) -> None:
        """Outer step: the anchor moves by the replicas' mean change (pseudo-gradient)."""
        with torch.no_grad():
            mean = self._average()
            flat_anchor = nn.utils.parameters_to_vector(self.anchor)
            delta = flat_anchor - mean
            offset = 0
            for a in self.anchor:
                a.grad = delta[offset : offset + a.numel()].view_as(a).clone()
                offset += a.numel()
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            self.outer_steps += 1
            for a, p in zip(self.anchor, self.params, strict=True):
                p.copy_(a)

    def state_dict(self) -> dict:
        momentum = {}
        for name, a in zip(self.names, self.anchor, strict=True):
            buf = self.outer.state.get(a, {}).get("momentum_buffer")
            momentum[name] = buf if buf is not None else torch.zeros_like(a)
        anchor = {name: a.detach() for name, a in zip(self.names, self.anchor, strict=True)}
        steps = torch.tensor(self.outer_steps)
        return {"anchor": anchor, "outer_momentum": momentum, "outer_steps": steps}

    def load_state_dict(self, state: dict) -> None:
        self.outer_steps = int(state["outer_steps"])
        with torch.no_grad():
            for name, a in zip(self.names, self.anchor, strict=True):
                a.copy_(state["anchor"][name])
                if self.outer_steps and self.outer.param_groups[0]["momentum"] > 0:
                    self.outer.state[a]["momentum_buffer"] = state["outer_momentum"][name].clone()


class ParameterServer(Rule):
    """async: between barriers, every rank computes gradients on its own and rank 0's
    parameter server applies them (training.engine.async_ps). The replicas hold the
    parameters of the same server step at every barrier; the server's model is the
    job's model."""

    name = "async"
    local = False  # the checkpoint holds the server's model, not each replica's
    lockstep = False  # ranks meet at barriers only

    def __init__(self, server: AsyncUpdates) -> None:
        self.server = server

    def advance(self, start: int, until: int, work: StepWork) -> Segment:
        waited, sent = self.server.wait_seconds, self.server.bytes_sent
        segment = self.server.run_segment(until, work.gradient)
        metrics = {
            "async_staleness_max": float(segment.staleness_max),
            "async_staleness_mean": segment.staleness_mean,
            # Gradients each worker has computed in the job: a fast one computes more.
            **{f"async_gradients/rank{w}": float(n) for w, n in enumerate(segment.next_gradient)},
        }
        return Segment(
            segment.version,
            list(segment.losses),
            metrics,
            sync_wait=self.server.wait_seconds - waited,
            bytes_sent=self.server.bytes_sent - sent,
        )

    def syncs_gradients(self, step: int) -> bool:
        return False  # workers push gradients to the server instead


def make_rule(model: nn.Module, world_size: int, update: UpdateConfig) -> SyncEveryStep:
    """The synchronous rule of `update` for a replica (async: see ParameterServer)."""
    if update.rule == "local_sgd":
        return LocalSGD(model, world_size, update.sync_every, update.sync_warmup_steps)
    if update.rule == "diloco":
        return DiLoCo(model, world_size, update)
    return SyncEveryStep()


class ReplicaState:
    """A data-parallel rank's checkpoint state, as a Stateful for DCP.

    "model" and "optim" are the replica's (identical on every rank under sync); where
    replicas differ between syncs, each rank's model and optimizer go under "replica<r>"
    instead (the final checkpoint, taken after the last sync, has them all equal:
    `model_key` names where the job's model is read from), and the rule's own state
    (DiLoCo's anchor and outer momentum) under "update". Per-rank gradient-compression
    state (PowerSGD's error feedback) goes under "compression<r>". The per-rank parts load
    only on as many replicas as wrote them (`same_size`).
    """

    def __init__(self, inner, rule, reducer, rank: int, replicas: int, same_size=True) -> None:
        self.inner, self.rule, self.reducer = inner, rule, reducer
        self.rank, self.replicas, self.same_size = rank, replicas, same_size

    def state_dict(self) -> dict:
        state = self.inner.state_dict()
        if self.rule.local:
            state = {f"replica{self.rank}": state, "update": self.rule.state_dict()}
        compression = self.reducer.state_dict() if self.same_size else {}
        if compression:
            state[f"compression{self.rank}"] = compression
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.rule.local:
            self.inner.load_state_dict(state[f"replica{self.rank}"])
            self.rule.load_state_dict(state["update"])
        else:
            self.inner.load_state_dict(state)
        if f"compression{self.rank}" in state:
            self.reducer.load_state_dict(state[f"compression{self.rank}"])


def model_key(train_state: dict) -> str:
    """Where a checkpoint keeps the job's model: "model", or the first replica's."""
    return "replica0.model" if train_state.get("replicas_differ") else "model"


def check_replicas(rule, written: int | None, topo: Topology) -> bool:
    """Whether a checkpoint written by `written` data-parallel ranks carries per-rank state
    for this job's replicas; raises where the rule cannot resume without it."""
    same = written is None or written == topo.dp_size
    if not same and rule.local:
        raise ConfigError(
            f"this {rule.name} job was checkpointed with {written} data-parallel replicas, "
            f"each with its own weights between syncs; resume it on {written} workers "
            f"({topo.per_node(written)}), not {topo.dp_size}, or start a new job"
        )
    return same
