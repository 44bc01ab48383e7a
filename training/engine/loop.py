"""The training loop each worker runs.

Read `train` top to bottom: set up (data, model, objective, parallelism), resume, then
steps. Each step reads this rank's slice of a global batch (ranks of one tensor- or
pipeline-parallel group read the same slice; under `balance: measured` slices follow
the ranks' throughput), runs forward and backward through the layout `parallelize` chose
(DDP, FSDP2/TP, or a pipeline schedule), steps the optimizer, and lets the update rule
sync the replicas when one is due (local SGD, DiLoCo). An async job (a parameter server)
runs segments between barriers instead (training.engine.async_loop). Every
`log_every_steps` the ranks exchange their time breakdown and losses; every
`checkpoint_every_steps` every rank writes its shard of a distributed checkpoint; every
`control_every_steps` the ranks agree on whether the job was asked to stop (preemption).
Tracking goes through the tracker (a no-op off rank 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from training.config import Config
from training.data.loader import LoaderPosition, RankLoader, open_reader, strided_rows
from training.data.shards import read_manifest
from training.data.spec import DataSpec
from training.engine.balance import Balancer
from training.engine.checkpoint import Checkpointer, find_latest, load_into
from training.engine.control import Control
from training.engine.health import record_failure
from training.engine.instruments import Instruments
from training.engine.intervals import IntervalLog
from training.engine.parallelize import Parallelized, parallelize
from training.engine.schedule import lr_at
from training.engine.state import clip_grad_norm
from training.engine.topology import (
    Topology,
    all_reduce_sum,
    broadcast_object,
    process_group,
    reduce_over_shares,
)
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
    # The control store (training.engine.control): set by the launcher.
    rdzv_endpoint: str = ""
    rdzv_id: str = ""


@record  # a worker's exception reaches the launcher's error report
def worker_main(job: TrainJob) -> dict[str, Any] | None:
    """Entry point of each worker process started by torch.distributed.elastic."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    _die_with_the_agent()
    cfg = Config.model_validate(job.config)
    topo = Topology.from_env(cfg.runtime.backend)
    # The mesh for the ranks actually started (the launcher's world size is the truth).
    topo = topo.with_mesh(cfg.parallel.degrees(topo.world_size))
    # N workers share the machine's cores: cap each so they don't oversubscribe.
    torch.set_num_threads(cfg.runtime.threads_per_worker)
    _set_determinism(cfg, topo)
    job_dir = JobDir(Path(job.job_dir))
    control = Control.connect(job.rdzv_endpoint, job.rdzv_id, cfg.runtime.collective_timeout_s)
    tracker = make_tracker(topo.is_main, job.tracking_uri, job.run_id, job_dir.journal)
    try:
        with process_group(topo, cfg.runtime.collective_timeout_s):
            return train(cfg, topo, job, tracker, control)
    except BaseException as exc:
        # Name the root cause for the launcher: the first rank to fail takes its peers
        # down with it, and elastic may report a peer's error instead.
        record_failure(control, topo.rank, exc)
        _exit_soon(10.0)
        raise


def _die_with_the_agent() -> None:
    """Linux: end this worker when its agent dies. A node whose agent was killed must
    leave the job, not keep a rank training that no agent watches or restarts."""
    import ctypes
    import signal
    import sys

    if sys.platform != "linux":
        return
    agent = os.getppid()  # may be 1 itself: the agent is PID 1 in many containers
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != agent:  # the agent died before prctl took effect
        os._exit(1)


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


def _step_seed(seed: int, topo: Topology, step: int) -> int:
    # Random streams (dropout) depend only on (seed, data-parallel rank, pipeline stage,
    # step): resume needs no RNG state, the ranks of one tensor-parallel group draw the
    # same masks, and two pipeline stages do not draw the same ones.
    return hash((seed, topo.dp_rank, topo.coordinate("pp"), step)) & 0x7FFF_FFFF_FFFF


@dataclass
class Setup:
    """Everything a worker builds before its first step."""

    manifest: dict[str, Any]
    data: DataSpec
    loader: RankLoader
    val_reader: Any
    val_rows: Any
    objective: Objective
    model: Parallelized  # with its optimizers (model.optimizer)
    total_steps: int
    sampler: Any  # language models: model -> sampled continuations of fixed prompts
    balancer: Balancer  # rows per rank of each global batch


def set_up(cfg: Config, topo: Topology, shard_dir: Path) -> Setup:
    from training.models import build_model, context_length

    manifest = read_manifest(shard_dir)
    data = DataSpec.from_manifest(manifest)
    context = context_length(cfg.model, cfg.task.type)
    quantum = cfg.train.grad_accum_steps  # every micro-batch gets rows
    balancer = Balancer(cfg.parallel, cfg.train.batch_size, topo.dp_rank, topo.dp_size, quantum)
    loader = RankLoader(
        open_reader(shard_dir, manifest, "train", context=context),
        rank=topo.dp_rank,
        world_size=topo.dp_size,
        global_batch=cfg.train.batch_size,
        seed=cfg.train.seed,
    )
    val_reader = open_reader(shard_dir, manifest, "val", context=context)
    objective = objective_for(cfg.task.type, data, _token_bytes(shard_dir, manifest))

    def build() -> torch.nn.Module:
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        return build_model(cfg.model, cfg.task.type, data)

    total = cfg.train.epochs * loader.batches_per_epoch
    total = min(total, cfg.train.max_steps or total)

    def before_server_step(version: int, _params) -> None:
        # An async job's optimizer steps happen on rank 0's parameter server: the same
        # schedule and clipping as a synchronous step (train_step).
        for group in model.optimizer.param_groups:
            group["lr"] = lr_at(version, total, cfg.optim)
        if cfg.optim.grad_clip:
            clip_grad_norm([model.ps.server_model], cfg.optim.grad_clip, replicated=True)

    model = parallelize(build, cfg, topo, objective.loss, before_server_step)
    return Setup(
        manifest=manifest,
        data=data,
        loader=loader,
        val_reader=val_reader,
        val_rows=strided_rows(val_reader.num_rows, topo.dp_size, topo.dp_rank),
        objective=objective,
        model=model,
        total_steps=total,
        sampler=_sampler(cfg, shard_dir, manifest, context),
        balancer=balancer,
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


def resume(
    setup: Setup, topo: Topology, job_dir: JobDir, intervals: IntervalLog
) -> tuple[LoaderPosition, int, str]:
    """Rank 0 picks the newest complete checkpoint, so every rank resumes from the same
    one; each rank then loads its own shards of it, whatever layout wrote it."""
    found = find_latest(job_dir.path) if topo.is_main else None
    chosen = broadcast_object((str(found[0]), found[1]) if found else None, topo)
    if not chosen:
        return LoaderPosition(), 0, ""
    resume_from, train_state = chosen
    state = setup.model.resume_state(train_state)
    shards = state.state_dict()  # this layout's shards, filled in place from the checkpoint
    load_into(Path(resume_from), shards)
    state.load_state_dict(shards)
    setup.balancer.restore(train_state.get("shares"))
    setup.loader.shares = setup.balancer.shares
    intervals.totals.update(train_state.get("totals", {}))
    step = int(train_state["step"])
    log.info("rank %d resumed from %s at step %d", topo.rank, resume_from, step)
    return LoaderPosition.from_state_dict(train_state["loader"]), step, resume_from


def train_step(cfg: Config, setup: Setup, topo: Topology, batch, step: int, inst) -> torch.Tensor:
    """One optimizer step on this rank's share of a global batch, then the update rule's
    sync if one is due; returns the share's loss (weighted by its size)."""
    x, y = batch
    model = setup.model
    measure = (step + 1) % cfg.runtime.log_every_steps == 0  # sample communication
    with inst.phase("compute", step):
        torch.manual_seed(_step_seed(cfg.train.seed, topo, step))
        inst.collective(step)
        outcome = model.forward_backward(
            x,
            y,
            setup.objective.loss,
            cfg.train.grad_accum_steps,
            lambda: _autocast(cfg, topo),
            measure,
            step=step,
            loss_scale=setup.balancer.loss_scale,
        )
    inst.times.bytes_sent += outcome.bytes_sent
    inst.move(outcome.sync_wait, "compute", "sync_wait")
    inst.move(outcome.bubble, "compute", "pipeline_bubble")
    inst.stretch(step, inst.last["compute"] - outcome.sync_wait - outcome.bubble)
    with inst.phase("optimizer", step):
        for group in setup.model.optimizer.param_groups:
            group["lr"] = lr_at(step, setup.total_steps, cfg.optim)
        if cfg.optim.grad_clip:
            model.clip_grad_norm(cfg.optim.grad_clip)
        setup.model.optimizer.step()
        setup.model.optimizer.zero_grad(set_to_none=True)
    with inst.phase("sync_wait", step):  # local SGD / DiLoCo: average every H steps
        inst.times.bytes_sent += model.after_step(step + 1)
    inst.step_done()
    return outcome.loss


def validate(cfg: Config, setup: Setup, topo: Topology) -> dict[str, float]:
    """The task's validation metrics over the whole split, each data-parallel share
    scoring its rows (under a pipeline, the last stage scores)."""
    model, batch_size = setup.model, cfg.evaluate.batch_size

    def reduce(stats: torch.Tensor) -> torch.Tensor:
        # A sharded or pipelined forward is a collective, so every rank must make the
        # same number of calls: shares with fewer rows run the difference on one row.
        if model.forward_is_collective:
            most = -(-setup.val_reader.num_rows // topo.dp_size)  # rows of the largest share
            spare = -(-most // batch_size) - (-(-len(setup.val_rows) // batch_size))
            x, _ = setup.val_reader.gather(np.arange(min(1, setup.val_reader.num_rows)))
            for _ in range(spare):
                model.forward(torch.from_numpy(x).to(topo.device))
        return reduce_over_shares(stats, topo)

    model.train(False)
    try:
        with torch.no_grad():
            return setup.objective.score(
                model.forward,
                setup.val_reader,
                setup.val_rows,
                batch_size,
                topo.device,
                reduce=reduce,
                prefix="val",
            )
    finally:
        model.train(True)


def _preempt_requested(control: Control, topo: Topology) -> bool:
    """True on every rank if a launcher on any node was asked to stop: rank 0 reads the
    store, one all-reduce tells the others."""
    flag = torch.tensor([float(topo.is_main and control.stop_requested())])
    return all_reduce_sum(flag).item() > 0


def train(
    cfg: Config, topo: Topology, job: TrainJob, tracker, control: Control
) -> dict[str, Any] | None:
    rt, job_dir = cfg.runtime, JobDir(Path(job.job_dir))
    setup = set_up(cfg, topo, Path(job.shard_dir))
    inst = Instruments(job_dir, topo.rank, control)
    intervals = IntervalLog(cfg, topo, setup, tracker, inst.times)
    position, step, resumed_from = resume(setup, topo, job_dir, intervals)
    inst.times.reset()  # the first interval's clock starts with training, not set-up
    checkpointer = Checkpointer.for_job(topo, job_dir.path, rt, tracker)
    checkpointer.last_step = step  # what we resumed from is on disk already
    progress = Progress("train", setup.total_steps, "steps", done=step) if topo.is_main else None
    on_gpu, preempted, started_at = topo.device.type == "cuda", False, step

    def save(step: int, position: LoaderPosition) -> None:
        train_state = {
            "step": step,
            "loader": position.state_dict(),
            "world_size": topo.world_size,
            "mesh": topo.mesh,
            "shares": setup.balancer.shares,
            "totals": dict(intervals.totals),
            **setup.model.checkpoint_info(),
        }
        with inst.phase("checkpoint_stall", step):
            checkpointer.save(step, setup.model.state.state_dict(), train_state, intervals.last)

    def evaluate(step: int, epoch: int) -> None:
        inst.collective(step)
        started = time.perf_counter()
        intervals.log_validation(validate(cfg, setup, topo), step, epoch)
        # Sampling runs the whole model: on rank 0 when it holds a replica, on every rank
        # together when it is sharded, not at all when it is cut into pipeline stages.
        whole, model = setup.model.whole, setup.model
        runs_here = topo.is_main or model.forward_is_collective
        if setup.sampler is not None and whole is not None and runs_here:
            text = setup.sampler(whole)
            if topo.is_main:
                tracker.log_text(text, f"samples/step-{step:08d}.txt")
        # Training time excludes validation: the interval's clock skips it.
        inst.times.started += time.perf_counter() - started

    if setup.model.asynchronous:  # segments between barriers, not lockstep steps
        from training.engine.async_loop import run_segments

        step, position, preempted = run_segments(
            cfg, setup, topo, control, inst, intervals, tracker, progress, save, evaluate, step
        )
    else:
        for epoch in range(position.epoch, cfg.train.epochs):
            start = position.batch_index if epoch == position.epoch else 0
            batches = setup.loader.tensors(epoch, start, rt.loader_workers, on_gpu)
            for index in range(start, setup.loader.batches_per_epoch):
                if preempted or step >= setup.total_steps:
                    break
                with inst.phase("data_wait", step):
                    x, y = next(batches)
                    if on_gpu:
                        x = x.to(topo.device, non_blocking=True)
                        y = y.to(topo.device, non_blocking=True)
                intervals.add_loss(train_step(cfg, setup, topo, (x, y), step, inst))
                step += 1
                if step == setup.total_steps:  # one model: local replicas average a last time
                    with inst.phase("sync_wait", step):
                        inst.times.bytes_sent += setup.model.finish(step)
                position = LoaderPosition(epoch=epoch, batch_index=index + 1)
                if progress is not None:
                    progress.advance()
                checkpoint_due = step % rt.checkpoint_every_steps == 0
                # A checkpoint closes the logging interval too: a job resumed from it must
                # find every step up to it already journaled, or its losses would be lost.
                if step % rt.log_every_steps == 0 or checkpoint_due:
                    inst.collective(step)
                    ranks = intervals.close(step, setup.model.optimizer.param_groups[0]["lr"])
                    if setup.balancer.remeasure(ranks, intervals.closed):
                        # New shares from the next global batch on: every rank re-reads.
                        setup.loader.shares = setup.balancer.shares
                        batches = setup.loader.tensors(epoch, index + 1, rt.loader_workers, on_gpu)
                        tracker.log_metrics(setup.balancer.metrics(), step)
                        if topo.is_main:
                            log.info("balance: rows per rank now %s", setup.balancer.shares)
                if checkpoint_due:
                    save(step, position)
                if rt.eval_every_steps and step % rt.eval_every_steps == 0:
                    evaluate(step, epoch)
                if step % rt.control_every_steps == 0:
                    inst.collective(step)
                    preempted = _preempt_requested(control, topo)
                if resumed_from and step == started_at + 1 and topo.is_main:
                    inst.resumed(step)
            if preempted:
                break
            if position.batch_index == setup.loader.batches_per_epoch:
                position = LoaderPosition(epoch=epoch + 1, batch_index=0)
            evaluate(step, epoch + 1)
            if step >= setup.total_steps:
                break

    if progress is not None:
        progress.close()
    intervals.close(step, setup.model.optimizer.param_groups[0]["lr"], final=True)
    save(step, position)  # the final (or preemption) state, always
    checkpointer.close()
    setup.model.close()
    intervals.finish()
    tracker.close()
    inst.close()
    if preempted:
        log.warning("rank %d: stopping at step %d on request (preemption)", topo.rank, step)
        return {"preempted": True, "step": step}
    if not topo.is_main:
        return None
    return intervals.result(step, inst, checkpointer.stall_seconds)
