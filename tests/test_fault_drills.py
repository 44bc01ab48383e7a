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
    # The two differ by orders of magnitude, so the bound is low: a CI host running four
    # test processes on two cores gave the burn 44 % of a core (0.14 s of 0.32).
    slept_wall, slept_cpu = _cpu_during(lambda: time.sleep(0.3))
    wall, cpu = _cpu_during(lambda: burn(0.3))
    assert wall >= 0.3
    assert slept_cpu < 0.01 * slept_wall  # what the bound below tells apart
    assert cpu >= 0.05 * wall  # a core shared twenty ways still passes


def test_the_stretch_follows_the_steps_own_compute() -> None:
    plan = FaultPlan(parse("slow:rank=1:step=5:factor=3"), rank=1, attempt=0, record_dir=None)
    assert plan.stretch(4, 0.1) == 0.0  # before its step
    assert plan.stretch(5, 0.1) == 0.2  # (3 - 1) x the compute
    other = FaultPlan(parse("slow:rank=1:step=5:factor=3"), rank=0, attempt=0, record_dir=None)
    assert other.stretch(5, 0.1) == 0.0  # another rank's fault
