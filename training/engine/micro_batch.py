"""`train.micro_batch: auto`: the largest per-rank micro-batch that fits, and the gradient
accumulation that keeps the global batch (so the same rows make each optimizer step,
and the result is the same up to the order of float additions).

A rank's memory for a micro-batch of m rows is estimated as
  static  = the weights, their gradients and the optimizer's state (a full replica: a
            sharded layout holds less, so the estimate errs on the safe side), plus
  m x what one row costs: the tensors autograd saves for the backward (measured with
            saved-tensor hooks on a forward of two rows, under the job's autocast) and
            the output and its gradient.
The budget is `train.memory_budget_mb`, else the GPU's free memory (85 %: the allocator
fragments), else this host's available memory shared by its ranks (80 %). On CUDA the
chosen size is then tried, forward and backward for real, and made smaller while it runs
out of memory. Every rank takes the largest accumulation any rank needs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import psutil
import torch
from torch import nn

from training.config import Config
from training.engine.embedding_sharding import optimizer_copies
from training.engine.topology import Topology, all_reduce_max
from training.errors import ConfigError

log = logging.getLogger("gradline.train")

GPU_SHARE, HOST_SHARE = 0.85, 0.8


def budget_bytes(cfg: Config, topo: Topology) -> float:
    """What one rank may use: the configured budget, or a share of what is free."""
    if cfg.train.memory_budget_mb:
        return cfg.train.memory_budget_mb * 2**20
    if topo.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(topo.device)
        return GPU_SHARE * free
    ranks_here = max(cfg.runtime.procs_per_node, 1)
    return HOST_SHARE * psutil.virtual_memory().available / ranks_here


def static_bytes(model: nn.Module, cfg: Config) -> int:
    """Weights, gradients and optimizer state of a full replica."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights * (2 + optimizer_copies(cfg.optim))


def bytes_per_row(
    model: nn.Module,
    example: torch.Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> float:
    """Memory one more row adds: what autograd keeps for the backward, and the output
    with its gradient. Measured on forwards of 1 and 3 rows (copies of the example's
    first), so what does not grow with rows (weights, autocast's copies) cancels."""

    def held(rows: int) -> int:
        storages: dict[int, int] = {}  # one tensor saved by two ops is held once

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        batch = example[:1].expand(rows, *example.shape[1:]).contiguous()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), autocast():
            out = model(batch)
        output = 2 * out.numel() * out.element_size()  # the output and its gradient
        return sum(storages.values()) + output

    return (held(3) - held(1)) / 2


def accumulation_steps(per_rank: int, static: float, per_row: float, budget: float) -> int:
    """The fewest micro-batches (a divisor of `per_rank`) whose rows fit the budget."""
    for steps in range(1, per_rank + 1):
        if per_rank % steps == 0 and static + per_row * (per_rank // steps) <= budget:
            return steps
    raise ConfigError(
        f"train.micro_batch: auto: even one row per micro-batch needs "
        f"{(static + per_row) / 2**20:.0f} MB and a rank may use {budget / 2**20:.0f} MB "
        "(train.memory_budget_mb, or what is free): use a smaller model, shard it "
        "(parallel.dp_shard, tp), or raise the budget"
    )


def _fits_on_gpu(model: nn.Module, example: torch.Tensor, rows: int, autocast) -> bool:
    """One real forward and backward of `rows` rows (copies of the example's first)."""
    batch = example[:1].expand(rows, *example.shape[1:]).contiguous()
    try:
        with autocast():
            out = model(batch)
        out.float().sum().backward()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def fitting_accumulation(
    cfg: Config,
    topo: Topology,
    build: Callable[[], nn.Module],
    example: torch.Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> int:
    """train.grad_accum_steps for micro_batch: auto, the same on every rank."""
    per_rank = cfg.train.batch_size // topo.dp_size
    model = build().to(topo.device)
    example = example.to(topo.device)
    budget = budget_bytes(cfg, topo)
    static = static_bytes(model, cfg)
    steps = accumulation_steps(per_rank, static, bytes_per_row(model, example, autocast), budget)
    if topo.device.type == "cuda":  # the estimate, checked for real
        while not _fits_on_gpu(model, example, per_rank // steps, autocast):
            larger = [s for s in range(steps + 1, per_rank + 1) if per_rank % s == 0]
            if not larger:
                raise ConfigError("train.micro_batch: auto: one row does not fit this GPU")
            steps = larger[0]
    del model
    steps = int(all_reduce_max(torch.tensor([float(steps)])).item())
    if topo.is_main:
        log.info(
            "micro_batch auto: %d rows per micro-batch, %d micro-batches per step (budget "
            "%.0f MB per rank)",
            per_rank // steps,
            steps,
            budget / 2**20,
        )
    return steps


def resolve_micro_batch(
    cfg: Config,
    topo: Topology,
    build: Callable[[], nn.Module],
    example: torch.Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> Config:
    """The job's config with micro_batch: auto resolved into train.grad_accum_steps."""
    if cfg.train.micro_batch != "auto":
        return cfg
    steps = fitting_accumulation(cfg, topo, build, example, autocast)
    return cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"grad_accum_steps": steps})}
    )
