"""Pipeline parallelism: this rank's stages of the model, the schedule that runs them, and
a forward-only pass for validation.

The model cuts itself (`pipeline_stage(i, n)`); this module places the stages (stage i
on pipeline rank i mod pp: one stage per rank, or several with the interleaved 1F1B
schedule), runs torch.distributed.pipelining's schedule for training, and measures how
long each stage computes. What a rank spends in a step beyond its compute is the
pipeline bubble (waiting for its neighbours, including the activations' transfer).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from training.engine.timing import adds_seconds
from training.errors import ConfigError

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def stage_indices(pp_rank: int, pp: int, stages: int) -> list[int]:
    """The stages this pipeline rank runs: pp_rank, pp_rank + pp, ..."""
    return list(range(pp_rank, stages, pp))


def cut_stage(module: nn.Module, index: int, count: int) -> nn.Module:
    cut = getattr(module, "pipeline_stage", None)
    if cut is None:
        raise ConfigError(
            f"{type(module).__name__} has no pipeline_stage(index, count): a model without "
            "one cannot use parallel.pp > 1 (set parallel.pp: 1)"
        )
    return cut(index, count)


class ComputeClock:
    """Seconds this rank's stages spend computing, summed over a step's chunks."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, method: Callable) -> Callable:
        return adds_seconds(method, self)


class Pipeline:
    """This rank's stages and the schedule over them."""

    def __init__(
        self,
        parts: list[nn.Module],
        indices: list[int],
        stages: int,
        schedule: str,
        microbatches: int,
        loss_fn: Callable,
        group,
        device: torch.device,
    ) -> None:

        # Here, not at the top: only a pipeline needs it. (It imports TorchDynamo, which the
        # workers' server preloads anyway: torch's optimizers import it as they are built.)
        from torch.distributed import pipelining

        self.parts, self.indices, self.stages, self.group = parts, indices, stages, group
        self.clock = ComputeClock()
        self.pipeline_stages = []
        for part, index in zip(parts, indices, strict=True):
            stage = pipelining.PipelineStage(part, index, stages, device, group=group)
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self.clock.wrap(getattr(stage, name)))
            self.pipeline_stages.append(stage)
        if schedule == "interleaved_1f1b":
            self.schedule = pipelining.ScheduleInterleaved1F1B(
                self.pipeline_stages, microbatches, loss_fn=loss_fn
            )
        else:
            schedule_class = getattr(pipelining, SCHEDULES[schedule])
            self.schedule = schedule_class(self.pipeline_stages[0], microbatches, loss_fn=loss_fn)

    @property
    def has_first(self) -> bool:
        return 0 in self.indices

    @property
    def has_last(self) -> bool:
        return self.stages - 1 in self.indices

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor | None, float, float]:
        """Forward and backward of one batch in micro-batches; returns the mean loss (on
        the last stage's rank, else None), the seconds of the step and of its compute."""
        losses: list[torch.Tensor] = []
        self.clock.seconds = 0.0
        started = time.perf_counter()
        if self.has_first:  # (with pp > 1 no rank holds both ends)
            self.schedule.step(x)
        elif self.has_last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        wall = time.perf_counter() - started
        loss = torch.stack([v.detach() for v in losses]).mean() if losses else None
        return loss, wall, self.clock.seconds

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The whole model's output on the last stage's rank (None elsewhere), stage by
        stage in order: each sends its output to the next stage's rank."""
        pp = dist.get_world_size(self.group)
        mine = dict(zip(self.indices, self.parts, strict=True))
        value = x
        for index in range(self.stages):
            if index not in mine:
                continue
            if index > 0:
                value = _receive(self.group, (index - 1) % pp, x.device)
            value = mine[index](value)
            if index < self.stages - 1:
                _send(value, self.group, (index + 1) % pp)
        return value if self.has_last else None


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
_HEADER = 8  # dtype code, rank count, then up to six dimensions


def _send(tensor: torch.Tensor, group, to: int) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    dst = dist.get_global_rank(group, to)
    dist.send(header, dst=dst, group=group)
    dist.send(tensor.contiguous(), dst=dst, group=group)


def _receive(group, source: int, device: torch.device) -> torch.Tensor:
    src = dist.get_global_rank(group, source)
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    shape = header[2 : 2 + int(header[1])].tolist()
    tensor = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device)
    dist.recv(tensor, src=src, group=group)
    return tensor
