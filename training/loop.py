"""The training loop each worker runs: synchronous data parallelism with DDP.

Read it top to bottom: build the topology, the data, the model; resume if a checkpoint
exists; then epochs of steps, a validation pass per epoch and a checkpoint every few
epochs. Side effects go through the tracker (a no-op off rank 0) and through rank 0's
checkpoint writes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from training.atomic import atomic_dir, write_json
from training.checkpoint import load_checkpoint, load_latest, save_checkpoint
from training.config import Config
from training.data.loader import LoaderPosition, RankLoader, open_reader, strided_rows
from training.data.shards import read_manifest
from training.dist import (
    DistContext,
    all_reduce_sum,
    broadcast_object,
    process_group,
    wrap_data_parallel,
)
from training.models import ModelSpec, build_model
from training.tracking import make_tracker

log = logging.getLogger("gradline.train")

MODEL_WEIGHTS = "model.pt"
MODEL_SPEC = "spec.json"


@dataclass(frozen=True)
class TrainJob:
    """What the launcher hands every worker; plain data so it pickles across spawn."""

    config: dict[str, Any]
    shard_dir: str
    checkpoint_dir: str
    model_dir: str
    tracking_uri: str | None
    run_id: str | None


def worker_main(job: TrainJob) -> dict[str, float] | None:
    """Entry point of each worker process started by torch.distributed.elastic."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = Config.model_validate(job.config)
    ctx = DistContext.from_env(cfg.train.backend)
    # N workers share the machine's cores: cap each so they don't oversubscribe.
    torch.set_num_threads(cfg.train.threads_per_worker)
    with process_group(ctx):
        return train(cfg, ctx, job)


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
        logits = model(x)
        totals[0] += F.cross_entropy(logits, y, reduction="sum").item()
        totals[1] += (logits.argmax(1) == y).sum().item()
        totals[2] += len(y)
    all_reduce_sum(totals)
    model.train()
    loss_sum, correct, count = totals.tolist()
    return {"val_loss": loss_sum / count, "val_accuracy": correct / count}


def train(cfg: Config, ctx: DistContext, job: TrainJob) -> dict[str, float] | None:
    tc = cfg.train
    shard_dir = Path(job.shard_dir)
    manifest = read_manifest(shard_dir)
    train_reader = open_reader(shard_dir, manifest, "train")
    val_reader = open_reader(shard_dir, manifest, "val")
    loader = RankLoader(
        train_reader,
        rank=ctx.rank,
        world_size=ctx.world_size,
        global_batch=tc.batch_size,
        seed=tc.seed,
    )
    val_rows = strided_rows(val_reader.num_rows, ctx.world_size, ctx.rank)

    spec = ModelSpec(
        in_features=math.prod(manifest["feature_shape"]),
        num_classes=manifest["num_classes"],
        hidden=tc.hidden,
        dropout=tc.dropout,
    )
    torch.manual_seed(tc.seed)  # same initial weights on every rank
    model = build_model(spec)
    ddp = wrap_data_parallel(model, ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)

    checkpoint_dir = Path(job.checkpoint_dir)
    position, step = LoaderPosition(), 0
    # Rank 0 chooses the checkpoint so every rank resumes from the same one.
    found = load_latest(checkpoint_dir) if ctx.is_main else None
    resume_from = broadcast_object(str(found[0]) if found else None, ctx)
    if resume_from:
        state = found[1] if found else load_checkpoint(Path(resume_from))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        position = LoaderPosition.from_state_dict(state["loader"])
        step = int(state["step"])
        log.info("rank %d resumed from %s at step %d", ctx.rank, resume_from, step)

    tracker = make_tracker(ctx.is_main, job.tracking_uri, job.run_id)
    last_val: dict[str, float] = {}
    for epoch in range(position.epoch, tc.epochs):
        start_batch = position.batch_index if epoch == position.epoch else 0
        losses: list[torch.Tensor] = []
        first_step = step + 1
        started = time.perf_counter()
        data_wait = 0.0
        batches = loader.tensors(epoch, start_batch, tc.loader_workers, ctx.device.type == "cuda")
        while True:
            waited = time.perf_counter()
            batch = next(batches, None)
            data_wait += time.perf_counter() - waited
            if batch is None:
                break
            torch.manual_seed(_step_seed(tc.seed, ctx.rank, step))
            x, y = batch[0].to(ctx.device, non_blocking=True), batch[1].to(ctx.device)
            loss = F.cross_entropy(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces gradients here: a synchronous update
            optimizer.step()
            losses.append(loss.detach())
            step += 1
        elapsed = time.perf_counter() - started
        # One collective per epoch turns the per-rank losses into global-batch losses.
        global_losses = all_reduce_sum(torch.stack(losses).cpu().double()) / ctx.world_size
        for offset, value in enumerate(global_losses.tolist()):
            tracker.log_metrics({"train_loss": value}, first_step + offset)
        steps_done = len(losses)
        last_val = _evaluate(model, val_reader, val_rows, ctx, cfg.evaluate.batch_size)
        last_val["samples_per_s"] = steps_done * tc.batch_size / max(elapsed, 1e-9)
        last_val["data_wait_fraction"] = data_wait / max(elapsed, 1e-9)
        last_val["epoch"] = epoch + 1
        tracker.log_metrics(last_val, step)
        if ctx.is_main:
            log.info("epoch %d step %d %s", epoch + 1, step, last_val)
        position = LoaderPosition(epoch=epoch + 1, batch_index=0)
        final = epoch + 1 == tc.epochs
        if ctx.is_main and ((epoch + 1) % tc.checkpoint_every == 0 or final):
            path = save_checkpoint(
                checkpoint_dir,
                step,
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": position.state_dict(),
                    "world_size": ctx.world_size,
                },
                keep=tc.keep_checkpoints,
            )
            tracker.flush()
            tracker.log_artifact(path, "checkpoints")

    tracker.flush()
    if ctx.is_main:
        save_model(model, spec, Path(job.model_dir))
        return {**last_val, "step": step}
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
