"""Update rules and straggler mitigation on one small `gpt` job (2 ranks, gloo, 1 thread
per rank), each run through the real engine
on the same token shards (the standard library's source, bytes tokens), each through
the train stage's own lifecycle (training.mlops.jobs.run_job, tracking off).

Throughput is samples/s over the loop's own seconds (result `loop_seconds`: validation
and start-up excluded), relative to `sync` on clean ranks in the same repetition.

Every run pins each rank to its own core (runtime.pin_cpu_cores). A persistent straggler
is a device half as fast: a busy process pinned to rank 1's core for the whole run, so
rank 1 gets half of its core for everything it does (compute, optimizer, data, its share
of gloo's work, its threads), while rank 0 keeps a core of its own. The physical bounds
then hold: sync near 0.5 of clean sync, and nothing above the two ranks' capacity: 0.75
for a rule that all-reduces every step, and 0.75 / (1 - f) for one that does not (async),
where f is the share of a clean sync step spent in its all-reduce (sync_comm_fraction):
a rank that stops waiting for the all-reduce computes 1 / (1 - f) as many samples:
- sync_straggler_ratio:      sync under the straggler / clean sync
- balanced_straggler_ratio:  sync with parallel.balance=measured (rank 1 gets a smaller
                             share of each global batch) / clean sync      target >= 0.65
- async_straggler_ratio:     update.rule=async / clean sync                target >= 0.65
Transient stalls, `hiccup:rank=-1:prob=P:factor=10` (any rank stalls 10 times its own
work in a step, with probability P per step, burning its core):
- sync_transient_ratio, local_sgd_transient_ratio, async_transient_ratio: / clean sync
Communication, clean: bytes a rank sends per step (counted on the wire, over the whole
run: result `comm_bytes_per_step`) over sync's:
- local_sgd_comm_ratio:      local SGD, H=8, no warmup                     target <= 0.15
- powersgd_comm_ratio:       sync with grad_compression=powersgd (rank 4)  target <= 0.25
Quality at equal samples, clean, same steps: (final val_loss - sync's) / sync's:
- local_sgd_loss_delta, diloco_loss_delta, async_loss_delta, powersgd_loss_delta

Runs are interleaved (every scenario, then every scenario again) `--repeats` times, so
drift on a noisy host hits each alike; throughput ratios are medians of the ratios within
each repetition, the rest medians. A scenario that fails prints its error and gives nan.
Give it two otherwise idle cores (Linux: pinning needs sched_setaffinity). About 3.5
minutes a repetition on 2 quiet cores. The last line is key=value pairs.
Usage: python -m benchmarks.sync_modes [--steps 200] [--repeats 1] [--hiccup-prob 0.03]
       [--only sync,async_slow,...]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import fmt, use_throwaway_signing_key
from training.config import Config, DataConfig, ShardConfig
from training.data.ingest import ingest
from training.data.shards import write_shards
from training.mlops.jobs import JobRequest, run_job

DATA = {"source": "stdlib", "max_bytes": 600_000, "split_by": "document"}
MODEL = {"name": "gpt", "layers": 2, "heads": 2, "width": 64, "context": 32, "dropout": 0.0}
BATCH = 32
SLOW = "half of rank 1's core"  # a busy process shares rank 1's core (see slow_device)
HICCUP = "hiccup:rank=-1:step=0:prob={prob}:factor=10"
LOCAL_SGD = {"update": {"rule": "local_sgd", "sync_every": 8, "sync_warmup_steps": 0}}
ASYNC = {"update": {"rule": "async"}}
# name -> (sections changed from the base config, fault)
SCENARIOS: dict[str, tuple[dict, str]] = {
    "sync": ({}, ""),
    "local_sgd": (LOCAL_SGD, ""),
    "diloco": ({"update": {"rule": "diloco"}}, ""),
    "async": (ASYNC, ""),
    "powersgd": ({"update": {"grad_compression": "powersgd", "powersgd_rank": 4}}, ""),
    "sync_slow": ({}, SLOW),
    "balanced_slow": ({"parallel": {"balance": "measured"}}, SLOW),
    "async_slow": (ASYNC, SLOW),
    "sync_hiccup": ({}, HICCUP),
    "local_sgd_hiccup": (LOCAL_SGD, HICCUP),
    "async_hiccup": (ASYNC, HICCUP),
}
THROUGHPUT = {
    "sync_straggler_ratio": "sync_slow",
    "balanced_straggler_ratio": "balanced_slow",
    "async_straggler_ratio": "async_slow",
    "sync_transient_ratio": "sync_hiccup",
    "local_sgd_transient_ratio": "local_sgd_hiccup",
    "async_transient_ratio": "async_hiccup",
}
COMM = {"local_sgd_comm_ratio": "local_sgd", "powersgd_comm_ratio": "powersgd"}
QUALITY = {
    "local_sgd_loss_delta": "local_sgd",
    "diloco_loss_delta": "diloco",
    "async_loss_delta": "async",
    "powersgd_loss_delta": "powersgd",
}
# Throughput that cannot exceed the ranks' capacity (a check on the emulation itself).
BOUNDS = {
    "sync_straggler_ratio": "straggler_bound",
    "balanced_straggler_ratio": "straggler_bound",
    "async_straggler_ratio": "straggler_bound_without_step_sync",
}
TARGETS = {
    "balanced_straggler_ratio": (">=", 0.65),
    "async_straggler_ratio": (">=", 0.65),
    "local_sgd_comm_ratio": ("<=", 0.15),
    "powersgd_comm_ratio": ("<=", 0.25),
}


def config(steps: int, changes: dict) -> Config:
    return Config.model_validate(
        {
            "data": DATA,
            "task": {"type": "language_modeling"},
            "model": MODEL,
            "optim": {"warmup_steps": 10},
            "train": {"epochs": 1, "max_steps": steps, "batch_size": BATCH},
            "runtime": {
                "procs_per_node": 2,
                "threads_per_worker": 1,
                "pin_cpu_cores": True,
                "log_every_steps": 10,
                "checkpoint_every_steps": 10**6,  # the final checkpoint only
                "control_every_steps": 10,
                "max_restarts": 0,
                "collective_timeout_s": 120,
            },
            **changes,
        }
    )


def token_shards(folder: Path) -> Path:
    """The standard library's source as bytes tokens, through the real ingest and shard."""
    data = DataConfig(**DATA)
    raw, shards = folder / "raw", folder / "shards"
    report = folder / "ingest.json"
    ingest(data, folder, raw, folder / "quarantine", report, labels=None)
    write_shards(ShardConfig(target_shard_mb=1), raw, shards, "benchmark")
    return shards


def run(shards: Path, work: Path, cfg: Config, fault: str) -> dict:
    """One job through the train stage's lifecycle (tracking off); rank 0's result."""
    slow = fault == SLOW
    with slow_device(rank=1) if slow else contextlib.nullcontext():
        faults = "" if slow else fault
        request = JobRequest(cfg, shards, work / "ckpt", work / "model", faults=faults)
        return run_job(request).final


@contextlib.contextmanager
def slow_device(rank: int) -> Iterator[None]:
    """Local rank `rank`'s core shared with a busy process for the block (the ranks are
    pinned, rank r to the r-th core this process may use): that rank runs at half speed
    in everything it does, as on a device half as fast."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    hog = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def samples_per_s(result: dict) -> float:
    seconds = result.get("loop_seconds", 0.0)
    return result["loop_steps"] * BATCH / seconds if seconds else math.nan


def main() -> None:
    use_throwaway_signing_key()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--hiccup-prob", type=float, default=0.03)
    parser.add_argument(
        "--only", default=",".join(SCENARIOS), help="comma-separated scenarios (sync always)"
    )
    args = parser.parse_args()
    chosen = ["sync", *(s for s in args.only.split(",") if s and s != "sync")]
    for name in chosen:
        if name not in SCENARIOS:
            parser.error(f"--only: unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")

    nan = dict.fromkeys(
        ("samples_per_s", "interval_samples_per_s", "comm_bytes_per_step"), math.nan
    )
    nan["val_loss"] = nan["sync_fraction"] = math.nan
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shards = token_shards(folder)
        count = 0
        for repeat in range(args.repeats):  # interleaved: drift hits every scenario alike
            for name in chosen:
                changes, fault = SCENARIOS[name]
                fault = fault.format(prob=args.hiccup_prob)
                count += 1
                try:
                    result = run(shards, folder / f"run{count}", config(args.steps, changes), fault)
                except Exception as exc:  # a rule the engine cannot run yet: report, go on
                    print(f"{name} (repeat {repeat + 1}) failed: {exc}", file=sys.stderr)
                    runs[name].append(nan)
                    continue
                figures = {
                    "samples_per_s": samples_per_s(result),
                    # The last logging interval's wall-clock rate (slowest rank): a check
                    # on loop_seconds, which only counts the loop's timed phases.
                    "interval_samples_per_s": float(result.get("samples_per_s", math.nan)),
                    "comm_bytes_per_step": float(result.get("comm_bytes_per_step", math.nan)),
                    "val_loss": float(result.get("val_loss", math.nan)),
                    "sync_fraction": float(result.get("time_fraction_sync_wait", math.nan)),
                }
                runs[name].append(figures)
                print(
                    f"{name:<17} repeat {repeat + 1}: "
                    + "  ".join(f"{k}={fmt(v)}" for k, v in figures.items()),
                    file=sys.stderr,
                )

    def median(name: str, key: str) -> float:
        values = [r[key] for r in runs.get(name, [])]
        return statistics.median(values) if values else math.nan

    def paired(name: str) -> float:
        """Median over repetitions of throughput / clean sync's in the same repetition."""
        if name not in runs:
            return math.nan
        pairs = zip(runs[name], runs["sync"], strict=True)
        return statistics.median(a["samples_per_s"] / b["samples_per_s"] for a, b in pairs)

    sync_loss = median("sync", "val_loss")
    sync_bytes = median("sync", "comm_bytes_per_step")
    results: dict[str, float | int] = {"steps": args.steps, "repeats": args.repeats}
    results["sync_samples_per_s"] = median("sync", "samples_per_s")
    results |= {key: paired(name) for key, name in THROUGHPUT.items()}
    # The capacity bounds (module docstring): every-step all-reduce, and none.
    comm_fraction = median("sync", "sync_fraction")
    results["sync_comm_fraction"] = comm_fraction
    results["straggler_bound"] = 0.75
    results["straggler_bound_without_step_sync"] = 0.75 / (1 - comm_fraction)
    results |= {key: median(name, "comm_bytes_per_step") / sync_bytes for key, name in COMM.items()}
    results |= {
        key: (median(name, "val_loss") - sync_loss) / sync_loss for key, name in QUALITY.items()
    }
    results["hiccup_prob"] = args.hiccup_prob
    results["seconds"] = time.perf_counter() - started

    print(
        f"{'scenario':<17}{'samples/s':>11}{'last interval':>15}{'bytes/step':>12}{'val_loss':>10}"
    )
    for name in chosen:
        print(
            f"{name:<17}{fmt(median(name, 'samples_per_s')):>11}"
            f"{fmt(median(name, 'interval_samples_per_s')):>15}"
            f"{fmt(median(name, 'comm_bytes_per_step')):>12}{fmt(median(name, 'val_loss')):>10}"
        )
    for key, bound in BOUNDS.items():
        value, limit = results[key], results[bound]
        verdict = "not measured" if math.isnan(value) else "held" if value <= limit else "BROKEN"
        print(f"bound {key} <= {bound} {fmt(limit)}: {fmt(value)} ({verdict})")
    for key, (op, target) in TARGETS.items():
        value = results[key]
        met = value >= target if op == ">=" else value <= target
        verdict = "not measured" if math.isnan(value) else "met" if met else "NOT met"
        print(f"target {key} {op} {target}: {fmt(value)} ({verdict})")
    print(" ".join(f"{k}={fmt(v) if isinstance(v, float) else v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
