"""The training loop each worker runs: synchronous data parallelism with DDP.

Read it top to bottom: topology, data, model, resume; then epochs of steps. Each step
reads this rank's slice of a global batch, runs forward and backward (DDP all-reduces
the gradients during backward: a synchronous update), and steps the optimizer. Every
`log_every_steps` the ranks exchange their time breakdown and losses; every
`checkpoint_every_steps` rank 0 checkpoints; every `control_every_steps` the ranks agree
on whether the job was asked to stop (preemption). Side effects go through the tracker
(a no-op off rank 0) and rank 0's checkpointer.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

from training.atomic import atomic_dir, write_json
from training.checkpoint import Checkpointer, load_checkpoint, load_latest
from training.config import Config, TrainConfig
from training.data.loader import LoaderPosition, RankLoader, open_reader, strided_rows
from training.data.shards import read_manifest
from training.dist import (
    DistContext,
    all_reduce_sum,
    broadcast_object,
    process_group,
    wrap_data_parallel,
)
from training.errors import ConfigError
from training.faults import FaultPlan
from training.health import SYNC, Heartbeat, mark_resumed, record_failure
from training.models import ModelSpec, build_model
from training.progress import Progress
from training.schedule import lr_at
from training.timing import StepTimes, SyncTimer, find_stragglers, gather_times, interval_metrics
from training.tracking import make_tracker, system_metrics

log = logging.getLogger("gradline.train")

MODEL_WEIGHTS = "model.pt"
MODEL_SPEC = "spec.json"
PREEMPT_FILE = "PREEMPT"  # the launcher creates it on SIGTERM; ranks see it and stop
HEARTBEATS = "health"


@dataclass(frozen=True)
class TrainJob:
    """What the launcher hands every worker; plain data so it pickles across spawn."""

    config: dict[str, Any]
    shard_dir: str
    checkpoint_dir: str
    model_dir: str
    tracking_uri: str | None
    run_id: str | None


@record  # a worker's exception reaches the launcher's error report
def worker_main(job: TrainJob) -> dict[str, Any] | None:
    """Entry point of each worker process started by torch.distributed.elastic."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = Config.model_validate(job.config)
    ctx = DistContext.from_env(cfg.train.backend)
    # N workers share the machine's cores: cap each so they don't oversubscribe.
    torch.set_num_threads(cfg.train.threads_per_worker)
    _set_determinism(cfg.train, ctx)
    journal = Path(job.checkpoint_dir) / "tracking.jsonl"
    tracker = make_tracker(ctx.is_main, job.tracking_uri, job.run_id, journal)
    try:
        with process_group(ctx, cfg.train.collective_timeout_s):
            return train(cfg, ctx, job, tracker)
    except BaseException as exc:
        # Name the root cause for the launcher: the first rank to fail takes its peers
        # down with it, and elastic may report a peer's error instead.
        record_failure(Path(job.checkpoint_dir) / HEARTBEATS, ctx.rank, exc)
        _exit_soon(10.0)
        raise


def _exit_soon(seconds: float) -> None:
    """Bound the teardown of a failed worker: tearing down communication can block on a
    peer that is itself waiting in a collective, and a worker that never exits would
    keep the agent from restarting the job."""
    import threading

    timer = threading.Timer(seconds, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


def _set_determinism(tc: TrainConfig, ctx: DistContext) -> None:
    if not tc.deterministic:
        return
    if ctx.device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def _autocast(tc: TrainConfig, ctx: DistContext):
    precision = tc.precision
    if precision == "auto":
        precision = "bf16" if ctx.device.type == "cuda" else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext()
    if ctx.device.type != "cuda":
        raise ConfigError("train.precision=bf16 needs CUDA; use auto or fp32 on CPU")
    return torch.autocast(device_type="cuda", dtype=torch.bfloat16)


def _step_seed(seed: int, rank: int, step: int) -> int:
    # Random streams (dropout) depend only on (seed, rank, step): resume needs no RNG state.
    return hash((seed, rank, step)) & 0x7FFF_FFFF_FFFF


@torch.no_grad()
def _evaluate(model, reader, rows, ctx: DistContext, batch_size: int) -> dict[str, float]:
    """Loss and accuracy over this rank's rows, summed across ranks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for start in range(0, len(rows), batch_size):
        x, y = reader.gather(rows[start : start + batch_size])
        x, y = torch.from_numpy(x).to(ctx.device), torch.from_numpy(y).to(ctx.device)
        logits = model(x).float()
        totals[0] += F.cross_entropy(logits, y, reduction="sum").item()
        totals[1] += (logits.argmax(1) == y).sum().item()
        totals[2] += len(y)
    all_reduce_sum(totals)
    model.train()
    loss_sum, correct, count = totals.tolist()
    return {"val_loss": loss_sum / count, "val_accuracy": correct / count}


def _preempt_requested(checkpoint_dir: Path, ctx: DistContext) -> bool:
    """True on every rank if any rank saw the launcher's stop request."""
    flag = torch.tensor([float((checkpoint_dir / PREEMPT_FILE).exists())])
    return all_reduce_sum(flag).item() > 0


def train(cfg: Config, ctx: DistContext, job: TrainJob, tracker) -> dict[str, Any] | None:
    tc = cfg.train
    shard_dir, checkpoint_dir = Path(job.shard_dir), Path(job.checkpoint_dir)

    # --- data -----------------------------------------------------------------------
    manifest = read_manifest(shard_dir)
    loader = RankLoader(
        open_reader(shard_dir, manifest, "train"),
        rank=ctx.rank,
        world_size=ctx.world_size,
        global_batch=tc.batch_size,
        seed=tc.seed,
    )
    val_reader = open_reader(shard_dir, manifest, "val")
    val_rows = strided_rows(val_reader.num_rows, ctx.world_size, ctx.rank)
    total_steps = tc.epochs * loader.batches_per_epoch

    # --- model ----------------------------------------------------------------------
    spec = ModelSpec(
        in_features=math.prod(manifest["feature_shape"]),
        num_classes=manifest["num_classes"],
        hidden=tc.hidden,
        dropout=tc.dropout,
    )
    torch.manual_seed(tc.seed)  # same initial weights on every rank
    model = build_model(spec)
    ddp = wrap_data_parallel(model, ctx)
    sync_timer = SyncTimer(ctx.world_size)
    ddp.register_comm_hook(None, sync_timer.hook)
    forward = torch.compile(ddp) if tc.compile else ddp
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    autocast = _autocast(tc, ctx)

    # --- resume: rank 0 picks the checkpoint so every rank resumes from the same one --
    position, step = LoaderPosition(), 0
    found = load_latest(checkpoint_dir) if ctx.is_main else None
    resume_from = broadcast_object(str(found[0]) if found else None, ctx)
    if resume_from:
        state = found[1] if found else load_checkpoint(Path(resume_from))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        position = LoaderPosition.from_state_dict(state["loader"])
        step = int(state["step"])
        log.info("rank %d resumed from %s at step %d", ctx.rank, resume_from, step)

    checkpointer = (
        Checkpointer(
            checkpoint_dir, tc.keep_checkpoints, tc.async_checkpoint, tracker.log_checkpoint
        )
        if ctx.is_main
        else None
    )
    heartbeat = Heartbeat(checkpoint_dir / HEARTBEATS, ctx.rank)
    faults = FaultPlan.from_env(ctx.rank, checkpoint_dir / HEARTBEATS)
    loop_seconds, loop_steps, stall_seconds = 0.0, 0, 0.0
    times = StepTimes()
    losses: list[torch.Tensor] = []
    last_metrics: dict[str, float] = {}
    stragglers: dict[int, dict[str, float]] = {}
    intervals = 0  # logging intervals done in this attempt

    def checkpoint_state() -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "loader": position.state_dict(),
            "world_size": ctx.world_size,
        }

    saved_step = step

    def save_checkpoint() -> None:
        nonlocal saved_step, stall_seconds
        if checkpointer is not None and saved_step != step:
            stalled = checkpointer.save(step, checkpoint_state(), last_metrics)
            times.add("checkpoint_stall", stalled)
            stall_seconds += stalled
        saved_step = step

    def end_interval() -> None:
        """Exchange losses and time breakdown; rank 0 logs them and names stragglers."""
        nonlocal losses, intervals
        first = step - len(losses) + 1
        global_losses = all_reduce_sum(torch.stack(losses).double().cpu()) / ctx.world_size
        ranks = gather_times(times, ctx.world_size)
        tracker.log_series("train_loss", first, global_losses.tolist())
        metrics = {"lr": optimizer.param_groups[0]["lr"], **interval_metrics(ranks)}
        wall = max(r.per_step["wall"] for r in ranks)
        metrics["samples_per_s"] = tc.batch_size / wall if wall > 0 else 0.0
        intervals += 1
        # The first interval of an attempt holds start-up effects (lazy allocations,
        # cold caches, ranks starting apart): it says nothing about a slow rank.
        suspects = find_stragglers(ranks, tc.straggler_factor) if intervals > 1 else []
        for rank, ratio in suspects:
            metrics[f"straggler_ratio/rank{rank}"] = ratio
            seen = stragglers.setdefault(rank, {"intervals": 0, "worst_ratio": 0.0})
            seen["intervals"] += 1
            seen["worst_ratio"] = max(seen["worst_ratio"], ratio)
            if ctx.is_main:
                log.warning("straggler: rank %d is busy %.2fx the median rank", rank, ratio)
        if ctx.is_main:
            metrics.update(system_metrics())
        tracker.log_metrics(metrics, step)
        last_metrics.update(train_loss=global_losses[-1].item(), **metrics)
        losses = []
        times.reset()

    # --- the loop -------------------------------------------------------------------
    progress = Progress("train", total_steps, "steps", done=step) if ctx.is_main else None
    preempted = False
    on_gpu = ctx.device.type == "cuda"
    for epoch in range(position.epoch, tc.epochs):
        start = position.batch_index if epoch == position.epoch else 0
        batches = loader.tensors(epoch, start, tc.loader_workers, on_gpu)
        for index in range(start, loader.batches_per_epoch):
            step_started = time.perf_counter()
            heartbeat.beat(step, "data")
            waited = time.perf_counter()
            x, y = next(batches)
            if on_gpu:
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            times.add("data_wait", time.perf_counter() - waited)
            faults.at_step(step)

            started = time.perf_counter()
            heartbeat.beat(step, "compute")
            if spec.dropout:
                torch.manual_seed(_step_seed(tc.seed, ctx.rank, step))
            micro = zip(x.chunk(tc.grad_accum_steps), y.chunk(tc.grad_accum_steps), strict=True)
            loss_sum = torch.zeros((), device=ctx.device)
            for i, (xm, ym) in enumerate(micro):
                last = i == tc.grad_accum_steps - 1
                # Only the last micro-batch all-reduces; the others accumulate locally.
                with contextlib.nullcontext() if last else ddp.no_sync(), autocast:
                    loss = F.cross_entropy(forward(xm).float(), ym) / tc.grad_accum_steps
                if last:
                    heartbeat.beat(step, SYNC)
                backward_started = time.perf_counter()
                loss.backward()
                loss_sum += loss.detach()
            backward_done = time.perf_counter()
            exposed = backward_done - max(sync_timer.last_launch, backward_started)
            sync_wait = max(0.0, exposed) if ctx.world_size > 1 else 0.0
            times.add("compute", backward_done - started - sync_wait)
            times.add("sync_wait", sync_wait)

            heartbeat.beat(step, "optimizer")
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, tc)
            if tc.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.add("optimizer", time.perf_counter() - backward_done)

            step += 1
            times.steps += 1
            if progress is not None:
                progress.advance()
            losses.append(loss_sum)
            position = LoaderPosition(epoch=epoch, batch_index=index + 1)
            checkpoint_due = step % tc.checkpoint_every_steps == 0
            # A checkpoint closes the logging interval too: a job resumed from it must
            # find every step up to it already journaled, or its losses would be lost.
            if step % tc.log_every_steps == 0 or checkpoint_due:
                heartbeat.beat(step, SYNC)
                end_interval()
            if checkpoint_due:
                save_checkpoint()
            if step % tc.control_every_steps == 0:
                heartbeat.beat(step, SYNC)
                if _preempt_requested(checkpoint_dir, ctx):
                    preempted = True
                    break
            if resume_from and loop_steps == 0 and ctx.is_main:
                mark_resumed(checkpoint_dir / HEARTBEATS, step)
            loop_seconds += time.perf_counter() - step_started
            loop_steps += 1
        if preempted:
            break
        position = LoaderPosition(epoch=epoch + 1, batch_index=0)
        heartbeat.beat(step, SYNC)
        val = _evaluate(model, val_reader, val_rows, ctx, cfg.evaluate.batch_size)
        val["epoch"] = epoch + 1
        tracker.log_metrics(val, step)
        last_metrics.update(val)
        if ctx.is_main:
            log.info("epoch %d step %d %s", epoch + 1, step, val)

    if progress is not None:
        progress.close()
    if losses:
        heartbeat.beat(step, SYNC)
        end_interval()
    save_checkpoint()  # the final (or preemption) state, always
    if checkpointer is not None:
        checkpointer.close()
    if ctx.is_main and stragglers:
        summary = ", ".join(
            f"rank {r} ({s['intervals']} intervals, up to {s['worst_ratio']:.2f}x median)"
            for r, s in sorted(stragglers.items())
        )
        tracker.set_tag("gradline.stragglers", summary)
    tracker.close()
    heartbeat.close()
    if preempted:
        log.warning("rank %d: stopping at step %d on request (preemption)", ctx.rank, step)
        return {"preempted": True, "step": step}
    if ctx.is_main:
        save_model(model, spec, Path(job.model_dir))
        return {
            **{k: v for k, v in last_metrics.items() if "/" not in k},
            "step": step,
            "stragglers": {str(r): s for r, s in stragglers.items()},
            # Step time of this attempt, validation excluded: what benchmarks compare.
            "loop_seconds": loop_seconds,
            "loop_steps": loop_steps,
            "checkpoint_stall_seconds": stall_seconds,
        }
    return None


def save_model(model: torch.nn.Module, spec: ModelSpec, model_dir: Path) -> None:
    """The final weights and the spec to rebuild them; replaced whole, only on success."""
    with atomic_dir(model_dir) as staging:
        torch.save(model.state_dict(), staging / MODEL_WEIGHTS)
        write_json(staging / MODEL_SPEC, spec.to_dict())


def load_model(model_dir: Path) -> tuple[torch.nn.Module, ModelSpec]:
    import json

    spec = ModelSpec(**json.loads((model_dir / MODEL_SPEC).read_text()))
    model = build_model(spec)
    state = torch.load(model_dir / MODEL_WEIGHTS, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    model.eval()
    return model, spec
