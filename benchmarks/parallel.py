"""One `gpt` configuration under each parallel layout, on 2 and 4 ranks (gloo, CPU).

For each layout, relative to DDP on the same number of ranks:
- state_ratio: the largest per-rank bytes of parameters + gradients + optimizer state
  (what each rank holds after a backward, with the optimizer's state allocated);
- comm_ratio: bytes each rank sends per step (ring model, counted by
  training.engine.comm.CommMeter on every collective of a step);
- time_ratio: median step time (forward, backward, optimizer).
Pipeline layouts also print their bubble: the mean over ranks of the share of a
schedule step a stage spends not computing, beside the theory (p-1)/(m+p-1).

Each layout runs through the engine's own `parallelize` (the code training uses) on
synthetic token batches. Layouts are interleaved (all of them, then all again) and each
figure is the median of `--repeats`; on a 2-core host, 4 ranks share the cores, so
step-time ratios at 4 ranks say little while bytes are exact. The last line is
key=value pairs.
Usage: python -m benchmarks.parallel [--steps 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import fmt, launch_local, use_throwaway_signing_key

MODEL = {
    "name": "gpt",
    "layers": 4,
    "heads": 4,
    "width": 128,
    "context": 64,
    "dropout": 0.0,
    "tied_embeddings": False,
}
VOCAB, BATCH, MICROBATCHES = 256, 64, 8
# name -> (world size, parallel section)
LAYOUTS = {
    "ddp2": (2, {}),
    "fsdp2": (2, {"dp_shard": 2}),
    "tp2": (2, {"tp": 2}),
    "pp2": (2, {"pp": 2, "pp_schedule": "1f1b"}),
    "pp2_gpipe": (2, {"pp": 2, "pp_schedule": "gpipe"}),
    "ddp4": (4, {}),
    "fsdp4": (4, {"dp_shard": 4}),
    "hsdp2x2": (4, {"dp_replicate": 2, "dp_shard": 2}),
    "fsdp2_tp2": (4, {"dp_shard": 2, "tp": 2}),
    "pp2_dp2": (4, {"pp": 2, "dp_replicate": 2}),
}


def _config(world: int, parallel: dict):
    from training.config import Config

    return Config.model_validate(
        {
            "data": {"source": "stdlib"},
            "task": {"type": "language_modeling"},
            "model": MODEL,
            "train": {"batch_size": BATCH},
            "runtime": {"procs_per_node": world},
            "parallel": {"pp_microbatches": MICROBATCHES, **parallel},
        }
    )


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _state_bytes(model) -> int:
    """Parameters + gradients + optimizer state this rank holds."""
    import torch

    params = [p for part in model.parts for p in part.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    states = [
        v
        for opt in model.optimizer.optimizers
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return _local_bytes(params) + _local_bytes(grads) + _local_bytes(states)


def layout_worker(world: int, parallel: dict, steps: int) -> dict:
    """Train `steps` steps of the benchmark model under one layout; report this rank."""
    import contextlib

    import torch

    from training.data.spec import DataSpec
    from training.engine.comm import CommMeter
    from training.engine.layouts import Pipelined
    from training.engine.parallelize import parallelize
    from training.engine.state import clip_grad_norm
    from training.engine.steps import StepInputs
    from training.engine.topology import Topology, process_group
    from training.models.registry import build_model
    from training.objectives import objective_for

    cfg = _config(world, parallel)
    torch.set_num_threads(1)
    topo = Topology.from_env("gloo").with_shape(cfg.layout())
    data = DataSpec(kind="tokens", feature_shape=(), vocab_size=VOCAB)
    objective = objective_for("language_modeling", data, None)

    def build():
        torch.manual_seed(0)
        return build_model(cfg.model, "language_modeling", data)

    with process_group(topo):
        if not topo.shape.plain_data_parallel:
            topo = topo.with_device_mesh()
        constant = cfg.optim.lr
        model = parallelize(
            build, cfg, topo, objective.loss, contextlib.nullcontext, lambda _: constant
        )
        generator = torch.Generator().manual_seed(topo.dp_rank)
        rows = BATCH // topo.dp_size
        times, bubbles, state, sent = [], [], 0, 0.0
        for step in range(steps):
            tokens = torch.randint(0, VOCAB, (rows, MODEL["context"] + 1), generator=generator)
            x, y = tokens[:, :-1], tokens[:, 1:]
            counted = step == steps - 1  # the last step counts bytes (the meter costs time)
            started = time.perf_counter()
            with CommMeter() if counted else contextlib.nullcontext() as meter:
                outcome = model.forward_backward(StepInputs(x, y, step))
                clip_grad_norm(model.parts, 1.0, topo.shape.pp, model.replicated)
            if step >= 1:  # the optimizer's state exists after its first step
                state = max(state, _state_bytes(model))
            model.optimizer_step(constant, grad_clip=0.0)  # clipped above, inside the timing
            if counted:
                sent = meter.bytes_sent
            elif step >= 2:  # the first steps warm up (allocations, shape inference)
                times.append(time.perf_counter() - started)
                if isinstance(model, Pipelined):
                    bubbles.append(outcome.bubble / max(times[-1], 1e-9))
    return {
        "state_bytes": state,
        "bytes_sent": sent,
        "step_s": statistics.median(times),
        "bubble": statistics.mean(bubbles) if bubbles else float("nan"),
    }


def measure(name: str, steps: int) -> dict[str, float]:
    world, parallel = LAYOUTS[name]
    ranks = launch_local(layout_worker, world, world, parallel, steps)
    rows = list(ranks.values())
    return {
        "state_bytes": max(r["state_bytes"] for r in rows),
        "bytes_sent": max(r["bytes_sent"] for r in rows),
        "step_s": max(r["step_s"] for r in rows),
        "bubble": statistics.mean(r["bubble"] for r in rows),
    }


def main() -> None:
    use_throwaway_signing_key()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in args.only}
    for _ in range(args.repeats):  # interleaved: drift on a noisy host hits every layout
        for name in args.only:
            runs[name].append(measure(name, args.steps))

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    figures: dict[str, float] = {}
    print(
        f"{'layout':<11}{'state MB':>10}{'state':>8}{'sent MB':>10}{'comm':>8}"
        f"{'step ms':>10}{'time':>8}{'bubble':>8}"
    )
    for name in args.only:
        base = "ddp2" if LAYOUTS[name][0] == 2 else "ddp4"
        ratios = {}
        for key, label in (("state_bytes", "state"), ("bytes_sent", "comm"), ("step_s", "time")):
            ratios[label] = median(name, key) / median(base, key) if base in runs else float("nan")
            figures[f"{name}_{label}_ratio"] = ratios[label]
        bubble = median(name, "bubble")
        print(
            f"{name:<11}{median(name, 'state_bytes') / 1e6:>10.3f}{fmt(ratios['state']):>8}"
            f"{median(name, 'bytes_sent') / 1e6:>10.3f}{fmt(ratios['comm']):>8}"
            f"{median(name, 'step_s') * 1e3:>10.1f}{fmt(ratios['time']):>8}{fmt(bubble):>8}"
        )
        if name.startswith("pp2"):
            figures[f"{name}_bubble"] = bubble
    theory = (2 - 1) / (MICROBATCHES + 2 - 1)
    figures["pp2_bubble_theory"] = theory
    for name in ("pp2", "pp2_gpipe"):
        if f"{name}_bubble" in figures:
            figures[f"{name}_bubble_gap"] = abs(figures[f"{name}_bubble"] - theory)
    print(f"pipeline bubble theory (p-1)/(m+p-1) with p=2, m={MICROBATCHES}: {theory:.4f}")
    print(" ".join(f"{k}={fmt(v)}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
