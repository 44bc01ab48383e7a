"""Straggler detection and the time breakdown, as pure functions."""

from __future__ import annotations

from training.engine.timing import PHASES, RankTimes, find_stragglers, interval_metrics


def _rank(rank: int, busy: float, sync: float) -> RankTimes:
    row = [0.0] * (len(PHASES) + 3)  # phases, steps, wall, bytes
    row[PHASES.index("compute")] = busy * 10
    row[PHASES.index("sync_wait")] = sync * 10
    row[len(PHASES)] = 10  # steps
    row[len(PHASES) + 1] = (busy + sync) * 10  # wall
    return RankTimes.from_vector(rank, row)


def test_the_busy_rank_is_the_straggler_not_the_waiting_ones() -> None:
    ranks = [_rank(0, 0.010, 0.030), _rank(1, 0.040, 0.0), _rank(2, 0.011, 0.029)]
    assert [(r, round(x, 2)) for r, x in find_stragglers(ranks, 1.5)] == [(1, 3.81)]


def test_balanced_ranks_and_tiny_gaps_are_not_stragglers() -> None:
    assert find_stragglers([_rank(0, 0.010, 0.001), _rank(1, 0.011, 0.0)], 1.5) == []
    # 3x slower but only 1 ms per step: noise, not a straggler.
    assert find_stragglers([_rank(0, 0.0005, 0.001), _rank(1, 0.0015, 0.0)], 1.5) == []
    assert find_stragglers([_rank(0, 0.010, 0.0)], 1.5) == []


def test_interval_metrics_per_rank_and_fractions() -> None:
    metrics = interval_metrics([_rank(0, 0.01, 0.03), _rank(1, 0.04, 0.0)])
    assert metrics["time_sync_wait_s/rank0"] == 0.03
    assert abs(metrics["time_fraction_sync_wait"] - 0.375) < 1e-9
