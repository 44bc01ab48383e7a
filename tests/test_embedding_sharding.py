"""Embedding tables sharded across ranks (training.engine.embedding_sharding).

The plan and the budget are pure functions, tested without processes. The layout is
tested on a toy model (an EmbeddingTables and a Linear) in real gloo processes, one
thread per rank: N ranks on N slices of a batch train what one process trains on the
whole batch, each rank holds about 1/N of the tables, and a checkpoint written on 2
ranks loads on 1 and 4, under either sharding.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from training.config import Config, OptimConfig
from training.engine.embedding_sharding import (
    check_budget,
    plan_shards,
    state_mb,
)
from training.engine.topology import end_process_groups
from training.engine.worker_start import start_method
from training.errors import ConfigError
from training.models.embedding_tables import EmbeddingTables

ROWS, DIM, COLUMNS = (61, 37, 8, 3), 4, 4
STEPS, BATCH = 20, 48
# Losses agree to a relative 1e-5 and weights to an absolute 1e-5 (fp32 sums in another
# order: the rows' gradients arrive from N ranks instead of one batch).
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5


# --------------------------------------------------------------------- pure functions


def test_row_blocks_are_dtensor_shards() -> None:
    """Row blocks match DTensor's Shard(0) (ceil(rows / N) each), so a block is exactly
    a rank's shard of the whole table in a checkpoint; trailing ranks may hold none."""
    plan = plan_shards((10, 3), 8, 4, "row")
    assert [plan.block(0, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [plan.block(1, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    for r in range(4):
        chunk = torch.arange(10).chunk(4)[r]  # what Shard(0) gives rank r
        assert plan.block(0, r) == (int(chunk[0]), int(chunk[-1]) + 1)
    assert all(plan.holds(1, r) for r in range(4))  # an empty block is still a parameter


def test_table_wise_balances_bytes() -> None:
    plan = plan_shards((100, 60, 50, 10), 8, 2, "table")
    owners = [next(r for r in range(2) if plan.holds(t, r)) for t in range(4)]
    assert owners == [0, 1, 1, 0]  # 110 rows against 110
    assert [plan.rows_on(r) for r in range(2)] == [110, 110]
    assert plan.block(1, 1) == (0, 60) and plan.block(1, 0) == (0, 0)
    lonely = plan_shards((5,), 8, 3, "table")  # more ranks than tables: some hold none
    assert [lonely.rows_on(r) for r in range(3)] == [5, 0, 0]


def test_budget_refuses_tables_that_do_not_fit_unsharded() -> None:
    adamw = OptimConfig()
    rows = (200_000, 100_000)
    need = state_mb(sum(rows), 16, 4, adamw)  # weights and AdamW's two moments
    assert need == pytest.approx(300_000 * 16 * 4 * 3 / 2**20)
    with pytest.raises(ConfigError) as refused:
        check_budget(rows, 16, 4, adamw, 40.0, "none", 2)
    message = str(refused.value)
    assert f"{need:.1f} MB" in message and "embedding_budget_mb is 40" in message
    assert "parallel.embedding_sharding: row" in message
    check_budget(rows, 16, 4, adamw, 40.0, "row", 2)  # 27.5 MB per rank: fits
    with pytest.raises(ConfigError, match=r"rank 0 holds 36\.6 MB"):
        check_budget(rows, 16, 4, adamw, 30.0, "table", 2)  # the big table alone: 36.6
    check_budget(rows, 16, 4, adamw, 0.0, "none", 1)  # 0: no limit


def test_sharding_is_refused_where_it_cannot_apply() -> None:
    with pytest.raises(ValueError, match="model mlp has none"):
        Config.model_validate({"parallel": {"embedding_sharding": "row"}})
    with pytest.raises(ValueError, match=r"does not combine with parallel\.dp_shard=2"):
        Config.model_validate(
            {
                "parallel": {"embedding_sharding": "table", "dp_shard": 2},
                "runtime": {"procs_per_node": 2},
            }
        )


# ------------------------------------------------------------------- toy model, gloo


class Toy(nn.Module):
    """Ids in the first COLUMNS features, one dense feature after them."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = EmbeddingTables(ROWS, DIM)
        self.head = nn.Linear(COLUMNS * DIM + 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        found = self.embeddings(x[:, :COLUMNS].long())
        return self.head(torch.cat([found.flatten(1), x[:, COLUMNS:]], dim=1)).squeeze(1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch: power-law-ish ids (some rows hit by many examples)."""
    g = torch.Generator().manual_seed(step)
    ids = (torch.rand(BATCH, COLUMNS, generator=g) ** 3 * 1000).floor()
    dense = torch.randn(BATCH, 1, generator=g)
    y = (ids[:, 0] % 7 - 3) / 3 + dense[:, 0]  # something to learn from ids and dense
    return torch.cat([ids, dense], dim=1), y


def _config(mode: str) -> Config:
    cfg = Config.model_validate({"optim": {"lr": 0.05, "grad_clip": 1.0}})
    # The toy model is no built-in: the layout is tested below the config's checks.
    parallel = cfg.parallel.model_copy(update={"embedding_sharding": mode})
    return cfg.model_copy(update={"parallel": parallel})


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch, the same optimizer and clipping."""
    from training.engine.state import OptimizerGroup, clip_grad_norm

    cfg = _config("none")
    torch.manual_seed(0)
    model = Toy()
    optimizer = OptimizerGroup([model], cfg.optim)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        clip_grad_norm([model], cfg.optim.grad_clip, replicated=True)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _layout(mode: str, rank: int, world: int):
    from training.engine.embedding_sharding import EmbeddingParallel
    from training.engine.topology import Topology

    topo = Topology(rank, world, rank, "gloo", torch.device("cpu"))
    torch.manual_seed(0)
    return EmbeddingParallel(
        Toy(), topo, _config(mode), nn.functional.mse_loss, contextlib.nullcontext
    )


def _rank_trains(rank: int, world: int, mode: str, out: str, store: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from training.engine.steps import StepInputs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    layout = _layout(mode, rank, world)
    losses, sent, waited = [], 0.0, 0.0
    for step in range(STEPS):
        x, y = _batch(step)
        result = layout.forward_backward(
            StepInputs(x.chunk(world)[rank], y.chunk(world)[rank], step)
        )
        layout.optimizer_step(0.05, 1.0)
        loss = result.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        sent, waited = sent + result.bytes_sent, waited + result.sync_wait
    blocks = {t: layout.tables.plan.block(t, rank) for t in layout.tables.held}
    weights = {t: layout.tables.tables[t].weight.detach().clone() for t in layout.tables.held}
    optim = layout.optimizer.optimizers[0].state
    moments = {t: optim[layout.tables.tables[t].weight]["exp_avg"] for t in layout.tables.held}
    torch.save(
        {
            "losses": losses,
            "blocks": blocks,
            "weights": weights,
            "exp_avg": moments,
            "head": layout.parts[0].head.state_dict(),
            "embedding_bytes": layout.embedding_bytes(),
            "bytes_sent": sent,
            "sync_wait": waited,
        },
        Path(out) / f"rank{rank}.pt",
    )
    dcp.save(layout.state.state_dict(), checkpoint_id=Path(out) / "ckpt")
    end_process_groups()


def _rank_loads(rank: int, world: int, mode: str, out: str, store: str) -> None:
    """Load the checkpoint the trained ranks wrote into this layout and keep what landed."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    layout = _layout(mode, rank, world)
    state = layout.resume_state({})
    shards = state.state_dict()
    dcp.load(shards, checkpoint_id=Path(out) / "ckpt")
    state.load_state_dict(shards)
    optim = layout.optimizer.optimizers[0].state
    loaded = {}
    for t in layout.tables.held:
        weight = layout.tables.tables[t].weight
        loaded[t] = (layout.tables.plan.block(t, rank), weight.detach(), optim[weight]["exp_avg"])
    torch.save(loaded, Path(out) / f"loaded-{mode}-{world}-rank{rank}.pt")
    end_process_groups()


def _run_ranks(fn, world: int, *args, timeout: float = 200.0) -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = Path(args[-1]) / f"store-{fn.__name__}-{world}-{time.monotonic_ns()}"
    # From the engine's forkserver (torch imported once), not an interpreter per rank.
    args = (world, *args, str(store))
    context = mp.start_processes(fn, args, nprocs=world, join=False, start_method=start_method())
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0)):
            if time.monotonic() > deadline:
                pytest.fail(f"{world} ranks did not finish in {timeout:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


_trained: dict[tuple[str, int], list[dict]] = {}


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.fixture
def trained(tmp_path_factory):
    def get(mode: str, world: int) -> tuple[list[dict], Path]:
        key = (mode, world)
        if key not in _trained:
            out = tmp_path_factory.mktemp(f"{mode}{world}")
            _run_ranks(_rank_trains, world, mode, str(out))
            _trained[key] = (
                [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)],
                out,
            )
        return _trained[key]

    return get


def _whole_tables(ranks: list[dict], part: str = "weights") -> list[torch.Tensor]:
    """The whole tables (or one of their optimizer states) from the ranks' blocks."""
    tables = [torch.full((r, DIM), math.nan) for r in ROWS]
    for got in ranks:
        for t, (start, end) in got["blocks"].items():
            tables[t][start:end] = got[part][t]
    return tables


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("mode", "world"), [("row", 2), ("row", 4), ("table", 2), ("table", 4)])
def test_n_ranks_train_what_one_process_trains(mode, world, trained, reference) -> None:
    ranks, _ = trained(mode, world)
    want_losses, want = reference
    assert len(ranks[0]["losses"]) == STEPS
    torch.testing.assert_close(
        torch.tensor(ranks[0]["losses"]), torch.tensor(want_losses), rtol=LOSS_RTOL, atol=0
    )
    assert sum(want_losses[-5:]) < 0.8 * sum(
        want_losses[:5]
    )  # it learned: agreement means something
    for t, table in enumerate(_whole_tables(ranks)):
        torch.testing.assert_close(
            table, want[f"embeddings.tables.{t}.weight"], rtol=0, atol=WEIGHT_ATOL
        )
    for got in ranks:  # the dense part: DDP replicas, equal everywhere
        torch.testing.assert_close(
            got["head"]["weight"], want["head.weight"], atol=WEIGHT_ATOL, rtol=0
        )
    # The all-to-alls are counted: bytes leave every rank, and time waiting in them.
    assert all(got["bytes_sent"] > 0 and got["sync_wait"] > 0 for got in ranks)


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_each_rank_holds_about_a_1_over_n_share(trained) -> None:
    """Row-wise, measured on the ranks: weights and AdamW state about 1/N of the whole."""
    whole = sum(ROWS) * DIM * 4 * 3
    for world in (2, 4):
        ranks, _ = trained("row", world)
        held = [got["embedding_bytes"] for got in ranks]
        assert sum(held) == whole
        # ceil(rows / N) per table: within one row per table of an even split.
        assert max(held) <= whole / world + len(ROWS) * DIM * 4 * 3


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("mode", "world"), [("row", 1), ("row", 4), ("table", 4), ("table", 1)])
def test_a_checkpoint_of_2_ranks_loads_on_1_and_4(mode, world, trained, reference) -> None:
    """Written row-wise by 2 ranks, loaded row- or table-wise by 1 and 4: every rank gets
    exactly the rows it holds, with their optimizer state."""
    ranks, out = trained("row", 2)
    whole, moments = _whole_tables(ranks), _whole_tables(ranks, "exp_avg")
    _run_ranks(_rank_loads, world, mode, str(out))
    seen = [0] * len(ROWS)
    for r in range(world):
        loaded = torch.load(out / f"loaded-{mode}-{world}-rank{r}.pt", weights_only=True)
        for t, ((start, end), weight, exp_avg) in loaded.items():
            assert torch.equal(weight, whole[t][start:end])
            assert torch.equal(exp_avg, moments[t][start:end])
            seen[t] += end - start
    assert seen == list(ROWS)


def test_the_sharded_example_sets_the_embedding_keys_and_others_put_them_back(
    tmp_path,
) -> None:
    import shutil

    from training.config import load_config
    from training.examples import apply_example

    params = tmp_path / "params.yaml"
    shutil.copy(Path(__file__).resolve().parents[1] / "params.yaml", params)
    sharded = apply_example(params, "clicks-dlrm-sharded")
    assert sharded.parallel.embedding_sharding == "row"
    assert sharded.parallel.embedding_budget_mb == 0.75
    assert load_config(params) == sharded
    back = apply_example(params, "digits-mlp")  # mlp has no tables: the keys go back
    assert back.parallel.embedding_sharding == "none"
    assert back.parallel.embedding_budget_mb == 0
    assert back.parallel.dp_replicate == sharded.parallel.dp_replicate  # the mesh stays


def test_the_train_stage_refuses_tables_over_the_budget_before_any_worker() -> None:
    """check_tables_fit (run_job calls it before workers start) on a dlrm: 3 x 10k rows
    x 16 x 4 bytes x 3 (AdamW) = 5.5 MB; a 4 MB budget fits only when sharded."""
    from training.engine.embedding_sharding import check_tables_fit
    from training.models.dlrm import DLRM

    model = DLRM([10_000] * 3, 2, 1, embedding_dim=16, bottom=[8], top=[8])

    def cfg(**parallel) -> Config:
        return Config.model_validate(
            {
                "data": {"source": "clicks"},
                "task": {"type": "click"},
                "model": {"name": "dlrm", "embedding_dim": 16},
                "parallel": {"embedding_budget_mb": 4.0, **parallel},
            }
        )

    with pytest.raises(ConfigError, match=r"need 5\.5 MB on every rank"):
        check_tables_fit(model, cfg(), cfg().layout())
    sharded = cfg(embedding_sharding="row")
    check_tables_fit(model, sharded, sharded.layout())  # 2.7 MB on each of 2 ranks
    fsdp = cfg(dp_shard=-1)  # FSDP shards the tables too: counted as evenly split
    check_tables_fit(model, fsdp, fsdp.layout())
