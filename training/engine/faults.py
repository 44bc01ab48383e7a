"""Fault injection for tests and drills: GRADLINE_FAULT, read once by the launcher and
handed to every worker with its job.

Format: `KIND:rank=R:step=S[:seconds=X][:attempt=A][:once=1][:steps=N]`, several separated by `;`.
  kill   - SIGKILL this worker when it reaches step S (on restart attempt A, default 0)
  fail   - raise at step S on every attempt; with once=1 only the first time in a job,
           even across launches (a crash that a retried task gets past)
  stall  - stop making progress at step S (sleeps `seconds`, default forever)
  slow   - from step S on, every step: sleep `seconds`, or with `factor=F` stretch the
           rank's own work in the step (data, compute, optimizer; waiting excluded) F
           times (a slower device: the delay follows the rank's share, and burns the
           rank's core as a slow device would, never sleeping)
  term   - at step S (or the first after it), send SIGTERM to the launcher (this worker's
           agent, once per attempt; with once=1 once in the job): a preemption
           notice, as a cluster manager gives, that the job saves and stops on
  hiccup - from step S on, with probability `prob` per step, stall for `factor` times the
           rank's own work in the step (a transient straggler; a seeded draw per rank
           and step)
  fill   - at step S, fill the disk of the job's checkpoints (a file `fill-ballast` in the
           job's folder, written until the disk is full): a disk that fills up mid-run
  nan    - at step S, and for `steps` steps from it (default 1), the loss of this rank is
           NaN (so are its gradients): what a bad batch or an overflow does
rank=-1 applies a fault to every rank. Unset, it costs one attribute check per step.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from training.engine.worker_start import launcher_pid

ENV = "GRADLINE_FAULT"


BALLAST = "fill-ballast"  # what the fill fault writes, in the job's folder


def _fill_disk(ballast: Path) -> None:
    size = 1 << 20
    with ballast.open("ab", buffering=0) as handle:
        while size:  # whole MiBs, then halves of what is left, down to a byte
            try:
                handle.write(bytes(size))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                size //= 2


class InjectedFailure(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    seconds: float = 0.0
    attempt: int = 0
    once: bool = False
    factor: float = 0.0
    prob: float = 0.0
    steps: int = 1

    @property
    def marker(self) -> str:
        return f"fault-fired-{self.kind}-rank{self.rank}-step{self.step}"


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        kind, *fields = item.split(":")
        values = dict(f.split("=", 1) for f in fields)
        if kind not in ("kill", "fail", "stall", "slow", "hiccup", "term", "fill", "nan"):
            raise ValueError(f"{ENV}: unknown fault kind {kind!r} in {item!r}")
        faults.append(
            Fault(
                kind,
                int(values.get("rank", 0)),
                int(values.get("step", 0)),
                float(values.get("seconds", 0.0)),
                int(values.get("attempt", 0)),
                values.get("once", "0") not in ("0", "false", ""),
                float(values.get("factor", 0.0)),
                float(values.get("prob", 0.0)),
                int(values.get("steps", 1)),
            )
        )
    return faults


class FaultPlan:
    """The faults of one worker: its rank's (and every rank's), on restart `attempt`."""

    def __init__(
        self, faults: list[Fault], rank: int, attempt: int = 0, record_dir: Path | None = None
    ) -> None:
        self.faults = [f for f in faults if f.rank in (rank, -1)]
        self.rank, self.attempt = rank, attempt
        self.active = bool(self.faults)
        self.record_dir = record_dir
        self._fired: set[Fault] = set()

    def _fire_once(self, fault: Fault, step: int) -> None:
        if fault in self._fired:
            return
        self._fired.add(fault)
        if fault.kind == "term":  # a preemption notice to the launcher
            os.kill(launcher_pid(), signal.SIGTERM)
            return
        if self.record_dir is not None:  # when, for recovery-time measurements
            self.record_dir.mkdir(parents=True, exist_ok=True)
            payload = json.dumps({"step": step, "time": time.time()})
            (self.record_dir / "killed.json").write_text(payload)
        os.kill(os.getpid(), signal.SIGKILL)

    def _first_time_in_job(self, fault: Fault) -> bool:
        """Always, unless once=1: then only the first time in the job, even across
        launches (remembered beside the job's checkpoints, which outlive a launch)."""
        if not fault.once or self.record_dir is None:
            return True
        marker = self.record_dir.parent / fault.marker
        if marker.exists():
            return False
        marker.write_text("")
        return True

    def at_step(self, step: int) -> None:
        if not self.active:
            return
        for fault in self.faults:
            if fault.kind == "slow" and step >= fault.step:
                time.sleep(fault.seconds)  # a pause that stretches a drill, not a device
            elif fault.kind in ("kill", "term") and self.attempt == fault.attempt:
                # A preemption notice comes from step S on, once: an async rank numbers
                # its own gradients and, resumed past S, would never see S itself.
                due = step == fault.step or (fault.kind == "term" and step > fault.step)
                if due and self._first_time_in_job(fault):
                    self._fire_once(fault, step)
            elif step != fault.step or fault.kind == "hiccup":
                continue
            elif fault.kind == "fail" and self._first_time_in_job(fault):
                raise InjectedFailure(f"injected failure at step {step}")
            elif fault.kind == "fill" and self._first_time_in_job(fault):
                _fill_disk(self.record_dir.parent / BALLAST)
            elif fault.kind == "stall":
                time.sleep(fault.seconds or 10**6)

    def poisons_loss(self, step: int) -> bool:
        """Whether a `nan` fault makes this rank's loss of step `step` NaN."""
        return self.active and any(
            f.kind == "nan" and f.step <= step < f.step + f.steps for f in self.faults
        )

    def stretch(self, step: int, own_seconds: float) -> float:
        """Seconds to add to a phase of the rank's own work that took `own_seconds` (slow
        with a factor, hiccups); the caller burns them in that phase."""
        if not self.active:
            return 0.0
        extra = 0.0
        for fault in self.faults:
            if step < fault.step:
                continue
            if fault.kind == "slow" and fault.factor > 1:
                extra += (fault.factor - 1) * own_seconds
            elif fault.kind == "hiccup" and _draw(self.rank, step) < fault.prob:
                extra += fault.factor * own_seconds
        return extra


def burn(seconds: float) -> None:
    """Keep this rank's thread computing for `seconds`, as a slower device would.

    A sleep would free the core: on a host with one core per rank, the other ranks'
    helper threads (gloo, the loader, a parameter server) would take it, and a benchmark
    of a slow rank would beat the physical bound (sync above 0.5 with one of two ranks
    twice as slow). Small matmuls keep the core this rank's."""
    import torch

    deadline = time.perf_counter() + seconds
    block = torch.ones(64, 64)
    while time.perf_counter() < deadline:
        block @ block


def _draw(rank: int, step: int) -> float:
    """A uniform draw fixed by (rank, step): a rerun hiccups at the same steps."""

    return random.Random(rank * 1_000_003 + step).random()


class PoisonableLoss:
    """The objective's loss, made NaN while `poisoned` (the `nan` fault): the loop sets it
    before each step, so a drill reaches the real guard through the real backward."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn, self.poisoned = loss_fn, False

    def __call__(self, output, target):
        loss = self.loss_fn(output, target)
        return loss * float("nan") if self.poisoned else loss
