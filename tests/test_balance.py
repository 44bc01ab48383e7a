"""Measured balance as pure functions: shares, slices of a global batch, when to move."""

from __future__ import annotations

import numpy as np
import pytest

from training.config import ParallelConfig
from training.data.loader import rank_slice, share_slice
from training.engine.balance import Balancer, proportional_shares
from training.engine.timing import PHASES, RankTimes


def test_shares_follow_rates_sum_to_the_batch_and_keep_every_rank_working() -> None:
    assert proportional_shares(64, [2.0, 1.0], 1) == [43, 21]
    assert proportional_shares(64, [1.0, 1.0, 1.0, 1.0], 4) == [16, 16, 16, 16]
    assert proportional_shares(16, [100.0, 0.001], 2) == [14, 2]  # a quantum at least
    for rates in ([3.0, 1.0, 1.0], [0.3, 0.5, 0.7, 0.1]):
        shares = proportional_shares(96, rates, 2)
        assert sum(shares) == 96 and all(s % 2 == 0 and s >= 2 for s in shares)


@pytest.mark.parametrize("shares", [[8, 8], [11, 5], [3, 4, 9]])
def test_uneven_slices_cover_the_same_rows_as_the_even_split(shares) -> None:
    batch, index = sum(shares), 5
    order = np.random.default_rng(0).permutation(10 * batch)
    slices = [share_slice(index, batch, shares, rank) for rank in range(len(shares))]
    whole = rank_slice(index, batch, 1, 0)  # the global batch on one rank
    assert np.array_equal(np.concatenate([order[s] for s in slices]), order[whole])


def _times(compute: list[float]) -> list[RankTimes]:
    ranks = []
    for rank, seconds in enumerate(compute):
        row = [0.0] * (len(PHASES) + 3)
        row[PHASES.index("compute")] = seconds * 10
        row[len(PHASES)] = 10  # steps
        row[len(PHASES) + 1] = seconds * 10  # wall
        ranks.append(RankTimes.from_vector(rank, row))
    return ranks


def test_a_slow_rank_loses_rows_and_the_loss_weights_keep_the_mean() -> None:
    par = ParallelConfig(balance="measured", balance_every_logs=1)
    balancer = Balancer(par, 32, 1, 2, 1)
    assert not balancer.remeasure(_times([0.01, 0.03]), closed=1)  # start-up interval
    assert balancer.remeasure(_times([0.01, 0.03]), closed=2)
    fast, slow = balancer.shares
    assert fast + slow == 32 and slow < 16
    # Each rank's mean loss is weighted by share x ranks / batch: DDP's mean of the two
    # weighted means is the mean over the global batch's rows.
    weights = [share * 2 / 32 for share in balancer.shares]
    assert sum(weights) / 2 == pytest.approx(1.0)
    assert balancer.loss_scale == pytest.approx(weights[1])
    # Balanced enough: nothing moves.
    assert not balancer.remeasure(_times([0.020, 0.021]), closed=3)


def test_even_balance_never_moves() -> None:
    balancer = Balancer(ParallelConfig(), 32, 0, 2, 1)
    assert not balancer.remeasure(_times([0.01, 0.05]), closed=5)
    assert balancer.shares == [16, 16] and balancer.loss_scale == 1.0
