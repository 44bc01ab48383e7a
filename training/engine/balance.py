"""Straggler mitigation: who computes which rows of a global batch (`parallel.balance`).

Under `even`, rank r of W takes the r-th equal slice of every global batch. Under
`measured`, slices follow throughput: every `balance_every_logs` logging intervals the
ranks' measured compute rates (rows per second of forward and backward, exchanged with
the time breakdown, so every rank computes the same answer) set each rank's share, in
multiples of the micro-batch count. A rank twice as slow gets half the rows, and the
synchronous step stops waiting for it.

What a step computes does not change: the global batch and its rows are those of the
even split (the slices are cut from the same permutation), and each rank's mean loss is
weighted by its share (`loss_scale`) so DDP's mean over ranks is the mean over the
global batch's rows. The result agrees with the even split (and with 1 rank) up to
floating-point summation order; with dropout, masks are drawn per rank share.
"""

from __future__ import annotations

from training.engine.timing import RankTimes

# Shares move only when the slowest rank's compute exceeds the fastest's by this much,
# and only when some share would change by more than HYSTERESIS of the global batch:
# measurements on a busy host wobble, and every move costs a new reader.
BALANCED = 0.10
HYSTERESIS = 0.03
# Each move goes this far towards the proportional split: a step's time is not quite
# proportional to its rows (fixed costs per step), so a full jump overshoots.
DAMPING = 0.5


def even_shares(global_batch: int, ranks: int) -> list[int]:
    return [global_batch // ranks] * ranks


def proportional_shares(global_batch: int, rates: list[float], quantum: int) -> list[int]:
    """Split `global_batch` rows in proportion to `rates`, in multiples of `quantum`,
    every rank at least one quantum; the shares sum to the global batch."""
    units, n = global_batch // quantum, len(rates)
    total = sum(rates)
    ideal = [units * r / total for r in rates]
    shares = [max(1, int(x)) for x in ideal]
    # Hand out (or take back) the rounding remainder by the largest fractional parts.
    order = sorted(range(n), key=lambda i: ideal[i] - int(ideal[i]), reverse=True)
    i = 0
    while sum(shares) < units:
        shares[order[i % n]] += 1
        i += 1
    while sum(shares) > units:
        biggest = max(range(n), key=lambda k: shares[k])
        shares[biggest] -= 1
    return [s * quantum for s in shares]


class Balancer:
    """This job's current shares and when to re-measure them."""

    def __init__(self, par, global_batch: int, dp_rank: int, dp_size: int, quantum: int) -> None:
        self.measured = par.balance == "measured" and dp_size > 1
        self.every = par.balance_every_logs
        self.global_batch, self.rank, self.quantum = global_batch, dp_rank, quantum
        self.shares = even_shares(global_batch, dp_size)

    @property
    def loss_scale(self) -> float:
        """Weight of this rank's mean loss so that DDP's mean over ranks is the mean over
        the global batch: share x ranks / global batch (1 under an even split)."""
        return self.shares[self.rank] * len(self.shares) / self.global_batch

    def restore(self, shares: list[int] | None) -> None:
        """Shares from a checkpoint, when it was written by as many ranks."""
        if self.measured and shares and len(shares) == len(self.shares):
            self.shares = list(shares)

    def remeasure(self, ranks: list[RankTimes], closed: int) -> bool:
        """After interval `closed` of this attempt: new shares if due and moved enough.
        The first interval of an attempt holds start-up effects and is not used."""
        if not self.measured or closed < 2 or (closed - 1) % self.every:
            return False
        compute = [r.per_step["compute"] for r in ranks]
        if min(compute) <= 0 or max(compute) <= (1 + BALANCED) * min(compute):
            return False
        rates = [share / seconds for share, seconds in zip(self.shares, compute, strict=True)]
        total = sum(rates)
        target = [
            old + DAMPING * (self.global_batch * rate / total - old)
            for old, rate in zip(self.shares, rates, strict=True)
        ]
        new = proportional_shares(self.global_batch, target, self.quantum)
        moved = max(abs(a - b) for a, b in zip(new, self.shares, strict=True))
        if moved <= max(self.quantum - 1, HYSTERESIS * self.global_batch):
            return False
        self.shares = new
        return True

    def metrics(self) -> dict[str, float]:
        return {f"batch_share/rank{r}": s / self.global_batch for r, s in enumerate(self.shares)}
