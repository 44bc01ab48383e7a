"""The loop's logging intervals: losses and time breakdown exchanged across ranks, logged
by rank 0 through the tracker, stragglers named; validation metrics; the final result."""

from __future__ import annotations

import logging
from typing import Any

import psutil
import torch
import torch.distributed as dist

from training.config import Config
from training.engine.flops import Throughput
from training.engine.timing import StepTimes, find_stragglers, gather_times, interval_metrics
from training.engine.topology import Topology, reduce_over_shares
from training.engine.tracker import Tracker

log = logging.getLogger("gradline.train")


class IntervalLog:
    def __init__(
        self,
        cfg: Config,
        topo: Topology,
        tracker: Tracker,
        times: StepTimes,
        throughput: Throughput | None = None,
    ) -> None:
        self.cfg, self.topo, self.tracker, self.times = cfg, topo, tracker, times
        self.throughput = throughput
        self.losses: list[torch.Tensor] = []
        self.last: dict[str, float] = {}  # the latest value of every metric
        self.stragglers: dict[int, dict[str, float]] = {}
        self.closed = 0  # intervals closed in this attempt
        # Running totals over the whole job (kept in checkpoints): what plots of loss
        # against time and bytes need. Bytes are the mean over ranks of what each sent.
        self.totals = {"comm_bytes_total": 0.0, "train_seconds": 0.0, "steps_counted": 0.0}

    def add_loss(self, loss: torch.Tensor) -> None:
        self.losses.append(loss)

    def close(self, step: int, lr: float, final: bool = False) -> list | None:
        """Exchange losses and time breakdown; rank 0 logs them and names stragglers.
        A collective: every rank calls it at the same steps (`final` only if needed).
        Returns every rank's times for the interval (None if there was nothing to log)."""
        if final and not self.losses:
            return None
        topo, first, steps = self.topo, step - len(self.losses) + 1, len(self.losses)
        # Each data-parallel share's loss once (not once per tensor-parallel rank or
        # pipeline stage), averaged over the shares.
        losses = reduce_over_shares(torch.stack(self.losses).double().cpu(), topo) / topo.dp_size
        ranks = gather_times(self.times, topo.world_size)
        self.tracker.log_series("train_loss", first, losses.tolist())
        metrics = {"lr": lr, **interval_metrics(ranks)}
        # Steps of the job, not of each rank: under async updates ranks compute different
        # numbers of gradients in an interval, and the job's steps are the server's.
        wall = max(r.wall_seconds for r in ranks)
        metrics["samples_per_s"] = self.cfg.train.batch_size * steps / wall if wall > 0 else 0.0
        if self.throughput is not None:  # tokens/s and MFU
            metrics.update(self.throughput.metrics(metrics["samples_per_s"]))
        # Per step of the job (under async, ranks compute different numbers of gradients).
        sent = sum(r.bytes_sent for r in ranks) / len(ranks)
        metrics["comm_bytes_per_step"] = sent / steps
        self.totals["comm_bytes_total"] += sent
        self.totals["train_seconds"] += wall
        self.totals["steps_counted"] += steps
        metrics.update(comm_bytes_total=self.totals["comm_bytes_total"])
        metrics.update(train_seconds=self.totals["train_seconds"])
        self.closed += 1
        # The first interval of an attempt holds start-up effects (lazy allocations,
        # cold caches, ranks starting apart): it says nothing about a slow rank.
        suspects = find_stragglers(ranks, self.cfg.runtime.straggler_factor)
        for rank, ratio in suspects if self.closed > 1 else []:
            metrics[f"straggler_ratio/rank{rank}"] = ratio
            seen = self.stragglers.setdefault(rank, {"intervals": 0, "worst_ratio": 0.0})
            seen["intervals"] += 1
            seen["worst_ratio"] = max(seen["worst_ratio"], ratio)
            if topo.is_main:
                log.warning("straggler: rank %d is busy %.2fx the median rank", rank, ratio)
        metrics.update(gather_node_metrics(topo))
        self.tracker.log_metrics(metrics, step)
        self.last.update(train_loss=losses[-1].item(), **metrics)
        self.losses = []
        self.times.reset()
        return ranks

    def log_validation(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        metrics = {**metrics, "epoch": epoch}
        self.tracker.log_metrics(metrics, step)
        self.last.update(metrics)
        if self.topo.is_main:
            log.info("epoch %d step %d %s", epoch, step, metrics)

    def finish(self) -> None:
        if self.topo.is_main and self.stragglers:
            summary = ", ".join(
                f"rank {r} ({s['intervals']} intervals, up to {s['worst_ratio']:.2f}x median)"
                for r, s in sorted(self.stragglers.items())
            )
            self.tracker.set_tag("gradline.stragglers", summary)

    def result(self, step: int, instruments, stall_seconds: float) -> dict[str, Any]:
        """Rank 0's summary of the job, for result.json and the benchmarks."""
        return {
            **{k: v for k, v in self.last.items() if "/" not in k},
            "step": step,
            "stragglers": {str(r): s for r, s in self.stragglers.items()},
            # Step time of this attempt, validation excluded: what benchmarks compare.
            "loop_seconds": instruments.loop_seconds,
            "loop_steps": instruments.loop_steps,
            "checkpoint_stall_seconds": stall_seconds,
            # Over the whole job, not the last interval: what comparisons of rules use.
            "comm_bytes_per_step": self.totals["comm_bytes_total"]
            / max(self.totals["steps_counted"], 1.0),
        }


SYSTEM_METRICS = (
    "system_cpu_percent",
    "system_memory_percent",
    "process_rss_gb",
    "gpu_memory_allocated_gb",
    "gpu_max_memory_allocated_gb",
)


def system_metrics() -> dict[str, float]:
    """CPU and memory of this machine and process; GPU memory when CUDA is in use."""
    process = psutil.Process()
    metrics = {
        "system_cpu_percent": psutil.cpu_percent(interval=None),
        "system_memory_percent": psutil.virtual_memory().percent,
        "process_rss_gb": process.memory_info().rss / 2**30,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        metrics["gpu_memory_allocated_gb"] = torch.cuda.memory_allocated() / 2**30
        metrics["gpu_max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return metrics


def gather_node_metrics(topo: Topology) -> dict[str, float]:
    """Every node's CPU, memory (and GPU memory), measured by its first local rank and
    named by node: `system_cpu_percent/node1` (one all-gather per interval)."""
    mine = torch.full((2 + len(SYSTEM_METRICS),), float("nan"), dtype=torch.float64)
    if topo.local_rank == 0:
        found = system_metrics()
        mine[0] = float(topo.node_rank)
        mine[1:] = torch.tensor([1.0] + [found.get(k, float("nan")) for k in SYSTEM_METRICS])
    rows = [torch.zeros_like(mine) for _ in range(topo.world_size)]
    dist.all_gather(rows, mine)
    metrics = {}
    for row in rows:
        if row[1] != 1.0:  # not a node's first rank
            continue
        for key, value in zip(SYSTEM_METRICS, row[2:].tolist(), strict=True):
            if value == value:  # NaN: not measured on that node (no GPU)
                metrics[f"{key}/node{int(row[0])}"] = value
    return metrics
