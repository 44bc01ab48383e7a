"""Parallelism is applied to a built model here and nowhere else.

The loop receives a `Parallelized` model: the bare module (its state is what checkpoints
and the registry hold), what to call for the forward pass, how to skip gradient
synchronisation for accumulation micro-batches, and how long backward waited for the
other ranks. Today's layout is synchronous data parallelism (DDP): every rank holds a
full replica and gradients are all-reduced during every backward pass.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from training.engine.timing import SyncTimer
from training.engine.topology import Topology


@dataclass
class Parallelized:
    module: nn.Module  # the bare model: state_dict, saving, evaluation
    forward: Callable[[torch.Tensor], torch.Tensor]  # wrapped (and maybe compiled)
    wrapper: DistributedDataParallel
    sync_timer: SyncTimer
    world_size: int

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients locally: the micro-batches before the last one."""
        return self.wrapper.no_sync()

    def exposed_sync_wait(self, backward_started: float) -> float:
        """Seconds that backward, just finished, spent waiting for the other ranks after
        launching its last gradient bucket (communication not hidden behind compute)."""
        if self.world_size == 1:
            return 0.0
        return max(0.0, time.perf_counter() - max(self.sync_timer.last_launch, backward_started))


def parallelize(model: nn.Module, topo: Topology, compile_model: bool = False) -> Parallelized:
    """Wrap `model` for this job's layout: DDP over all ranks, timed by a comm hook."""
    model.to(topo.device)
    device_ids = [topo.device.index] if topo.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    timer = SyncTimer(topo.world_size)
    ddp.register_comm_hook(None, timer.hook)
    forward = torch.compile(ddp) if compile_model else ddp
    return Parallelized(model, forward, ddp, timer, topo.world_size)
