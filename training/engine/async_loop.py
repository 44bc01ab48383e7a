"""The loop of an asynchronous job (`parallel.update: async`): segments between barriers.

Between barriers every rank works on its own: pull the server's parameters, compute a
gradient on its next batch, push it (training.engine.async_ps). At a barrier every rank
holds the parameters of the same server step, and the loop does what the synchronous
loop does at its interval steps: log the interval (the loss of every server step, each
rank's time breakdown), checkpoint, validate, and check for a stop request.

Barriers fall on multiples of log_every_steps, checkpoint_every_steps and
eval_every_steps (when set), on epoch ends and on the last step. Stop requests are
checked at every barrier: an async job has no control_every_steps of its own, since each
check would be one more barrier for every rank to wait at.

Worker w's gradient n reads slice w of global batch n (epoch n // batches per epoch):
with max_staleness 0 every server step is global batch n of the synchronous job; with
more, a faster worker reads further ahead in its slices than a slower one.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from training.data.loader import LoaderPosition
from training.engine.topology import Topology


def next_barrier(step: int, total: int, runtime, per_epoch: int) -> int:
    """The first server step after `step` where every rank must meet."""
    candidates = [total]
    every = (runtime.log_every_steps, runtime.checkpoint_every_steps, runtime.eval_every_steps)
    for interval in (*every, per_epoch):
        if interval:
            candidates.append((step // interval + 1) * interval)
    return min(candidates)


class WorkerBatches:
    """This rank's batch for its gradient n, read in order (a new reader on a jump)."""

    def __init__(self, loader, workers: int, device: torch.device) -> None:
        self.loader, self.workers, self.device = loader, workers, device
        self.expected, self.batches = -1, None

    def get(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = divmod(n, self.loader.batches_per_epoch)
        if n != self.expected or index == 0:
            on_gpu = self.device.type == "cuda"
            self.batches = self.loader.tensors(epoch, index, self.workers, on_gpu)
        self.expected = n + 1
        x, y = next(self.batches)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


def run_segments(
    cfg, setup, topo: Topology, control, inst, intervals, tracker, progress, save, evaluate, step
) -> tuple[int, LoaderPosition, bool]:
    """Train from server step `step` to the end (or a stop request); returns the step,
    the position in global terms, and whether the job was asked to stop."""
    from training.engine.loop import _autocast, _preempt_requested, _step_seed

    rt, ps, model = cfg.runtime, setup.model.ps, setup.model.parts[0]
    total, per_epoch = setup.total_steps, setup.loader.batches_per_epoch
    batches = WorkerBatches(setup.loader, rt.loader_workers, topo.device)
    accum = cfg.train.grad_accum_steps

    def compute(n: int) -> tuple[float, int]:
        with inst.phase("data_wait", n):
            x, y = batches.get(n)
        with inst.phase("compute", n):
            torch.manual_seed(_step_seed(cfg.train.seed, topo, n))
            loss_sum = torch.zeros(())
            for xm, ym in zip(x.chunk(accum), y.chunk(accum), strict=True):
                with _autocast(cfg, topo):
                    loss = setup.objective.loss(model(xm).float(), ym) / accum
                loss.backward()
                loss_sum += loss.detach().cpu()
        inst.stretch(n, inst.last["compute"])
        inst.step_done()
        return loss_sum.item(), len(x)

    position, preempted = LoaderPosition(*divmod(step, per_epoch)), False
    while step < total and not preempted:
        until = next_barrier(step, total, rt, per_epoch)
        inst.collective(step)
        waited, sent = ps.wait_seconds, ps.bytes_sent
        seconds, steps, started = inst.loop_seconds, inst.loop_steps, time.perf_counter()
        segment = ps.run_segment(until, compute)
        inst.times.add("sync_wait", ps.wait_seconds - waited)
        inst.times.bytes_sent += ps.bytes_sent - sent
        # The job's time and steps are the segment's and the server's (the phases above
        # counted this rank's gradients, which is what its time breakdown is per).
        inst.loop_seconds = seconds + time.perf_counter() - started
        for loss in segment.losses:
            intervals.add_loss(torch.tensor(loss))
        if progress is not None:
            progress.advance(segment.version - step)
        inst.loop_steps = steps + segment.version - step
        step = segment.version
        position = LoaderPosition(*divmod(step, per_epoch))
        _at_barrier(cfg, setup, step, segment, intervals, tracker, inst)
        if step % rt.checkpoint_every_steps == 0:
            save(step, position)
        epoch_end = step % per_epoch == 0 or step == total
        if (rt.eval_every_steps and step % rt.eval_every_steps == 0) or epoch_end:
            evaluate(step, -(-step // per_epoch))
        inst.collective(step)
        preempted = _preempt_requested(control, topo)
    return step, position, preempted


def _at_barrier(cfg, setup, step: int, segment, intervals, tracker, inst) -> dict[str, Any]:
    """Log the interval when one ends here, and the segment's staleness."""
    rt = cfg.runtime
    if step % rt.log_every_steps == 0 or step % rt.checkpoint_every_steps == 0:
        inst.collective(step)
        intervals.close(step, setup.model.optimizer.param_groups[0]["lr"])
    metrics = {
        "async_staleness_max": float(segment.staleness_max),
        "async_staleness_mean": segment.staleness_mean,
        # Gradients each worker has computed in the job: a fast one computes more.
        **{f"async_gradients/rank{w}": float(n) for w, n in enumerate(segment.next_gradient)},
    }
    tracker.log_metrics(metrics, step)
    return metrics
