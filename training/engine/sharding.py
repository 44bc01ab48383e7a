"""Tensor parallelism, activation checkpointing and FSDP2 applied to one model part.

Each step takes a module and changes it in place, in the order the parallelize step
calls them: the tensor-parallel plan first (weights become DTensors on the `tp` mesh),
then activation checkpointing of each block, then `fully_shard` of each block and of
the root over the data-parallel mesh (HSDP when it is 2-D: replicate x shard).
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from training.errors import ConfigError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def tensor_parallel_plan(module: nn.Module) -> dict[str, str]:
    """The model's own plan: module name patterns -> "colwise" or "rowwise"."""
    plan = getattr(module, "tensor_parallel_plan", None)
    if plan is None:
        raise ConfigError(
            f"{type(module).__name__} has no tensor_parallel_plan(): a model without one "
            "cannot use parallel.tp > 1 (set parallel.tp: 1, or give the model a "
            'tensor_parallel_plan() returning {"blocks.*.q": "colwise", ...})'
        )
    return plan()


def apply_tensor_parallel(module: nn.Module, mesh: DeviceMesh) -> None:
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    for pattern, style in tensor_parallel_plan(module).items():
        if style not in styles:
            raise ConfigError(
                f"tensor-parallel plan entry {pattern}: {style!r} is not one of {list(styles)}"
            )
        for name, _ in module.named_modules():
            if fnmatch.fnmatchcase(name, pattern):
                plan[name] = styles[style]()
    if not plan:
        some = [name for name, _ in module.named_modules() if name][:5]
        raise ConfigError(
            f"the tensor-parallel plan of {type(module).__name__} matches no module: its "
            f"patterns {list(tensor_parallel_plan(module))} must name submodules such as "
            f"{some} (shell-style wildcards, e.g. blocks.*.attention.q)"
        )
    parallelize_module(module, mesh, plan)


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The blocks sharded and recomputed one at a time (none: the model is one unit)."""
    units = getattr(module, "shard_units", None)
    return list(units()) if units is not None else []


def apply_activation_checkpointing(module: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them. The
    forward is replaced in place (no wrapper module) so parameter names do not change."""
    for unit in shard_units(module) or [module]:
        inner = unit.forward

        def recomputed(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        unit.forward = recomputed


def apply_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: bool,
) -> None:
    """Shard each block, then the root (embeddings, head and the rest) over `mesh`."""
    # Both explicit: FSDP2 reads a reduce dtype of None as "the compute dtype", which
    # would reduce bf16 parameters' gradients in bf16.
    policy = MixedPrecisionPolicy(
        param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype]
    )
    for unit in shard_units(module):
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def average_gradients(parts: list[nn.Module], group, size: int) -> None:
    """Mean of the gradients over the replicas in `group`, in one flat all-reduce: the
    data parallelism of layouts whose parameters are not FSDP-sharded (tp or pp with
    dp_replicate > 1)."""
    grads = []
    for part in parts:
        for param in part.parameters():
            if param.grad is not None:
                grad = param.grad
                grads.append(grad.to_local() if isinstance(grad, DTensor) else grad)
    # Every rank joins the all-reduce, even one that holds no gradient.
    flat = torch.cat([g.reshape(-1) for g in grads] or [torch.zeros(0)]).div_(size)
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
