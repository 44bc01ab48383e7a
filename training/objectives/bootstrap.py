"""Bootstrap intervals of a split's metrics, accumulated while the split is scored.

Every metric of a task is a function of statistics summed over rows (objectives/base.py).
Resampling the rows with replacement is therefore a weighted sum: replicate b counts row
i's statistics w[i, b] times. The weights are Poisson(1) draws (the Poisson bootstrap:
each row's count in a resample of n rows is Binomial(n, 1/n), which tends to Poisson(1)),
drawn row by row in row order. So the replicates accumulate batch by batch in one pass,
in memory that does not grow with the split (statistics x replicates), and they depend
on the seed and the rows alone, never on the batch size. The interval is the percentile
one: the 2.5th and 97.5th percentiles of the replicates' metric for 95 %.

A count is read from a 16-bit uniform draw through a table of Poisson(1)'s distribution
in steps of 2**-16 (counts above 8, probability 1e-6, are cut to 8): ~8x faster than
drawing Poisson variates, which is most of the bootstrap's cost.

The model and its baseline are resampled with the same seed, so with the same weights
for the same rows: their intervals are paired, as their point estimates are (same split).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

CONFIDENCE = 0.95
# Replicates x statistics held at once (float64): bounds memory to ~400 MB when a task
# has many statistics (a classifier's confusion matrix grows with classes squared).
MAX_CELLS = 50_000_000
MIN_REPLICATES = 100  # fewer resamples make percentile intervals too noisy to report


def poisson_table(bits: int = 16) -> np.ndarray:
    """Count k for each of the 2**bits values of a uniform draw u: the k with
    2**bits P(W < k) <= u < 2**bits P(W <= k), W ~ Poisson(1), edges rounded."""
    size = 1 << bits
    cdf = np.cumsum([math.exp(-1.0) / math.factorial(k) for k in range(24)])
    edges = np.round(cdf * size).astype(np.int64)
    return np.searchsorted(edges, np.arange(size), side="right").astype(np.uint8)


_COUNTS = poisson_table()

MetricsOf = Callable[[torch.Tensor, str], dict[str, float]]


@dataclass
class Bootstrap:
    """How to resample, and the intervals of every scoring it was passed to, by metric
    key (`test_accuracy`, `baseline_test_accuracy`, ...)."""

    replicates: int
    seed: int
    confidence: float = CONFIDENCE
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Why intervals are missing, or fewer replicates than asked were drawn; "" if neither.
    note: str = ""

    def start(self, num_stats: int) -> Resamples | None:
        """The accumulator of one scoring pass (None: no resampling)."""
        if self.replicates <= 0:
            return None
        replicates = min(self.replicates, MAX_CELLS // max(num_stats, 1))
        if replicates < MIN_REPLICATES:
            self.note = (
                f"no intervals: {num_stats} statistics per resample leave room for only "
                f"{replicates} resamples (fewer than {MIN_REPLICATES})"
            )
            return None
        if replicates < self.replicates:
            self.note = f"{replicates} resamples (of {self.replicates}): {num_stats} statistics"
        return Resamples(num_stats, replicates, self.seed)

    def record(
        self, resamples: Resamples | None, metrics: MetricsOf, prefix: str, rename: str = ""
    ) -> None:
        """The intervals of a finished pass, keyed `rename + <metric key>`."""
        if resamples is None:
            return
        for key, bounds in resamples.intervals(metrics, prefix, self.confidence).items():
            self.intervals[rename + key] = bounds

    def to_dict(self) -> dict:
        return {
            "confidence": self.confidence,
            "replicates": self.replicates,
            "seed": self.seed,
            "method": "percentile, Poisson bootstrap over rows",
            "note": self.note,
            "intervals": {k: list(v) for k, v in sorted(self.intervals.items())},
        }


class Resamples:
    """The summed statistics of each replicate, (num_stats, replicates)."""

    def __init__(self, num_stats: int, replicates: int, seed: int) -> None:
        self.sums = np.zeros((num_stats, replicates))
        self.rows = 0
        self._rng = np.random.default_rng(seed)

    def add(self, row_stats: torch.Tensor) -> None:
        """Add one batch: `row_stats` is (rows, num_stats), dense or sparse COO."""
        rows = row_stats.shape[0]
        draws = self._rng.integers(0, len(_COUNTS), (rows, self.sums.shape[1]), dtype=np.uint16)
        weights = _COUNTS[draws].astype(np.float64)
        if not row_stats.is_sparse:
            self.sums += row_stats.to(torch.float64).numpy().T @ weights
            self.rows += rows
            return
        # Each non-zero (row, statistic, value) adds value x the row's weights to the
        # statistic's sums: work in the non-zeros, however many statistics there are.
        # Grouped by statistic and summed with reduceat (index_add_ is ~10x slower).
        entries = row_stats.coalesce()
        row, stat = entries.indices().numpy()
        value = entries.values().to(torch.float64).numpy()
        order = np.argsort(stat, kind="stable")
        stat, row, value = stat[order], row[order], value[order]
        starts = np.flatnonzero(np.r_[True, stat[1:] != stat[:-1]])
        self.sums[stat[starts]] += np.add.reduceat(value[:, None] * weights[row], starts, axis=0)
        self.rows += rows

    def intervals(
        self, metrics: MetricsOf, prefix: str, confidence: float
    ) -> dict[str, tuple[float, float]]:
        """(low, high) per metric key: percentiles of the replicates' values (NaN where
        every replicate's value is NaN, e.g. an empty split)."""
        values: dict[str, list[float]] = {}
        for b in range(self.sums.shape[1]):
            for key, value in metrics(torch.from_numpy(self.sums[:, b].copy()), prefix).items():
                values.setdefault(key, []).append(value)
        tail = (1.0 - confidence) / 2 * 100
        bounds = {}
        for key, series in values.items():
            array = np.asarray(series, dtype=np.float64)
            finite = array[~np.isnan(array)]
            if not len(finite):
                bounds[key] = (math.nan, math.nan)
                continue
            low, high = np.percentile(finite, [tail, 100 - tail])
            bounds[key] = (float(low), float(high))
        return bounds
