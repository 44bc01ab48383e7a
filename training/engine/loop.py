"""The training loop each worker runs.

Read `train` top to bottom: set up (data, model, objective, layout), resume, then run
from barrier to barrier. A barrier is a step where every rank must meet: a logging,
checkpoint, validation or (for synchronous rules) control interval, an epoch's end, the
last step. Between barriers the layout's update rule advances the job
(training.engine.steps): synchronous rules take each step in lockstep through `Work`
(this rank's slice of a global batch, forward and backward through the layout, the
optimizer, the rule's sync when one is due); asynchronous updates hand this rank's
gradients to a parameter server. At a barrier the ranks exchange their time breakdown
and losses, write their shards of a distributed checkpoint, validate, and agree on
whether the job was asked to stop (preemption). Tracking goes through the tracker (a
no-op off rank 0).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.config import Config, RuntimeConfig
from training.data.loader import LoaderPosition, RankLoader, open_reader, strided_rows
from training.data.manifest import read_manifest
from training.data.spec import DataSpec
from training.data.tokenizer import shard_tokenizer
from training.engine.balance import Balancer
from training.engine.checkpoint import Checkpointer, checkpoint_dir, find_latest, load_into
from training.engine.control import Control
from training.engine.faults import PoisonableLoss
from training.engine.flops import Throughput, measure_throughput
from training.engine.instruments import Instruments
from training.engine.intervals import IntervalLog
from training.engine.job import TrainJob
from training.engine.jobdir import JobDir
from training.engine.micro_batch import resolve_micro_batch
from training.engine.nonfinite import NonFiniteGuard, weights_are_finite
from training.engine.parallelize import parallelize
from training.engine.resume_record import AttemptRecord, Origin
from training.engine.schedule import lr_at
from training.engine.selection import Selection, record_selection
from training.engine.steps import Layout, Segment, StepInputs
from training.engine.topology import Topology, all_reduce_sum, broadcast_object, reduce_over_shares
from training.engine.tracker import Tracker
from training.errors import ConfigError
from training.models.registry import build_model, context_length
from training.objectives import objective_for
from training.objectives.base import Objective
from training.progress import Progress
from training.timings import timed_span

log = logging.getLogger("gradline.train")


def autocast_for(
    precision: str, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager]:
    """The mixed precision of every forward: bf16 autocast on CUDA under auto."""
    if not uses_bf16(precision, device):
        return contextlib.nullcontext
    if device.type != "cuda":
        raise ConfigError("train.precision=bf16 needs CUDA; use auto or fp32 on CPU")
    return lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)


def uses_bf16(precision: str, device: torch.device) -> bool:
    """Whether the forwards run under bf16 autocast: asked for, or auto on CUDA."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def step_seed(seed: int, topo: Topology, step: int) -> int:
    # Random streams (dropout) depend only on (seed, data-parallel rank, pipeline stage,
    # step): resume needs no RNG state, the ranks of one tensor-parallel group draw the
    # same masks, and two pipeline stages do not draw the same ones.
    return hash((seed, topo.dp_rank, topo.coordinate("pp"), step)) & 0x7FFF_FFFF_FFFF


def seed_step(seed: int, topo: Topology, step: int) -> None:
    """Seed the streams a step draws from: the CPU's and, on CUDA, this rank's device's.
    Not `torch.manual_seed`, which seeds every accelerator type torch knows and queues the
    call for each one not initialized (XPU, MTIA; CUDA on a CPU) with a formatted stack
    trace of its caller: 0.1 to 0.4 ms a step, all of it waste here."""
    value = step_seed(seed, topo, step)
    torch.default_generator.manual_seed(value)
    if topo.device.type == "cuda":
        torch.cuda.manual_seed(value)  # the current device, which is this rank's


@dataclass
class Setup:
    """Everything a worker builds before its first step."""

    cfg: Config  # the job's, with what set-up chose (micro_batch: auto's accumulation)
    data: DataSpec
    loader: RankLoader
    val_reader: Any
    val_rows: np.ndarray
    objective: Objective
    layout: Layout  # how the model is spread over the ranks, with its update rule
    total_steps: int
    sampler: Callable[[torch.nn.Module], str] | None  # what a validation shows, if anything
    balancer: Balancer  # rows per rank of each global batch
    loss: PoisonableLoss  # the objective's loss, which the `nan` fault can poison
    throughput: Throughput  # samples/s to tokens/s and MFU


def set_up(cfg: Config, topo: Topology, shard_dir: Path) -> Setup:
    manifest = read_manifest(shard_dir)
    data = DataSpec.from_manifest(manifest)
    context = context_length(cfg.model, data.kind)
    val_reader = open_reader(shard_dir, manifest, "val", context=context)
    example = torch.from_numpy(val_reader.gather(np.arange(min(2, val_reader.num_rows)))[0])
    autocast = autocast_for(cfg.train.precision, topo.device)

    def build() -> torch.nn.Module:
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        return build_model(cfg.model, cfg.task.type, data)

    cfg = resolve_micro_batch(cfg, topo, build, example, autocast)
    quantum = cfg.train.grad_accum_steps  # every micro-batch gets rows
    balancer = Balancer(cfg.parallel, cfg.train.batch_size, topo.dp_rank, topo.dp_size, quantum)
    loader = RankLoader(
        open_reader(shard_dir, manifest, "train", context=context),
        rank=topo.dp_rank,
        world_size=topo.dp_size,
        global_batch=cfg.train.batch_size,
        seed=cfg.train.seed,
    )
    tokenizer = shard_tokenizer(shard_dir, manifest) if data.kind == "tokens" else None
    objective = objective_for(cfg.task.type, data, tokenizer)
    total = cfg.train.epochs * loader.batches_per_epoch
    total = min(total, cfg.train.max_steps or total)
    loss = PoisonableLoss(objective.loss)
    throughput = measure_throughput(
        build,
        example,
        topo.device,
        uses_bf16(cfg.train.precision, topo.device),
        cfg.runtime.peak_tflops,
        context,
    )

    def schedule(step: int) -> float:
        return lr_at(step, total, cfg.optim)

    layout = parallelize(build, cfg, topo, loss, autocast, schedule)
    return Setup(
        cfg=cfg,
        data=data,
        loader=loader,
        val_reader=val_reader,
        val_rows=strided_rows(val_reader.num_rows, topo.dp_size, topo.dp_rank),
        objective=objective,
        layout=layout,
        total_steps=total,
        sampler=objective.sampler(cfg.generation(), context),
        balancer=balancer,
        loss=loss,
        throughput=throughput,
    )


def resume(
    setup: Setup, topo: Topology, job_dir: JobDir, intervals: IntervalLog, selection: Selection
) -> tuple[int, Origin | None]:
    """Rank 0 picks the newest complete checkpoint, so every rank resumes from the same
    one; each rank then loads its own shards of it, whatever layout wrote it. Returns the
    step to continue from and the checkpoint (None when starting afresh)."""
    found = find_latest(job_dir.path) if topo.is_main else None
    chosen = broadcast_object((str(found[0]), found[1]) if found else None, topo)
    if not chosen:
        return 0, None
    resume_from, train_state = chosen
    state = setup.layout.resume_state(train_state)
    shards = state.state_dict()  # this layout's shards, filled in place from the checkpoint
    load_into(Path(resume_from), shards)
    state.load_state_dict(shards)
    setup.balancer.restore(train_state.get("shares"))
    setup.loader.shares = setup.balancer.shares
    intervals.totals.update(train_state.get("totals", {}))
    selection.restore(train_state.get("selection"))
    step = int(train_state["step"])
    position = LoaderPosition.from_state_dict(train_state["loader"])
    if (position.epoch, position.batch_index) != divmod(step, setup.loader.batches_per_epoch):
        raise ConfigError(
            f"{resume_from} stands at step {step} but at epoch {position.epoch}, batch "
            f"{position.batch_index} of the data: it was written for other data or another "
            "train.batch_size; start a new job (gradline run --force)"
        )
    log.info("rank %d resumed from %s at step %d", topo.rank, resume_from, step)
    return step, Origin.of(Path(resume_from), train_state)


class StepBatches:
    """This rank's batch of step n, read in order (a new reader on a jump or a new share)."""

    def __init__(self, loader: RankLoader, workers: int, device: torch.device) -> None:
        self.loader, self.workers, self.device = loader, workers, device
        self.expected, self.batches = -1, None

    def reset(self) -> None:
        """The shares changed: the next batch is read with them."""
        self.expected = -1

    def get(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = divmod(n, self.loader.batches_per_epoch)
        if n != self.expected or index == 0:
            on_gpu = self.device.type == "cuda"
            self.batches: Iterator = self.loader.tensors(epoch, index, self.workers, on_gpu)
        self.expected = n + 1
        x, y = next(self.batches)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


class Work:
    """This rank's work for step n (training.engine.steps.StepWork): its gradient, or a
    whole synchronous step."""

    def __init__(
        self,
        cfg: Config,
        setup: Setup,
        topo: Topology,
        inst: Instruments,
        record: AttemptRecord,
        guard: NonFiniteGuard,
    ) -> None:
        self.cfg, self.setup, self.topo, self.inst, self.guard = cfg, setup, topo, inst, guard
        self.batches = StepBatches(setup.loader, cfg.runtime.loader_workers, topo.device)
        self.record: AttemptRecord | None = record  # until this attempt's first step ends

    def _inputs(self, n: int, **extra) -> StepInputs:
        with self.inst.phase("data_wait", n):
            x, y = self.batches.get(n)
        self.inst.stretch(n, self.inst.last["data_wait"], "data_wait")
        micro = self.cfg.train.grad_accum_steps
        return StepInputs(x, y, n, micro, **extra)

    def gradient(self, n: int) -> tuple[float, int]:
        inputs, inst = self._inputs(n), self.inst
        with inst.phase("compute", n):
            seed_step(self.cfg.train.seed, self.topo, n)
            outcome = self.setup.layout.forward_backward(inputs)
        inst.stretch(n, inst.last["compute"])
        self._done(n)
        return outcome.loss.item(), len(inputs.x)

    def step(self, n: int) -> torch.Tensor:
        cfg, layout, inst = self.cfg, self.setup.layout, self.inst
        measure = (n + 1) % cfg.runtime.log_every_steps == 0  # sample communication
        inputs = self._inputs(n, loss_scale=self.setup.balancer.loss_scale, measure_comm=measure)
        self.setup.loss.poisoned = inst.faults.poisons_loss(n)
        with inst.phase("compute", n):
            seed_step(cfg.train.seed, self.topo, n)
            inst.collective(n)
            outcome = layout.forward_backward(inputs)
        inst.times.bytes_sent += outcome.bytes_sent
        inst.move(outcome.sync_wait, "compute", "sync_wait")
        inst.move(outcome.bubble, "compute", "pipeline_bubble")
        inst.stretch(n, inst.last["compute"] - outcome.sync_wait - outcome.bubble)
        lr = lr_at(n, self.setup.total_steps, cfg.optim)
        with inst.phase("optimizer", n):
            stepped = layout.optimizer_step(lr, cfg.optim.grad_clip)
        inst.stretch(n, inst.last["optimizer"], "optimizer")
        self.guard.record(n, stepped, lr)
        with inst.phase("sync_wait", n):  # local SGD / DiLoCo: average every H steps
            inst.times.bytes_sent += layout.after_step(n + 1)
        self._done(n)
        return outcome.loss

    def _done(self, n: int) -> None:
        self.inst.step_done()
        if self.record is not None:  # this attempt's first step: where it really began
            self.record.first_step_done(n)
            self.record = None


class Barriers:
    """The steps where every rank meets, and which of them check for a stop request.

    A synchronous rule can stop at any step, so it checks every control_every_steps; an
    asynchronous one only meets at barriers, so it checks at every barrier rather than
    add control intervals as barriers of their own."""

    def __init__(self, rt: RuntimeConfig, per_epoch: int, total: int, lockstep: bool) -> None:
        intervals = [rt.log_every_steps, rt.checkpoint_every_steps, rt.eval_every_steps]
        if lockstep:
            intervals.append(rt.control_every_steps)
        self.intervals = [i for i in (*intervals, per_epoch) if i]
        self.total, self.rt, self.lockstep = total, rt, lockstep

    def next(self, step: int) -> int:
        return min([self.total, *((step // i + 1) * i for i in self.intervals)])

    def stop_check_due(self, step: int) -> bool:
        return not self.lockstep or step % self.rt.control_every_steps == 0


def validate(cfg: Config, setup: Setup, topo: Topology) -> dict[str, float]:
    """The task's validation metrics over the whole split, each data-parallel share
    scoring its rows (under a pipeline, the last stage scores)."""
    layout, batch_size = setup.layout, cfg.evaluate.batch_size

    def reduce(stats: torch.Tensor) -> torch.Tensor:
        # A sharded or pipelined forward is a collective, so every rank must make the
        # same number of calls: shares with fewer rows run the difference on one row.
        if layout.forward_is_collective:
            most = -(-setup.val_reader.num_rows // topo.dp_size)  # rows of the largest share
            spare = -(-most // batch_size) - (-(-len(setup.val_rows) // batch_size))
            x, _ = setup.val_reader.gather(np.arange(min(1, setup.val_reader.num_rows)))
            for _ in range(spare):
                layout.forward(torch.from_numpy(x).to(topo.device))
        return reduce_over_shares(stats, topo)

    layout.train(False)
    try:
        with torch.no_grad():
            return setup.objective.score(
                layout.forward,
                setup.val_reader,
                setup.val_rows,
                batch_size,
                topo.device,
                reduce=reduce,
                prefix="val",
            ).metrics
    finally:
        layout.train(True)


def _stop_requested(control: Control, topo: Topology) -> bool:
    """True on every rank if a launcher on any node was asked to stop: rank 0 reads the
    store, one all-reduce tells the others."""
    flag = torch.tensor([float(topo.is_main and control.stop_requested())])
    return all_reduce_sum(flag).item() > 0


class Attempt:
    """One attempt of the job on this rank, resumed from the newest checkpoint: what the
    steps and the barriers share."""

    def __init__(
        self,
        cfg: Config,
        topo: Topology,
        setup: Setup,
        job: TrainJob,
        tracker: Tracker,
        control: Control,
    ) -> None:
        self.cfg, self.topo, self.setup, self.tracker, self.control = (
            cfg, topo, setup, tracker, control
        )  # fmt: skip
        job_dir = JobDir(Path(job.job_dir))
        self.per_epoch = setup.loader.batches_per_epoch
        self.inst = Instruments(job_dir, topo, control, job.faults)
        self.intervals = IntervalLog(cfg, topo, tracker, self.inst.times, setup.throughput)
        self.selection = Selection.for_config(cfg)
        self.start, origin = resume(setup, topo, job_dir, self.intervals, self.selection)
        self.stopped_early = False
        self.inst.times.reset()  # the first interval's clock starts with training
        self.checkpointer = Checkpointer.for_job(topo, job_dir.path, cfg.runtime, tracker)
        self.checkpoints = job_dir.path
        self.checkpointer.last_step = self.start  # what we resumed from is on disk already
        self.checkpointer.pinned = self.selection.best_step
        skipped = int(self.intervals.totals.get("nonfinite_steps", 0))
        self.guard = NonFiniteGuard(cfg.train.max_nonfinite_steps, skipped)
        self.guard.last_checkpoint = origin.path if origin else None
        record = AttemptRecord(job_dir.health, topo, tracker, origin)
        self.work = Work(cfg, setup, topo, self.inst, record, self.guard)
        lockstep = setup.layout.rule.lockstep
        self.barriers = Barriers(cfg.runtime, self.per_epoch, setup.total_steps, lockstep)

    def save(self, step: int) -> None:
        layout, inst = self.setup.layout, self.inst
        # Skipped steps keep NaN out of the weights; this is the last line, for what got
        # in another way (an optimizer step that overflowed): never a checkpoint of it.
        if not weights_are_finite(layout.parts):
            raise self.guard.refuse_to_save(step, layout.lr)
        self.intervals.totals["nonfinite_steps"] = float(self.guard.skipped)
        train_state = {
            "step": step,
            "loader": LoaderPosition(*divmod(step, self.per_epoch)).state_dict(),
            "world_size": self.topo.world_size,
            "mesh": self.topo.shape.as_dict(),
            "shares": self.setup.balancer.shares,
            "totals": dict(self.intervals.totals),
            "selection": self.selection.state_dict(),
            **layout.checkpoint_info(),
        }
        with inst.phase("checkpoint_stall", step):
            self.checkpointer.save(
                step, layout.state.state_dict(), train_state, self.intervals.last
            )
        self.guard.last_checkpoint = checkpoint_dir(self.checkpoints, step)
        inst.loop_seconds += inst.last["checkpoint_stall"]

    def evaluate(self, step: int) -> bool:
        """Validate at `step`; True when it is the best step so far."""
        setup, topo, layout = self.setup, self.topo, self.setup.layout
        self.inst.collective(step)
        started = time.perf_counter()
        metrics = validate(self.cfg, setup, topo)
        self.intervals.log_validation(metrics, step, -(-step // self.per_epoch))
        # Sampling runs the whole model: on rank 0 when it holds a replica, on every rank
        # together when it is sharded, not at all when it is cut into pipeline stages.
        runs_here = topo.is_main or layout.forward_is_collective
        if setup.sampler is not None and layout.whole is not None and runs_here:
            text = setup.sampler(layout.whole)
            if topo.is_main:
                self.tracker.log_text(text, f"samples/step-{step:08d}.txt")
        # Training time excludes validation: the interval's clock skips it.
        self.inst.times.started += time.perf_counter() - started
        improved = self.selection.observe(metrics, step)
        if improved and self.selection.keep_best:
            # Pinned before its save, so no pruning in between can take it.
            self.checkpointer.pinned = step
        return improved

    def advance(self, step: int) -> tuple[int, Segment]:
        """Run the update rule from `step` to the next barrier, and count what it did."""
        inst, until = self.inst, self.barriers.next(step)
        inst.collective(step)
        started = time.perf_counter()
        segment = self.setup.layout.rule.advance(step, until, self.work)
        inst.loop_seconds += time.perf_counter() - started
        inst.loop_steps += segment.end - step
        inst.times.add("sync_wait", segment.sync_wait)
        inst.times.bytes_sent += segment.bytes_sent
        for loss in segment.losses:
            self.intervals.add_loss(torch.as_tensor(loss))
        return segment.end, segment

    def at_barrier(self, step: int, segment: Segment) -> bool:
        """The barrier's work; True when the job stops here (asked to, or early)."""
        rt, inst = self.cfg.runtime, self.inst
        if step == self.setup.total_steps:  # one model: local replicas average a last time
            self.finish(step)
        checkpoint_due = step % rt.checkpoint_every_steps == 0
        # A checkpoint closes the logging interval too: a job resumed from it must find
        # every step up to it already journaled, or its losses would be lost.
        if step % rt.log_every_steps == 0 or checkpoint_due:
            self.close_interval(step)
        if segment.metrics:
            self.tracker.log_metrics(segment.metrics, step)
        # Validation comes before the checkpoint, which then carries its verdict: a job
        # resumed from this step knows whether it was the best one.
        epoch_end = step % self.per_epoch == 0 or step == self.setup.total_steps
        best = False
        if (rt.eval_every_steps and step % rt.eval_every_steps == 0) or epoch_end:
            best = self.evaluate(step) and self.selection.keep_best
            if self.selection.should_stop and step < self.setup.total_steps:
                self.stop_early(step)
                return True
        if checkpoint_due or best:
            self.save(step)
        if not self.barriers.stop_check_due(step):
            return False
        inst.collective(step)
        return _stop_requested(self.control, self.topo)

    def finish(self, step: int) -> None:
        with self.inst.phase("sync_wait", step):
            self.inst.times.bytes_sent += self.setup.layout.finish(step)

    def stop_early(self, step: int) -> None:
        """Validation stopped improving: this step is the job's last (the final save
        after the loop writes it)."""
        self.stopped_early = True
        self.finish(step)
        if self.topo.is_main:
            sel = self.selection
            log.info(
                "early stopping at step %d: %s has not improved by more than %g for %d "
                "validations (best %.6g at step %d)",
                step, sel.metric, sel.min_delta, sel.waited, sel.best_value, sel.best_step,
            )  # fmt: skip

    def close_interval(self, step: int) -> None:
        """Log the interval; under measured balance, new shares from the next batch on."""
        setup = self.setup
        self.inst.collective(step)
        ranks = self.intervals.close(step, setup.layout.lr)
        self.tracker.log_metrics({"nonfinite_steps": float(self.guard.skipped)}, step)
        if setup.balancer.remeasure(ranks, self.intervals.closed):
            setup.loader.shares = setup.balancer.shares
            self.work.batches.reset()  # every rank re-reads with the new shares
            self.tracker.log_metrics(setup.balancer.metrics(), step)
            if self.topo.is_main:
                log.info("balance: rows per rank now %s", setup.balancer.shares)


def train(
    cfg: Config, topo: Topology, job: TrainJob, tracker: Tracker, control: Control
) -> dict[str, Any] | None:
    setup = set_up(cfg, topo, Path(job.shard_dir))
    cfg = setup.cfg
    if cfg.train.micro_batch == "auto":
        tracker.set_tag("gradline.grad_accum_steps", str(cfg.train.grad_accum_steps))
    run = Attempt(cfg, topo, setup, job, tracker, control)
    step, total = run.start, setup.total_steps
    progress = Progress("train", total, "steps", done=step) if topo.is_main else None

    stopped = False
    with timed_span("train_loop") if topo.is_main else contextlib.nullcontext():
        while step < total and not stopped:
            done, segment = run.advance(step)
            if progress is not None:
                progress.advance(done - step)
            step = done
            stopped = run.at_barrier(step, segment)

    if progress is not None:
        progress.close()
    run.intervals.close(step, setup.layout.lr, final=True)
    run.save(step)  # the final (or preemption) state, always
    run.checkpointer.close()
    setup.layout.close()
    run.intervals.finish()
    selected = run.selection.summary(step, run.stopped_early)
    if not stopped or run.stopped_early:
        record_selection(tracker, selected, step)
    tracker.finish()  # the helper ships the rest while the process group ends (worker.py)
    run.inst.close()
    if stopped and not run.stopped_early:
        log.warning("rank %d: stopping at step %d on request (preemption)", topo.rank, step)
        return {"preempted": True, "step": step}
    if not topo.is_main:
        return None
    result = run.intervals.result(step, run.inst, run.checkpointer.stall_seconds)
    return {**result, **selected, "grad_accum_steps": cfg.train.grad_accum_steps}
