"""Fault injection for tests and drills, read from GRADLINE_FAULT in each worker.

Format: `KIND:rank=R:step=S[:seconds=X][:attempt=A][:once=1]`, several separated by `;`.
  kill   - SIGKILL this worker when it reaches step S (on restart attempt A, default 0)
  fail   - raise at step S on every attempt; with once=1 only the first time in a job,
           even across launches (a crash that a retried task gets past)
  stall  - stop making progress at step S (sleeps `seconds`, default forever)
  slow   - sleep `seconds` in every step from step S on (a straggler)
Unset, it costs one attribute check per step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "GRADLINE_FAULT"


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

    @property
    def marker(self) -> str:
        return f"fault-fired-{self.kind}-rank{self.rank}-step{self.step}"


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        kind, *fields = item.split(":")
        values = dict(f.split("=", 1) for f in fields)
        if kind not in ("kill", "fail", "stall", "slow"):
            raise ValueError(f"{ENV}: unknown fault kind {kind!r} in {item!r}")
        faults.append(
            Fault(
                kind,
                int(values.get("rank", 0)),
                int(values.get("step", 0)),
                float(values.get("seconds", 0.0)),
                int(values.get("attempt", 0)),
                values.get("once", "0") not in ("0", "false", ""),
            )
        )
    return faults


class FaultPlan:
    def __init__(self, faults: list[Fault], rank: int, record_dir: Path | None = None) -> None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.faults = [f for f in faults if f.rank == rank]
        self.attempt = attempt
        self.active = bool(self.faults)
        self.record_dir = record_dir

    @classmethod
    def from_env(cls, rank: int, record_dir: Path | None = None) -> FaultPlan:
        return cls(parse(os.environ.get(ENV, "")), rank, record_dir)

    def at_step(self, step: int) -> None:
        if not self.active:
            return
        for fault in self.faults:
            if fault.kind == "slow" and step >= fault.step:
                time.sleep(fault.seconds)
            elif step != fault.step:
                continue
            elif fault.kind == "kill" and self.attempt == fault.attempt:
                if self.record_dir is not None:  # when, for recovery-time measurements
                    payload = json.dumps({"step": step, "time": time.time()})
                    (self.record_dir / "killed.json").write_text(payload)
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "fail":
                if fault.once:
                    # Remembered beside the job's checkpoints, which outlive a launch.
                    marker = self.record_dir.parent / fault.marker
                    if marker.exists():
                        continue
                    marker.write_text("")
                raise InjectedFailure(f"injected failure at step {step}")
            elif fault.kind == "stall":
                time.sleep(fault.seconds or 10**6)
