"""Where the time goes, per rank, and who is the straggler.

Each step is cut into phases: waiting for data, forward+backward compute, exposed
synchronisation wait, the pipeline's bubble, optimizer step and checkpoint stall. Under
DDP, synchronisation is measured by the communication hook (training.engine.compression),
which notes when the last bucket was launched: what backward spends after that is time
waiting for the other ranks (communication not hidden behind compute); an update rule's
parameter averaging is sync wait too. Under FSDP, tensor and pipeline parallelism, the time inside
collectives is sampled (training.engine.comm); a pipeline stage's idle time in its
schedule is its bubble.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

PHASES = ("data_wait", "compute", "sync_wait", "pipeline_bubble", "optimizer", "checkpoint_stall")
# Phases that say nothing about a slow rank: waiting for others, and checkpoints, which
# every rank takes at the same steps (the coordinator, rank 0, does more of the work).
NOT_BUSY = ("sync_wait", "pipeline_bubble", "checkpoint_stall")


def adds_seconds(fn: Callable, owner) -> Callable:
    """`fn`, adding the seconds each call takes (even one that raises) to `owner.seconds`."""

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            owner.seconds += time.perf_counter() - started

    return timed


class StepTimes:
    """Seconds per phase summed over a logging interval, plus the wall time."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.bytes_sent = 0.0  # bytes this rank sent in the interval (counted)
        self.started = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def vector(self) -> torch.Tensor:
        wall = time.perf_counter() - self.started
        row = [*(self.seconds[p] for p in PHASES), self.steps, wall, self.bytes_sent]
        return torch.tensor(row, dtype=torch.float64)


@dataclass(frozen=True)
class RankTimes:
    rank: int
    per_step: dict[str, float]  # seconds per step in each phase
    busy: float  # seconds per step of the rank's own step work (see NOT_BUSY)
    bytes_sent: float = 0.0  # bytes the rank sent in the interval
    wall_seconds: float = 0.0  # the interval's wall time on this rank

    @classmethod
    def from_vector(cls, rank: int, row: list[float]) -> RankTimes:
        steps = max(row[len(PHASES)], 1.0)
        per_step = {p: row[i] / steps for i, p in enumerate(PHASES)}
        per_step["wall"] = row[len(PHASES) + 1] / steps
        busy = per_step["wall"] - sum(per_step[p] for p in NOT_BUSY)
        return cls(rank, per_step, busy, row[len(PHASES) + 2], row[len(PHASES) + 1])


def gather_times(times: StepTimes, world_size: int) -> list[RankTimes]:
    """All ranks' interval times, on every rank (one all-gather per interval)."""
    mine = times.vector()
    rows = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(rows, mine)
    return [RankTimes.from_vector(r, row.tolist()) for r, row in enumerate(rows)]


# Per-step gaps smaller than this are scheduler noise on a busy host, not a slow rank.
MIN_STRAGGLER_GAP_S = 0.002


def find_stragglers(ranks: list[RankTimes], factor: float) -> list[tuple[int, float]]:
    """(rank, busy / median busy of the other ranks) for ranks slower than `factor` times
    that median (and by more than MIN_STRAGGLER_GAP_S per step).

    In a synchronous step every rank's wall time is the same; the slow one is the rank
    that is busy (not waiting in sync) much longer than the others.
    """
    found = []
    for r in ranks:
        others = [o.busy for o in ranks if o.rank != r.rank]
        if not others:
            continue
        median = statistics.median(others)
        if median > 0 and r.busy > factor * median and r.busy - median > MIN_STRAGGLER_GAP_S:
            found.append((r.rank, r.busy / median))
    return found


def interval_metrics(ranks: list[RankTimes]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for r in ranks:
        for phase, seconds in r.per_step.items():
            metrics[f"time_{phase}_s/rank{r.rank}"] = seconds
    wall = max(r.per_step["wall"] for r in ranks)
    for phase in PHASES:
        mean = sum(r.per_step[phase] for r in ranks) / len(ranks)
        metrics[f"time_fraction_{phase}"] = mean / wall if wall > 0 else 0.0
    return metrics
