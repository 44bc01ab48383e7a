"""The training state of one rank, in a form every layout shares.

A rank holds one or more model parts (the whole model, or its pipeline stages), each
with its own optimizer (`optim.name`: AdamW, or SGD with momentum). `TrainState` is what
distributed checkpoints save and load: its state dict is keyed by the whole model's
parameter names (with flattened optimizer state), whatever the layout, so a checkpoint
written under one layout loads under any other (torch.distributed.checkpoint reshards
by name).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from training.config import OptimConfig

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def make_optimizer(params, optim: OptimConfig) -> torch.optim.Optimizer:
    """`optim.name`'s optimizer over `params`."""
    params = list(params)
    foreach = _foreach_choice(params)
    if optim.name == "sgd":
        momentum = optim.momentum
        return torch.optim.SGD(
            params,
            lr=optim.lr,
            momentum=momentum,
            nesterov=momentum > 0,
            weight_decay=optim.weight_decay,
            foreach=foreach,
        )
    return torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay, foreach=foreach)


def _foreach_choice(params: list[torch.Tensor]) -> bool | None:
    """False when the parameters mix DTensors and plain tensors, else torch's own choice.
    The tensor-parallel plan leaves embeddings, norms and the head whole, and the foreach
    kernels torch picks on CUDA refuse such a mix ("got mixed torch.Tensor and DTensor":
    every step of parallel.tp without dp_shard failed on a GPU). FSDP makes every
    parameter a DTensor, and on a CPU torch loops over the tensors anyway."""
    kinds = {isinstance(p, DTensor) for p in params}
    return False if len(kinds) > 1 else None


class OptimizerGroup:
    """One optimizer per model part, stepped together (what the loop sees as one)."""

    def __init__(self, parts: list[nn.Module], optim: OptimConfig) -> None:
        self.optimizers = [make_optimizer(part.parameters(), optim) for part in parts]

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class TrainState:
    """Model parts and their optimizers as one Stateful for torch.distributed.checkpoint."""

    def __init__(self, parts: list[nn.Module], optimizer: OptimizerGroup) -> None:
        self.parts, self.optimizer = parts, optimizer

    def _pairs(self) -> Iterator[tuple[nn.Module, torch.optim.Optimizer]]:
        return zip(self.parts, self.optimizer.optimizers, strict=True)

    def state_dict(self) -> dict:
        model: dict = {}
        optim: dict = {}
        for part, opt in self._pairs():
            model.update(get_model_state_dict(part, options=_OPTIONS))
            optim.update(get_optimizer_state_dict(part, opt, options=_OPTIONS))
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict) -> None:
        partial = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for part, opt in self._pairs():
            set_model_state_dict(part, state["model"], options=partial)
            set_optimizer_state_dict(part, opt, state["optim"], options=partial)


def clip_grad_norm(
    parts: list[nn.Module],
    max_norm: float,
    pp_size: int = 1,
    replicated: bool = False,
    held_alone: frozenset[int] = frozenset(),
) -> float:
    """Scale gradients so their global norm is at most `max_norm`; return the norm.

    The norm is over the whole model, so every rank computes the factor one process
    would. Each rank adds the squares of the gradient pieces it holds, each divided by
    how many ranks hold that same piece (the ranks of its pipeline stage, over the shards
    a DTensor is cut into, one for the parameters in `held_alone` by id: embedding rows
    only this rank holds), and one all-reduce sums them. `replicated`: every rank holds
    every gradient whole (DDP), so no communication is needed.
    """
    params = [p for part in parts for p in part.parameters() if p.grad is not None]
    distributed = dist.is_initialized() and not replicated
    world = dist.get_world_size() if distributed else 1
    stage_ranks = world // pp_size  # the ranks that hold one pipeline stage
    locals_, copies = [], []
    for param in params:
        grad = param.grad
        if id(param) in held_alone:
            locals_.append(grad)
            copies.append(1)
        elif isinstance(grad, DTensor):
            locals_.append(grad.to_local())
            copies.append(stage_ranks // _shards(grad))
        else:
            locals_.append(grad)
            copies.append(stage_ranks)
    norms = torch._foreach_norm([g.float() for g in locals_]) if locals_ else []
    squares = [n.double() ** 2 / c for n, c in zip(norms, copies, strict=True)]
    # On the CPU: the default group has a gloo side for such small tensors (topology).
    total_sq = torch.stack(squares).sum().cpu() if squares else torch.zeros((), dtype=torch.float64)
    if world > 1:  # every rank joins, even one that holds no gradient
        dist.all_reduce(total_sq)
    total = math.sqrt(total_sq.item())
    factor = max_norm / (total + 1e-6)
    if factor < 1.0:
        torch._foreach_mul_(locals_, factor)  # the local pieces are the gradients' storage
    return total


def _shards(tensor: DTensor) -> int:
    """Distinct pieces `tensor` is cut into: the sizes of its sharded mesh dimensions."""
    count = 1
    for size, placement in zip(tensor.device_mesh.shape, tensor.placements, strict=True):
        if not placement.is_replicate():  # Shard, or FSDP's strided shard over tp
            count *= size
    return count
