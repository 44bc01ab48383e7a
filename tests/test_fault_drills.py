"""The injected slow device computes: its extra time is CPU time on its own core."""

from __future__ import annotations

import time

from training.engine.faults import FaultPlan, burn, parse


def _cpu_during(fn) -> tuple[float, float]:
    """(wall, CPU seconds of this process) while fn runs."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def test_a_slower_device_burns_its_core_instead_of_sleeping() -> None:
    # A sleeping rank would hand its core to its peers' threads, and a benchmark of a
    # slow rank would beat the physical bound.
    wall, cpu = _cpu_during(lambda: burn(0.3))
    assert wall >= 0.3
    assert cpu >= 0.5 * wall  # a sleep: about 0 (0.5 leaves room for a busy host)


def test_the_stretch_follows_the_steps_own_compute() -> None:
    plan = FaultPlan(parse("slow:rank=1:step=5:factor=3"), rank=1, attempt=0, record_dir=None)
    assert plan.stretch(4, 0.1) == 0.0  # before its step
    assert plan.stretch(5, 0.1) == 0.2  # (3 - 1) x the compute
    other = FaultPlan(parse("slow:rank=1:step=5:factor=3"), rank=0, attempt=0, record_dir=None)
    assert other.stretch(5, 0.1) == 0.0  # another rank's fault
