"""Steps whose loss or gradient is not finite are skipped, on every rank alike.

One NaN (a bad batch, an overflow) would otherwise reach the weights through the
optimizer and every checkpoint after it. A non-finite loss makes non-finite gradients,
so the gradient norm decides, and it is already the same on every rank that must step
alike, with no communication of its own: DDP's all-reduce spreads one rank's NaN into
every rank's averaged gradient; under FSDP, tensor and pipeline parallelism the norm is
one all-reduced sum over every shard and stage; a local-SGD or DiLoCo replica steps on
its own gradients and decides alone (an extra collective here would make those rules
talk every step, which is what they exist to avoid). A skipped
step drops its gradients and does not touch the weights or the optimizer's state (Adam's
moments and step count stay as they were). The step still counts as a step of the job:
its batch was read (the data position is the step) and the learning-rate schedule, a
function of the step, moves on, so the job still ends where it was planned and resumes
without any state of its own.

Too many skipped steps in a row mean training diverged; the job stops, naming the step,
the learning rate and the last checkpoint written from finite weights, and is not
retried (a retry would diverge the same way).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from training.errors import USER_ERROR_EXIT_CODE, GradlineError

log = logging.getLogger("gradline.train")


class NonFiniteTraining(GradlineError):
    """The loss or the weights stopped being finite; the message says where and what to do."""

    exit_code = USER_ERROR_EXIT_CODE  # a retry from the same checkpoint diverges again
    retryable = False


def _all_agree_finite(bad: bool) -> bool:
    """True on every rank when no rank saw something non-finite (one all-reduce)."""
    flag = torch.tensor([float(bad)])  # on the CPU: the default group's gloo side takes it
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag)
    return flag.item() == 0


def step_is_finite(grad_norm: float) -> bool:
    """Whether the step may go ahead: its gradient norm (whole-model, as the layout
    computes it for clipping) is finite."""
    return math.isfinite(grad_norm)


def weights_are_finite(parts: list[nn.Module]) -> bool:
    """Whether every rank's parameters are finite (each checks the pieces it holds)."""
    pieces = [
        p.to_local() if hasattr(p, "to_local") else p.detach()
        for part in parts
        for p in part.parameters()
    ]
    norms = torch._foreach_norm([p.float() for p in pieces]) if pieces else []
    local = torch.stack(norms).sum() if norms else torch.zeros(())
    return _all_agree_finite(not bool(torch.isfinite(local)))


class NonFiniteGuard:
    """Counts skipped steps (the `nonfinite_steps` metric) and stops a job whose steps
    stay non-finite `limit` times in a row."""

    def __init__(self, limit: int, skipped: int = 0) -> None:
        self.limit, self.skipped = limit, skipped
        self.in_a_row = 0
        self.last_checkpoint: Path | None = None  # the newest one written from finite weights

    def record(self, step: int, stepped: bool, lr: float) -> None:
        if stepped:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        log.warning("step %d skipped: its loss or gradient norm is not finite (lr %g)", step, lr)
        if self.in_a_row >= self.limit:
            raise NonFiniteTraining(
                f"training diverged: the loss or gradient norm was not finite for "
                f"{self.in_a_row} steps in a row (steps {step - self.in_a_row + 1} to {step}; "
                f"train.max_nonfinite_steps is {self.limit}) at step {step}, learning rate "
                f"{lr:g}. {self._resume_hint()}"
            )

    def refuse_to_save(self, step: int, lr: float) -> NonFiniteTraining:
        return NonFiniteTraining(
            f"the weights are not finite at step {step} (learning rate {lr:g}): no "
            f"checkpoint is written from them. {self._resume_hint()}"
        )

    def _resume_hint(self) -> str:
        where = (
            f"the last finite checkpoint is {self.last_checkpoint}"
            if self.last_checkpoint
            else "no checkpoint was written yet"
        )
        return (
            f"{where}. Lower optim.lr, set optim.grad_clip or check the data, then run "
            "again with --force to start afresh"
        )
