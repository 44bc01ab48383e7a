"""Update rules: how data-parallel replicas combine their work (`parallel.update`).

- sync: every step, gradients are averaged over the replicas before the optimizer
  steps (DDP); replicas stay identical. Each step waits for the slowest rank and pays a
  full gradient all-reduce.
- local_sgd (post-local SGD, Lin et al. 2018): after `sync_warmup_steps` synchronous
  steps, each replica steps on its own gradients and every `sync_every` (H) steps the
  replicas average their parameters: one all-reduce of the parameters per H steps, so
  1/H of sync's bytes. Optimizer states stay local.
- diloco (Douillard et al. 2023, arXiv 2311.08105): the same local phase with the inner
  optimizer (AdamW); every H steps the averaged change of the replicas since the last
  sync (the pseudo-gradient, anchor - mean of the replicas) is applied to the anchor by an
  outer SGD with Nesterov momentum (`outer_lr`, `outer_momentum`), and every replica
  restarts from the new anchor.
- async: a parameter server (training.engine.async_ps), not a rule of this module.

Between syncs replicas differ, so their checkpoints keep every replica's model and
optimizer (`ReplicaState`): a job resumes exactly, on the same number of replicas.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from training.errors import ConfigError


class SyncEveryStep:
    """sync: DDP averages gradients in every backward; nothing to do between steps."""

    name = "sync"
    local = False  # whether replicas may differ between syncs

    def syncs_gradients(self, step: int) -> bool:
        """Whether step `step` (0-based) all-reduces its gradients."""
        return True

    def after_step(self, done: int) -> float:
        """Called after the optimizer step with `done` steps taken; returns the seconds
        spent synchronising (waiting for other ranks included)."""
        return 0.0

    def finish(self, done: int) -> float:
        """The end of training: leave every replica equal to the job's model."""
        return 0.0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


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

    def after_step(self, done: int) -> float:
        return self._sync() if self._due(done) else 0.0

    def finish(self, done: int) -> float:
        # Local steps since the last sync are averaged in too: the job's model is one.
        pending = done > self.warmup and (done - self.warmup) % self.every != 0
        return self._sync() if pending else 0.0

    def _average(self) -> torch.Tensor:
        """The mean of the replicas' parameters, flat (one all-reduce)."""
        flat = nn.utils.parameters_to_vector(p.detach() for p in self.params)
        if self.world_size > 1:
            dist.all_reduce(flat)
            flat.div_(self.world_size)
        if flat.is_cuda:  # the sync's time is the loop's sync wait, not the next compute
            torch.cuda.synchronize(flat.device)
        return flat

    def _sync(self) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            nn.utils.vector_to_parameters(self._average(), self.params)
        return time.perf_counter() - started


class DiLoCo(LocalSGD):
    name = "diloco"

    def __init__(self, model: nn.Module, world_size: int, every: int, warmup: int, par) -> None:
        super().__init__(model, world_size, every, warmup)
        # The anchor: the replicas' common starting point of the current local phase.
        self.anchor = [nn.Parameter(p.detach().clone()) for p in self.params]
        momentum = par.outer_momentum
        self.outer = torch.optim.SGD(
            self.anchor, lr=par.outer_lr, momentum=momentum, nesterov=momentum > 0
        )
        self.outer_steps = 0
        self.names = [name for name, _ in model.named_parameters()]

    def after_step(self, done: int) -> float:
        if done == self.warmup and done > 0:  # warmup over: the local phase starts here
            with torch.no_grad():
                for a, p in zip(self.anchor, self.params, strict=True):
                    a.copy_(p)
        return super().after_step(done)

    def _sync(self) -> float:
        """Outer step: the anchor moves by the replicas' mean change (pseudo-gradient)."""
        started = time.perf_counter()
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
        return time.perf_counter() - started

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


def make_rule(model: nn.Module, world_size: int, par) -> SyncEveryStep:
    if par.update == "local_sgd":
        return LocalSGD(model, world_size, par.sync_every, par.sync_warmup_steps)
    if par.update == "diloco":
        return DiLoCo(model, world_size, par.sync_every, par.sync_warmup_steps, par)
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


def check_replicas(rule, written: int | None, replicas: int) -> bool:
    """Whether a checkpoint written by `written` data-parallel ranks carries per-rank state
    for this job's `replicas`; raises where the rule cannot resume without it."""
    same = written is None or written == replicas
    if not same and rule.local:
        raise ConfigError(
            f"this {rule.name} job was checkpointed with {written} data-parallel replicas, "
            f"each with its own weights between syncs; resume it on {written} "
            f"(runtime.world_size={written}), not {replicas}, or start a new job"
        )
    return same
