"""The sharded layouts' building blocks on one device: FSDP2, tensor and pipeline
parallelism and a sharded checkpoint, through the engine's own functions.

The test suite runs these layouts on CPU/gloo with 2 and 4 ranks. A GPU machine lent
here has one GPU, and NCCL refuses two ranks on one device ("Duplicate GPU detected"),
so this runs every layout on a mesh of one: the collectives are trivial, but the code
paths are the CUDA ones (DTensor parameters on the device, FSDP2's bf16 compute with
fp32 reduction, the tensor plan's DTensors, the pipelining schedules' stages and their
buffers, DCP writing and reading device shards, NCCL and gloo side by side).

Each check trains the same `gpt` on the same random batches under bf16 autocast and
compares its losses with a plain model's: they agree to bf16 rounding (FSDP computes
in bf16 parameters rather than under autocast, so its tolerance is looser). The
checkpoint check saves an FSDP model and its optimizer at step 10 with the engine's
Checkpointer (signed, then verified on load), loads them into a fresh FSDP model, and
requires the next 10 losses to equal the uninterrupted run's exactly.

Usage: python -m benchmarks.gpu_layouts [--steps 20] [--cpu]
Prints one `name PASS|FAIL ...` line per check, then `key=value` figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.common import use_throwaway_signing_key
from training.config import OptimConfig
from training.engine.checkpoint import Checkpointer, find_latest, load_into
from training.engine.pipeline import Pipeline, cut_stage
from training.engine.sharding import apply_fsdp, apply_tensor_parallel
from training.engine.state import OptimizerGroup, TrainState
from training.models.gpt import GPT

VOCAB, CONTEXT, BATCH = 256, 128, 32
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.0)


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(
        VOCAB, layers=4, heads=4, width=256, context=CONTEXT, dropout=0.0, tied_embeddings=False
    )


def batches(steps: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens with something to learn (skewed frequencies; each token repeats the
    one 3 places back half the time), so losses fall and a wrong gradient shows."""
    gen = torch.Generator().manual_seed(1)
    weights = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    out = []
    for _ in range(steps):
        drawn = torch.multinomial(weights, BATCH * (CONTEXT + 1), True, generator=gen)
        tokens = drawn.view(BATCH, CONTEXT + 1)
        copy = torch.rand(BATCH, CONTEXT + 1, generator=gen) < 0.5
        copy[:, :3] = False
        tokens[:, 3:][copy[:, 3:]] = tokens[:, :-3][copy[:, 3:]]
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return out


def loss_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())


class Run:
    """Model parts with their optimizer and how one step runs on them."""

    def __init__(self, parts: list[nn.Module], step: Callable, autocast: Callable) -> None:
        self.parts, self.step_fn, self.autocast = parts, step, autocast
        self.optimizer = OptimizerGroup(parts, OPTIM)

    def train(self, data) -> list[float]:
        losses = []
        for x, y in data:
            with self.autocast():
                loss = self.step_fn(x, y)
            self.optimizer.step()
            self.optimizer.zero_grad()
            losses.append(float(loss))
        return losses


def whole_model_step(model: nn.Module) -> Callable:
    def step(x, y):
        loss = loss_of(model(x), y)
        loss.backward()
        return loss.detach()

    return step


def plain(device, mesh, autocast) -> Run:
    model = build().to(device)
    return Run([model], whole_model_step(model), autocast)


def fsdp(device, mesh, autocast) -> Run:
    model = build()
    dtype = "bf16" if device.type == "cuda" else "fp32"
    apply_fsdp(model, mesh["dp_shard"], dtype, "fp32", True)
    return Run([model], whole_model_step(model), autocast)


def tp(device, mesh, autocast) -> Run:
    model = build()
    apply_tensor_parallel(model, mesh["tp"])
    model.to(device)
    return Run([model], whole_model_step(model), autocast)


def tp_fsdp(device, mesh, autocast) -> Run:
    model = build()
    apply_tensor_parallel(model, mesh["tp"])
    dtype = "bf16" if device.type == "cuda" else "fp32"
    apply_fsdp(model, mesh["dp_shard"], dtype, "fp32", True)
    return Run([model], whole_model_step(model), autocast)


def pipelined(schedule: str, stages: int) -> Callable:
    """`stages` stages of the model, all on this one rank, run by `schedule`."""

    def make(device, mesh, autocast) -> Run:
        parts = [cut_stage(build(), i, stages).to(device) for i in range(stages)]
        group = mesh["pp"].get_group()
        pipe = Pipeline(parts, list(range(stages)), stages, schedule, 4, loss_of, group, device)

        def step(x, y):
            # This rank holds the first and the last stage: it feeds one and scores the
            # other (the engine's Pipeline.step serves ranks that hold one end).
            losses: list[torch.Tensor] = []
            pipe.schedule.step(x, target=y, losses=losses)
            return torch.stack([v.detach() for v in losses]).mean()

        return Run(parts, step, autocast)

    return make


CHECKS = {
    "fsdp": (fsdp, 3e-2),
    "tp": (tp, 1e-2),
    "tp_fsdp": (tp_fsdp, 3e-2),
    "pp_1f1b": (pipelined("1f1b", 1), 1e-2),
    "pp_gpipe": (pipelined("gpipe", 1), 1e-2),
    "pp_interleaved_2_stages": (pipelined("interleaved_1f1b", 2), 1e-2),
}


def checkpoint_check(
    device, mesh, autocast, data, folder: Path, asynchronous: bool
) -> tuple[bool, str, float]:
    """FSDP state saved at the midpoint and loaded into a fresh model continues exactly
    as the uninterrupted run (both in the same process, same kernels). Asynchronous
    saves run on a gloo group of their own, as the engine's (Checkpointer.for_job)."""
    half = len(data) // 2
    reference = fsdp(device, mesh, autocast)
    reference.train(data[:half])
    group = dist.new_group(backend="gloo") if asynchronous else None
    saver = Checkpointer(folder, keep=2, asynchronous=asynchronous, is_main=True, group=group)
    started = time.perf_counter()
    saver.save(half, TrainState(reference.parts, reference.optimizer).state_dict(), {}, {})
    stalled_s = time.perf_counter() - started
    expected = reference.train(data[half:])  # training goes on while an async save writes
    saver.close()

    restored = fsdp(device, mesh, autocast)
    # One step of zero learning rate creates the optimizer's state to load into.
    restored.optimizer.set_lr(0.0)
    restored.train(data[:1])
    restored.optimizer.set_lr(OPTIM.lr)
    path, _ = find_latest(folder)
    state = TrainState(restored.parts, restored.optimizer)
    whole = state.state_dict()
    load_into(path, whole)
    state.load_state_dict(whole)
    resumed = restored.train(data[half:])
    same = resumed == expected
    return same, f"resumed {resumed[:3]} vs uninterrupted {expected[:3]}", stalled_s


def relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-8) for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cpu", action="store_true", help="the CPU even where CUDA is")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    use_throwaway_signing_key()
    backend = "cpu:gloo,cuda:nccl" if on_gpu else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, device_id=device if on_gpu else None)
    mesh = init_device_mesh(device.type, (1, 1, 1), mesh_dim_names=("pp", "dp_shard", "tp"))

    def autocast():
        if on_gpu:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    data = batches(args.steps, device)
    base = plain(device, mesh, autocast).train(data)
    print(f"plain   losses {base[0]:.4f} -> {base[-1]:.4f}  (device {device})")
    figures = {"plain_last_loss": base[-1]}
    failed = 0
    for name, (make, tolerance) in CHECKS.items():
        try:
            losses = make(device, mesh, autocast).train(data)
            gap = relative_gap(losses, base)
            ok = gap <= tolerance and base[-1] < base[0]
            figures[f"{name}_loss_gap"] = gap
            print(
                f"{name:<24} {'PASS' if ok else 'FAIL'} max relative loss gap {gap:.2e}"
                f" (tolerance {tolerance:g}); last loss {losses[-1]:.4f}"
            )
        except Exception:  # a check that fails is reported; the rest still run
            ok = False
            print(f"{name:<24} FAIL\n{traceback.format_exc()}")
        failed += not ok
    for mode in ("sync", "async"):
        name = f"fsdp_checkpoint_{mode}"
        with tempfile.TemporaryDirectory() as folder:
            try:
                ok, detail, stalled_s = checkpoint_check(
                    device, mesh, autocast, data, Path(folder), mode == "async"
                )
                figures[f"{name}_stall_s"] = stalled_s
                print(f"{name:<24} {'PASS' if ok else 'FAIL'} {detail}")
            except Exception:
                ok = False
                print(f"{name:<24} FAIL\n{traceback.format_exc()}")
        failed += not ok
    dist.destroy_process_group()
    figures["failed"] = failed
    print(
        " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
    )
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
