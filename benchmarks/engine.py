"""The training engine against baselines run in this same process.

- overhead_ratio:     gradline steps/s over a minimal hand-written DDP loop (same model,
                      same data in memory, same ranks, same launcher);
- tracking_ratio:     gradline steps/s with MLflow logging on over off;
- ckpt_stall_ratio:   loop stall of asynchronous checkpoints over synchronous ones
                      (same state, same interval);
- scaling_efficiency: weak scaling, 2 ranks over 1 rank at the same per-rank batch, on a
                      compute-bound model: samples/s(2) / (2 x samples/s(1)); printed
                      beside minimal_scaling_efficiency, the hand-written loop's, which
                      shows what the host itself allows;
- recovery_s:         from a worker's SIGKILL to the first step after the resume.

Runs are interleaved (gradline, hand-written, tracked, ... then again), so drift on a
noisy host hits every side alike; each figure is the median of `--repeats` repetitions.
The last line is key=value pairs.
Usage: python -m benchmarks.engine [--steps 60] [--per-rank-batch 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.common import fmt, launch_local, make_synthetic_shards, use_throwaway_signing_key
from training.config import Config
from training.data.loader import open_reader
from training.data.manifest import read_manifest
from training.data.spec import DataSpec
from training.engine.topology import end_process_groups
from training.mlops.jobs import JobOutcome, JobRequest, run_job
from training.models.registry import build_model
from training.objectives import objective_for


def minimal_ddp_worker(shard_dir: str, cfg: dict, steps: int) -> dict | None:
    """What a user would write by hand: DDP over the same model, data held in memory."""
    config = Config.model_validate(cfg)
    torch.set_num_threads(config.runtime.threads_per_worker)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = read_manifest(Path(shard_dir))
    data = DataSpec.from_manifest(manifest)
    reader = open_reader(Path(shard_dir), manifest, "train")
    features, labels = reader.gather(np.arange(reader.num_rows))
    x_all, y_all = torch.from_numpy(features), torch.from_numpy(labels)
    torch.manual_seed(config.train.seed)
    model = torch.nn.parallel.DistributedDataParallel(
        build_model(config.model, "classification", data)
    )
    loss_fn = objective_for("classification", data).loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr)
    batch = config.train.batch_size
    per_rank = batch // world
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    for k in range(steps):
        idx = order[k * batch + rank * per_rank :][:per_rank]
        loss = loss_fn(model(x_all[idx]), y_all[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    elapsed = time.perf_counter() - started
    # The engine's own teardown: it lets gloo's threads retire the last all-reduces.
    end_process_groups()
    return {"loop_seconds": elapsed, "loop_steps": steps} if rank == 0 else None


def _launch_minimal(shards: Path, cfg: Config, steps: int) -> dict:
    world = cfg.runtime.procs_per_node
    return launch_local(minimal_ddp_worker, world, str(shards), cfg.model_dump(), steps)[0]


def _steps_per_s(result: dict) -> float:
    return result["loop_steps"] / result["loop_seconds"]


def config(base: dict, **changes: dict) -> Config:
    """The benchmark's Config: `base` and `changes` map sections to their keys."""
    sections = {name: {**values, **changes.get(name, {})} for name, values in base.items()}
    return Config.model_validate(sections)


class Bench:
    def __init__(self, folder: Path, shards: Path, base: dict) -> None:
        self.folder, self.shards, self.base = folder, shards, base
        self.runs = 0

    def gradline(self, tracking: bool = False, **changes: dict) -> JobOutcome:
        """One job through the train stage's lifecycle, into its own MLflow run when
        `tracking` (the model is not logged: the loop is what is measured)."""
        self.runs += 1
        work = self.folder / f"run{self.runs}"
        uri = f"sqlite:///{self.folder / 'mlflow.db'}" if tracking else None
        request = JobRequest(
            config(self.base, **changes),
            self.shards,
            work / "ckpt",
            work / "model",
            root=self.folder,
            tracking_uri=uri,
            log_model=False,
        )
        return run_job(request)


def main() -> None:
    use_throwaway_signing_key()
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--per-rank-batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = int(args.steps * args.per_rank_batch * 2 / 0.7) + 1000
        _, shards = make_synthetic_shards(folder, rows, args.features * 4)
        base = {
            "data": {"source": "synthetic"},
            "model": {"name": "mlp", "hidden": args.hidden, "depth": 2},
            # The hand-written loop neither clips nor schedules: the same math on both sides.
            "optim": {"warmup_steps": 0, "lr_schedule": "constant", "grad_clip": 0.0},
            "train": {"epochs": 1, "max_steps": args.steps, "batch_size": 2 * args.per_rank_batch},
            "runtime": {
                "procs_per_node": 2,
                "checkpoint_every_steps": 10**6,
                "log_every_steps": 20,
                "control_every_steps": 10,
                "max_restarts": 0,
            },
        }
        bench = Bench(folder, shards, base)
        one = {
            "runtime": {"procs_per_node": 1},
            "train": {"batch_size": args.per_rank_batch},
        }
        minimal, plain, tracked, one_rank, minimal_one = [], [], [], [], []
        for _ in range(args.repeats):  # interleaved, so drift hits every side alike
            minimal.append(_launch_minimal(shards, config(base), args.steps))
            plain.append(bench.gradline().final)
            tracked.append(bench.gradline(tracking=True).final)
            one_rank.append(bench.gradline(**one).final)
            minimal_one.append(_launch_minimal(shards, config(base, **one), args.steps))
        every_10 = {"checkpoint_every_steps": 10}
        async_ = bench.gradline(runtime={**every_10, "async_checkpoint": True}).final
        sync = bench.gradline(runtime={**every_10, "async_checkpoint": False}).final
        os.environ["GRADLINE_FAULT"] = f"kill:rank=1:step={args.steps // 2}:attempt=0"
        try:
            runtime = {"max_restarts": 1, "checkpoint_every_steps": args.steps // 4}
            recovered = bench.gradline(runtime=runtime)
        finally:
            del os.environ["GRADLINE_FAULT"]
        health = recovered.job.job_dir.health
        killed = json.loads((health / "killed.json").read_text())["time"]
        resumed = json.loads((health / "resumed.json").read_text())["time"]

    median = lambda runs: statistics.median(_steps_per_s(r) for r in runs)  # noqa: E731

    def paired(numerators: list[dict], denominators: list[dict]) -> float:
        """Median over repetitions of the ratio within each repetition (run side by side)."""
        pairs = zip(numerators, denominators, strict=True)
        return statistics.median(_steps_per_s(a) / _steps_per_s(b) for a, b in pairs)

    two_rank_sps = median(plain) * 2 * args.per_rank_batch
    one_rank_sps = median(one_rank) * args.per_rank_batch
    results = {
        "steps": args.steps,
        "repeats": args.repeats,
        "hidden": args.hidden,
        "per_rank_batch": args.per_rank_batch,
        "gradline_steps_per_s": median(plain),
        "minimal_steps_per_s": median(minimal),
        "overhead_ratio": paired(plain, minimal),
        "tracking_ratio": paired(tracked, plain),
        "ckpt_stall_async_s": async_["checkpoint_stall_seconds"],
        "ckpt_stall_sync_s": sync["checkpoint_stall_seconds"],
        "ckpt_stall_ratio": async_["checkpoint_stall_seconds"] / sync["checkpoint_stall_seconds"],
        "sync_wait_fraction_2_ranks": plain[-1]["time_fraction_sync_wait"],
        "scaling_efficiency": two_rank_sps / (2 * one_rank_sps),
        # The same weak-scaling measure for the hand-written loop: what this host allows.
        "minimal_scaling_efficiency": paired(minimal, minimal_one),
        "recovery_s": resumed - killed,
    }
    print(" ".join(f"{k}={fmt(v) if isinstance(v, float) else v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
