"""The engine's seams: what one step takes and gives, and the two things a loop drives.

- A `Layout` (training.engine.parallelize, training.engine.replicas) is how the model is
  spread over the ranks: DDP replicas, FSDP2/TP shards, pipeline stages, or replicas
  that feed a parameter server. It runs one step's forward and backward on this rank's
  share (`forward_backward(StepInputs)`), steps the optimizer, and says how its state
  is checkpointed.
- An `UpdateRule` (training.engine.updates) is how the data-parallel replicas combine
  their work: `advance` runs the steps from one barrier to the next. Synchronous rules
  (sync, local SGD, DiLoCo) run them in lockstep through the loop's `StepWork`;
  asynchronous updates hand the loop's gradients to a parameter server.

The loop (training.engine.loop) knows nothing else of either: it asks the layout's rule
to advance, then does the barrier's work (log, checkpoint, validate, stop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LearningRate = Callable[[int], float]  # the learning rate of an optimizer step


@dataclass(frozen=True)
class StepInputs:
    """This rank's share of one step's global batch."""

    x: torch.Tensor
    y: torch.Tensor
    step: int
    micro_batches: int = 1  # gradient accumulation: the share is cut into these
    loss_scale: float = 1.0  # weight of the share's mean loss (uneven shares: balance.py)
    measure_comm: bool = False  # sample communication time and bytes on this step


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's mean loss (zero where the rank computes none)
    sync_wait: float  # seconds waiting for other ranks in collectives
    bubble: float = 0.0  # seconds a pipeline stage waited for its neighbours
    bytes_sent: float = 0.0  # bytes this rank sent (counted; sampled where metered)


@dataclass
class Segment:
    """What the steps between two barriers did; the same on every rank."""

    end: int  # the job's step reached
    losses: list[torch.Tensor | float]  # one per step of the job, in order
    metrics: dict[str, float] = field(default_factory=dict)  # the rule's own, to log
    sync_wait: float = 0.0  # seconds this rank waited outside the loop's phases
    bytes_sent: float = 0.0  # bytes this rank sent outside the loop's phases


class StepWork(Protocol):
    """What the loop offers an update rule: this rank's work for step n."""

    def gradient(self, n: int) -> tuple[float, int]:
        """Read this rank's batch for step n, forward and backward: (mean loss, rows)."""

    def step(self, n: int) -> torch.Tensor:
        """A whole synchronous step n: gradient, optimizer step, the rule's sync."""


class UpdateRule(Protocol):
    name: str
    local: bool  # replicas may differ between syncs (each rank checkpoints its own)
    lockstep: bool  # every rank takes every step together (so may stop at any step)

    def advance(self, start: int, until: int, work: StepWork) -> Segment:
        """Run the job's steps from `start` up to the barrier at `until`."""

    def syncs_gradients(self, step: int) -> bool:
        """Whether step `step` (0-based) averages gradients over the replicas."""

    def after_step(self, done: int) -> None:
        """After an optimizer step, with `done` steps taken: a sync, if one is due."""

    def finish(self, done: int) -> None:
        """The end of training: leave every replica equal to the job's model."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Layout(Protocol):
    rule: UpdateRule
    forward_is_collective: bool  # running the whole model takes every rank together

    @property
    def whole(self) -> nn.Module | None:
        """The whole model (None when pipelined)."""

    @property
    def lr(self) -> float: ...

    def forward_backward(self, inputs: StepInputs) -> StepResult: ...

    def optimizer_step(self, lr: float, grad_clip: float) -> bool:
        """Clip (0: no clipping), step at learning rate `lr`, clear the gradients. When
        the gradient norm is not finite, every rank that shares the step skips it
        instead (training.engine.nonfinite); returns whether it stepped."""

    def after_step(self, done: int) -> float:
        """The rule's sync after step `done`, if due; returns the bytes it sent."""

    def finish(self, done: int) -> float:
        """Before the final checkpoint: replicas become the job's one model (bytes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Validation: the whole model's output (None on ranks that produce none)."""

    def train(self, mode: bool = True) -> None: ...

    @property
    def state(self):
        """The checkpoint state: a Stateful for torch.distributed.checkpoint."""

    def checkpoint_info(self) -> dict:
        """What a checkpoint's train state records about how the state was laid out."""

    def resume_state(self, train_state: dict):
        """The state to load a checkpoint written with `train_state` into."""

    def close(self) -> None: ...
