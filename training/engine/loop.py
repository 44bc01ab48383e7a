"""The training loop each worker runs.

Read `train` top to bottom: set up (data, model, objective, parallelism), resume, then
steps. Each step reads this rank's slice of a global batch, runs forward and backward
(under DDP the gradients are all-reduced during backward: a synchronous update), and
steps the optimizer. Every `log_every_steps` the ranks exchange their time breakdown and
losses; every `checkpoint_every_steps` rank 0 checkpoints; every `control_every_steps`
the ranks agree on whether the job was asked to stop (preemption). Side effects go
through the tracker (a no-op off rank 0) and rank 0's checkpointer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from training.config import Config
from training.data.loader import LoaderPosition, RankLoader, open_reader, strided_rows
from training.data.shards import read_manifest
from training.data.spec import DataSpec
from training.engine.checkpoint import Checkpointer, load_checkpoint, load_latest
from training.engine.health import record_failure
from training.engine.instruments import Instruments
from training.engine.intervals import IntervalLog
from training.engine.parallelize import Parallelized, parallelize
from training.engine.schedule import lr_at
from training.engine.topology import Topology, all_reduce_sum, broadcast_object, process_group
from training.errors import ConfigError
from training.objectives import Objective, objective_for
from training.progress import Progress
from training.project import JobDir
from training.tracking import make_tracker

log = logging.getLogger("gradline.train")


@dataclass(frozen=True)
class TrainJob:
    """What the launcher hands every worker; plain data so it pickles across spawn."""

    config: dict[str, Any]
    shard_dir: str
    job_dir: str
    model_dir: str
    tracking_uri: str | None
    run_id: str | None


@record  # a worker's exception reaches the launcher's error report
def worker_main(job: TrainJob) -> dict[str, Any] | None:
    """Entry point of each worker process started by torch.distributed.elastic."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = Config.model_validate(job.config)
    topo = Topology.from_env(cfg.runtime.backend)
    # N workers share the machine's cores: cap each so they don't oversubscribe.
    torch.set_num_threads(cfg.runtime.threads_per_worker)
    _set_determinism(cfg, topo)
    job_dir = JobDir(Path(job.job_dir))
    tracker = make_tracker(topo.is_main, job.tracking_uri, job.run_id, job_dir.journal)
    try:
        with process_group(topo, cfg.runtime.collective_timeout_s):
            return train(cfg, topo, job, tracker)
    except BaseException as exc:
        # Name the root cause for the launcher: the first rank to fail takes its peers
        # down with it, and elastic may report a peer's error instead.
        record_failure(job_dir.health, topo.rank, exc)
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


def _set_determinism(cfg: Config, topo: Topology) -> None:
    if not cfg.train.deterministic:
        return
    if topo.device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def _autocast(cfg: Config, topo: Topology) -> contextlib.AbstractContextManager:
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if topo.device.type == "cuda" else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext()
    if topo.device.type != "cuda":
        raise ConfigError("train.precision=bf16 needs CUDA; use auto or fp32 on CPU")
    return torch.autocast(device_type="cuda", dtype=torch.bfloat16)


def _step_seed(seed: int, rank: int, step: int) -> int:
    # Random streams (dropout) depend only on (seed, rank, step): resume needs no RNG state.
    return hash((seed, rank, step)) & 0x7FFF_FFFF_FFFF


@dataclass
class Setup:
    """Everything a worker builds before its first step."""

    manifest: dict[str, Any]
    data: DataSpec
    loader: RankLoader
    val_reader: Any
    val_rows: Any
    objective: Objective
    model: Parallelized
    optimizer: torch.optim.Optimizer
    total_steps: int
    sampler: Any  # language models: model -> sampled continuations of fixed prompts


def set_up(cfg: Config, topo: Topology, shard_dir: Path) -> Setup:
    from training.models import build_model, context_length

    manifest = read_manifest(shard_dir)
    data = DataSpec.from_manifest(manifest)
    context = context_length(cfg.model, cfg.task.type)
    loader = RankLoader(
        open_reader(shard_dir, manifest, "train", context=context),
        rank=topo.dp_rank,
        world_size=topo.dp_size,
        global_batch=cfg.train.batch_size,
        seed=cfg.train.seed,
    )
    val_reader = open_reader(shard_dir, manifest, "val", context=context)
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    model = parallelize(build_model(cfg.model, cfg.task.type, data), topo, cfg.train.compile)
    optim = cfg.optim
    optimizer = torch.optim.AdamW(
        model.module.parameters(), lr=optim.lr, weight_decay=optim.weight_decay
    )
    total = cfg.train.epochs * loader.batches_per_epoch
    return Setup(
        manifest=manifest,
        data=data,
        loader=loader,
        val_reader=val_reader,
        val_rows=strided_rows(val_reader.num_rows, topo.dp_size, topo.dp_rank),
        objective=objective_for(cfg.task.type, data, _token_bytes(shard_dir, manifest)),
        model=model,
        optimizer=optimizer,
        total_steps=min(total, cfg.train.max_steps or total),
        sampler=_sampler(cfg, shard_dir, manifest, context),
    )


def _token_bytes(shard_dir: Path, manifest: dict[str, Any]):
    if manifest.get("kind") != "tokens":
        return None
    from training.data.tokenizer import shard_tokenizer

    return shard_tokenizer(shard_dir, manifest).token_bytes()


def _sampler(cfg: Config, shard_dir: Path, manifest: dict[str, Any], context: int | None):
    """For language models, what a validation logs beside its metrics: continuations of
    the task's fixed prompts, so the run shows what the model writes as it learns."""
    if manifest.get("kind") != "tokens":
        return None
    from training.data.tokenizer import shard_tokenizer
    from training.evaluate import sample_text

    tokenizer, task = shard_tokenizer(shard_dir, manifest), cfg.task
    return lambda model: sample_text(
        model,
        tokenizer,
        task.prompts,
        task.max_new_tokens,
        task.temperature,
        task.top_k,
        context,
        seed=cfg.train.seed,
    )


def resume(setup: Setup, topo: Topology, job_dir: JobDir) -> tuple[LoaderPosition, int, str]:
    """Rank 0 picks the checkpoint, so every rank resumes from the same one."""
    found = load_latest(job_dir.path) if topo.is_main else None
    resume_from = broadcast_object(str(found[0]) if found else None, topo)
    if not resume_from:
        return LoaderPosition(), 0, ""
    state = found[1] if found else load_checkpoint(Path(resume_from))
    setup.model.module.load_state_dict(state["model"])
    setup.optimizer.load_state_dict(state["optimizer"])
    step = int(state["step"])
    log.info("rank %d resumed from %s at step %d", topo.rank, resume_from, step)
    return LoaderPosition.from_state_dict(state["loader"]), step, resume_from


def train_step(cfg: Config, setup: Setup, topo: Topology, batch, step: int, inst) -> torch.Tensor:
    """One optimizer step on this rank's share of a global batch; returns its mean loss."""
    x, y = batch
    model, accum = setup.model, cfg.train.grad_accum_steps
    with inst.phase("compute", step):
        torch.manual_seed(_step_seed(cfg.train.seed, topo.rank, step))
        loss_sum = torch.zeros((), device=topo.device)
        micro = zip(x.chunk(accum), y.chunk(accum), strict=True)
        for i, (xm, ym) in enumerate(micro):
            last = i == accum - 1
            # Only the last micro-batch synchronises; the others accumulate locally.
            with contextlib.nullcontext() if last else model.no_sync(), _autocast(cfg, topo):
                loss = setup.objective.loss(model.forward(xm).float(), ym) / accum
            if last:
                inst.collective(step)
            backward_started = time.perf_counter()
            loss.backward()
            loss_sum += loss.detach()
        waited = model.exposed_sync_wait(backward_started)
    inst.move(waited, "compute", "sync_wait")
    with inst.phase("optimizer", step):
        for group in setup.optimizer.param_groups:
            group["lr"] = lr_at(step, setup.total_steps, cfg.optim)
        if cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.module.parameters(), cfg.optim.grad_clip)
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
    inst.step_done()
    return loss_sum


def validate(cfg: Config, setup: Setup, topo: Topology) -> dict[str, float]:
    """The task's validation metrics over the whole split, every rank scoring its rows."""
    return setup.objective.score(
        setup.model.module,
        setup.val_reader,
        setup.val_rows,
        cfg.evaluate.batch_size,
        topo.device,
        reduce=all_reduce_sum,
        prefix="val",
    )


def _preempt_requested(job_dir: JobDir) -> bool:
    """True on every rank if any rank saw the launcher's stop request."""
    flag = torch.tensor([float(job_dir.preempt_request.exists())])
    return all_reduce_sum(flag).item() > 0


def train(cfg: Config, topo: Topology, job: TrainJob, tracker) -> dict[str, Any] | None:
    rt, job_dir = cfg.runtime, JobDir(Path(job.job_dir))
    setup = set_up(cfg, topo, Path(job.shard_dir))
    position, step, resumed_from = resume(setup, topo, job_dir)
    inst = Instruments(job_dir, topo.rank)
    intervals = IntervalLog(cfg, topo, setup, tracker, inst.times)
    checkpointer = Checkpointer.for_rank(topo, job_dir.path, rt, tracker)
    checkpointer.last_step = step  # what we resumed from is on disk already
    progress = Progress("train", setup.total_steps, "steps", done=step) if topo.is_main else None
    on_gpu, preempted, started_at = topo.device.type == "cuda", False, step

    def save() -> None:
        state = {
            "model": setup.model.module.state_dict(),
            "optimizer": setup.optimizer.state_dict(),
            "loader": position.state_dict(),
            "world_size": topo.world_size,
        }
        with inst.phase("checkpoint_stall", step):
            checkpointer.save(step, state, intervals.last)

    def evaluate(epoch: int) -> None:
        inst.collective(step)
        intervals.log_validation(validate(cfg, setup, topo), step, epoch)
        if setup.sampler is not None and topo.is_main:
            text = setup.sampler(setup.model.module)
            tracker.log_text(text, f"samples/step-{step:08d}.txt")

    for epoch in range(position.epoch, cfg.train.epochs):
        start = position.batch_index if epoch == position.epoch else 0
        batches = setup.loader.tensors(epoch, start, rt.loader_workers, on_gpu)
        for index in range(start, setup.loader.batches_per_epoch):
            if preempted or step >= setup.total_steps:
                break
            with inst.phase("data_wait", step):
                x, y = next(batches)
                if on_gpu:
                    x, y = x.to(topo.device, non_blocking=True), y.to(topo.device, True)
            intervals.add_loss(train_step(cfg, setup, topo, (x, y), step, inst))
            step += 1
            position = LoaderPosition(epoch=epoch, batch_index=index + 1)
            if progress is not None:
                progress.advance()
            checkpoint_due = step % rt.checkpoint_every_steps == 0
            # A checkpoint closes the logging interval too: a job resumed from it must
            # find every step up to it already journaled, or its losses would be lost.
            if step % rt.log_every_steps == 0 or checkpoint_due:
                inst.collective(step)
                intervals.close(step, setup.optimizer.param_groups[0]["lr"])
            if checkpoint_due:
                save()
            if rt.eval_every_steps and step % rt.eval_every_steps == 0:
                evaluate(epoch)
            if step % rt.control_every_steps == 0:
                inst.collective(step)
                preempted = _preempt_requested(job_dir)
            if resumed_from and step == started_at + 1 and topo.is_main:
                inst.resumed(step)
        if preempted:
            break
        if position.batch_index == setup.loader.batches_per_epoch:
            position = LoaderPosition(epoch=epoch + 1, batch_index=0)
        evaluate(epoch + 1)
        if step >= setup.total_steps:
            break

    if progress is not None:
        progress.close()
    intervals.close(step, setup.optimizer.param_groups[0]["lr"], final=True)
    save()  # the final (or preemption) state, always
    checkpointer.close()
    intervals.finish()
    tracker.close()
    inst.close()
    if preempted:
        log.warning("rank %d: stopping at step %d on request (preemption)", topo.rank, step)
        return {"preempted": True, "step": step}
    if not topo.is_main:
        return None
    save_trained_model(setup, cfg, Path(job.shard_dir), Path(job.model_dir))
    return intervals.result(step, inst, checkpointer.stall_seconds)


def save_trained_model(setup: Setup, cfg: Config, shard_dir: Path, model_dir: Path) -> None:
    """The final weights, what rebuilds them and, for language models, the tokenizer."""
    from training.models import ModelSpec, save_model_dir

    spec = ModelSpec(task=cfg.task.type, model=cfg.model.model_dump(), data=setup.data.to_dict())
    tokenizer = setup.manifest.get("tokenizer") or {}
    tokenizer_file = shard_dir / tokenizer["file"] if tokenizer.get("file") else None
    save_model_dir(setup.model.module, spec, model_dir, tokenizer_file)
