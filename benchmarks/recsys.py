"""A `dlrm` with large embedding tables, unsharded and sharded, on 1, 2 and 4 ranks (gloo).

For each layout:
- state: the largest per-rank bytes of embedding state (table weights + AdamW's two
  moments), measured on the ranks after a step; `emb{N}_state_ratio` is row-wise on N
  ranks over the unsharded tables (goal: <= 1/N + 0.05), `emb{N}_table_state_ratio`
  the same table-wise (bounded by the largest table);
- a2a MB/step: the bytes a rank sends to other ranks in one step's all-to-alls (ids,
  embeddings back, their gradients), the largest rank, counted by the layout; sent
  MB/step: everything it sends (DDP's gradient all-reduce too: unsharded, the tables'
  whole gradients travel every step);
- samples/s: the global batch over the median step time (forward, backward, optimizer;
  the slowest rank). On a 2-core host 4 ranks share the cores: bytes and state are exact,
  4-rank throughput says little.

Each layout runs through the engine's own `parallelize` (the code training uses) on
power-law ids. The last line is key=value pairs.
Usage: python -m benchmarks.recsys [--steps 6] [--repeats 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import fmt, launch_local

# Four tables, 360k rows x 16: 23 MB of weights, 69 MB with AdamW's state.
TABLE_ROWS = [200_000, 100_000, 50_000, 10_000]
DIM, NUM_DENSE, BATCH = 16, 4, 2048
# name -> (world size, parallel section)
LAYOUTS = {
    "none1": (1, {}),
    "none2": (2, {}),
    "row2": (2, {"embedding_sharding": "row"}),
    "table2": (2, {"embedding_sharding": "table"}),
    "row4": (4, {"embedding_sharding": "row"}),
    "table4": (4, {"embedding_sharding": "table"}),
}


def _config(world: int, parallel: dict):
    from training.config import Config

    return Config.model_validate(
        {
            "data": {"source": "clicks"},
            "task": {"type": "click"},
            "model": {"name": "dlrm", "embedding_dim": DIM, "bottom": [32], "top": [64, 32]},
            "train": {"batch_size": BATCH},
            "runtime": {"procs_per_node": world},
            "parallel": parallel,
        }
    )


def _embedding_state(layout) -> int:
    """Bytes of table weights and their optimizer state on this rank."""
    import torch

    from training.engine.embedding_sharding import find_tables

    if hasattr(layout, "embedding_bytes"):
        return layout.embedding_bytes()
    tables = find_tables(layout.parts[0])[1]
    state = layout.optimizer.optimizers[0].state
    total = 0
    for param in tables.parameters():
        total += param.numel() * param.element_size()
        for value in state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                total += value.numel() * value.element_size()
    return total


def layout_worker(world: int, parallel: dict, steps: int) -> dict:
    import contextlib

    import torch
    import torch.nn.functional as F

    from training.engine.parallelize import parallelize
    from training.engine.steps import StepInputs
    from training.engine.topology import Topology, process_group
    from training.models.dlrm import DLRM

    cfg = _config(world, parallel)
    torch.set_num_threads(1)
    topo = Topology.from_env("gloo").with_shape(cfg.layout())

    def build():
        torch.manual_seed(0)
        return DLRM(TABLE_ROWS, NUM_DENSE, 1, embedding_dim=DIM, bottom=[32], top=[64, 32])

    def loss(output, target):
        return F.binary_cross_entropy_with_logits(output.squeeze(-1), target)

    with process_group(topo):
        layout = parallelize(build, cfg, topo, loss, contextlib.nullcontext, lambda _: 1e-3)
        generator = torch.Generator().manual_seed(topo.dp_rank)
        rows = BATCH // topo.dp_size
        sizes = torch.tensor(TABLE_ROWS, dtype=torch.float64)
        times, exchanged, sent = [], [], []
        for step in range(steps):
            # Power-law ids: a few rows take most lookups, as users and items do.
            ids = (
                torch.rand(rows, len(TABLE_ROWS), generator=generator, dtype=torch.float64) ** 4
                * sizes
            ).floor()
            dense = torch.randn(rows, NUM_DENSE, generator=generator, dtype=torch.float64)
            x = torch.cat([ids, dense], dim=1).float()
            y = (torch.rand(rows, generator=generator) < 0.1).float()
            started = time.perf_counter()
            outcome = layout.forward_backward(StepInputs(x, y, step))
            sent.append(outcome.bytes_sent)
            layout.optimizer_step(1e-3, grad_clip=1.0)
            if step >= 1:  # the first step allocates (optimizer state, buffers)
                times.append(time.perf_counter() - started)
            last = getattr(layout, "last_exchange", None)
            exchanged.append(last.bytes_sent if last is not None else 0.0)
        state = _embedding_state(layout)
    return {
        "state_bytes": state,
        "a2a_bytes": statistics.median(exchanged),
        "sent_bytes": statistics.median(sent),
        "step_s": statistics.median(times),
    }


def measure(name: str, steps: int) -> dict[str, float]:
    world, parallel = LAYOUTS[name]
    rows = list(launch_local(layout_worker, world, world, parallel, steps).values())
    return {
        "state_bytes": max(r["state_bytes"] for r in rows),
        "a2a_bytes": max(r["a2a_bytes"] for r in rows),
        "sent_bytes": max(r["sent_bytes"] for r in rows),
        "step_s": max(r["step_s"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for _ in range(args.repeats):  # interleaved: drift on a noisy host hits every layout
        for name in LAYOUTS:
            runs[name].append(measure(name, args.steps))

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    whole = median("none1", "state_bytes")
    print(
        f"{'layout':<8}{'state MB':>10}{'state':>8}{'a2a MB/step':>13}{'sent MB/step':>14}"
        f"{'samples/s':>11}"
    )
    figures: dict[str, float] = {}
    for name in LAYOUTS:
        world = LAYOUTS[name][0]
        ratio = median(name, "state_bytes") / whole
        throughput = BATCH / median(name, "step_s")
        print(
            f"{name:<8}{median(name, 'state_bytes') / 1e6:>10.2f}{fmt(ratio):>8}"
            f"{median(name, 'a2a_bytes') / 1e6:>13.3f}{median(name, 'sent_bytes') / 1e6:>14.3f}"
            f"{throughput:>11.0f}"
        )
        figures[f"{name}_samples_per_s"] = throughput
        figures[f"{name}_sent_mb_per_step"] = median(name, "sent_bytes") / 1e6
        if name.startswith(("row", "table")):
            kind = "" if name.startswith("row") else "_table"
            figures[f"emb{world}{kind}_state_ratio"] = ratio
            figures[f"emb{world}{kind}_a2a_mb_per_step"] = median(name, "a2a_bytes") / 1e6
    for world in (2, 4):
        figures[f"emb{world}_state_goal"] = 1 / world + 0.05
    print(" ".join(f"{k}={fmt(v)}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
