"""Embedding tables split across ranks, with the dense part of the model data parallel.

A recommendation model's tables (training.models.embedding_tables) outgrow one device
long before its dense layers do. Here each rank keeps only its share of them
(`parallel.embedding_sharding`):

- table: every table whole on one rank, tables assigned largest first to the rank
  holding the fewest bytes so far (balanced by bytes);
- row: every table's rows cut into contiguous blocks, one per rank, in the order and
  sizes DTensor's Shard(0) uses (ceil(rows / N) each, the last ones shorter or empty),
  so a rank's block is exactly its shard of the whole table in a checkpoint.

A lookup is two all-to-alls (`ShardedEmbeddingTables.forward`): every rank sends each
(table, row) its batch asks for to the rank that owns that row, each owner looks its
requests up locally, and a second all-to-all sends the embeddings back. Backward (the
`_LookupOnOwners` autograd Function) runs the reverse: the output gradients go back to
the owners, which add them into the rows they hold. Each rank's loss is the mean over
its own batch and DDP averages the dense gradients over the N ranks; the owners scale
the embedding gradients they accumulate by 1/N too, so N ranks on N batches compute
what one rank computes on their concatenation.

Only torch.distributed is used (all_to_all_single works on gloo and NCCL). TorchRec
does the same conceptually and runs here on CPU only with one exact pairing of
fbgemm-gpu-cpu and torch; the engine must run with torch and pyarrow alone.

The parameters are plain local tensors, so the optimizer, clipping and DDP's "ignore
these" treat them like any other. Only checkpoints see them differently
(`ShardedEmbeddingState`): row blocks become DTensors with Shard(0) on a 1-D mesh under
the whole model's names, so DCP reshards them to any world size and layout, and a
table held whole by one rank is a plain tensor that only its owner writes and reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from training.config import Config, OptimConfig
from training.engine.replicas import DataParallel
from training.engine.steps import StepInputs, StepResult
from training.engine.topology import Topology
from training.errors import ConfigError
from training.models.embedding_tables import EmbeddingTables

Sharding = Literal["none", "table", "row"]
MB = 1 << 20


@dataclass(frozen=True)
class ShardPlan:
    """Which rows of which table each rank holds: for table t, rank r holds rows
    bounds[t][r] to bounds[t][r + 1] (an empty range where it holds none)."""

    mode: Literal["table", "row"]
    rows: tuple[int, ...]
    dim: int
    world: int
    bounds: tuple[tuple[int, ...], ...]

    def block(self, table: int, rank: int) -> tuple[int, int]:
        return self.bounds[table][rank], self.bounds[table][rank + 1]

    def rows_on(self, rank: int) -> int:
        """Rows of all tables this rank holds."""
        return sum(
            end - start for start, end in (self.block(t, rank) for t in range(len(self.rows)))
        )

    def holds(self, table: int, rank: int) -> bool:
        """Whether `rank` keeps a parameter for `table` (row-wise: always, maybe empty)."""
        start, end = self.block(table, rank)
        return self.mode == "row" or end > start


def plan_shards(rows: Sequence[int], dim: int, world: int, mode: str) -> ShardPlan:
    """The plan for `mode` over `world` ranks; a pure function, the same on every rank."""
    rows = tuple(int(r) for r in rows)
    if mode == "row":
        bounds = []
        for total in rows:
            block = math.ceil(total / world)
            bounds.append(tuple(min(r * block, total) for r in range(world + 1)))
        return ShardPlan("row", rows, dim, world, tuple(bounds))
    if mode != "table":
        raise ValueError(f"embedding sharding is table or row, not {mode!r}")
    held = [0] * world
    owner = [0] * len(rows)
    # Largest first, each to the least-loaded rank (ties: the lower index): within 4/3 of
    # the best balance (LPT), and the same on every rank.
    for t in sorted(range(len(rows)), key=lambda t: (-rows[t], t)):
        rank = min(range(world), key=lambda r: (held[r], r))
        owner[t] = rank
        held[rank] += rows[t]
    bounds = tuple(
        tuple(0 if r <= owner[t] else total for r in range(world + 1))
        for t, total in enumerate(rows)
    )
    return ShardPlan("table", rows, dim, world, bounds)


# ---------------------------------------------------------------------------- budget


def optimizer_copies(optim: OptimConfig) -> int:
    """Tensors of optimizer state per parameter tensor: AdamW's two moments, SGD's
    momentum buffer (none without momentum)."""
    if optim.name == "sgd":
        return 1 if optim.momentum > 0 else 0
    return 2


def state_mb(rows: int, dim: int, element_size: int, optim: OptimConfig) -> float:
    """MB of embedding state for `rows` rows: weights plus the optimizer's state."""
    return rows * dim * element_size * (1 + optimizer_copies(optim)) / MB


def check_budget(
    rows: Sequence[int],
    dim: int,
    element_size: int,
    optim: OptimConfig,
    budget_mb: float,
    mode: Sharding,
    world: int,
) -> None:
    """Refuse, before training, tables whose state does not fit a rank's budget
    (`parallel.embedding_budget_mb`, 0: no limit): unsharded, the whole; sharded, the
    largest share any rank holds."""
    if budget_mb <= 0:
        return
    total = state_mb(sum(rows), dim, element_size, optim)
    what = f"weights + {optim.name} state"
    if mode == "none":
        if total <= budget_mb:
            return
        per_rank = state_mb(math.ceil(sum(rows) / world), dim, element_size, optim)
        raise ConfigError(
            f"the embedding tables need {total:.1f} MB on every rank ({what}, unsharded) "
            f"but parallel.embedding_budget_mb is {budget_mb:g}: set "
            f"parallel.embedding_sharding: row (about {per_rank:.1f} MB per rank over "
            f"{world} ranks) or table, run on more ranks, or raise the budget"
        )
    plan = plan_shards(rows, dim, world, mode)
    largest = max(range(world), key=plan.rows_on)
    share = state_mb(plan.rows_on(largest), dim, element_size, optim)
    if share > budget_mb:
        hint = "; row sharding splits every table evenly" if mode == "table" else ""
        raise ConfigError(
            f"sharded {mode}-wise over {world} ranks, rank {largest} holds {share:.1f} MB of "
            f"the embedding tables' {total:.1f} MB ({what}), over "
            f"parallel.embedding_budget_mb {budget_mb:g}: run on more ranks or raise the "
            f"budget{hint}"
        )


def check_tables_fit(model: nn.Module, cfg: Config, mesh: dict[str, int]) -> None:
    """`check_budget` for the model's tables (if any) laid out as `cfg` and the mesh say
    (FSDP's dp_shard splits them as evenly as row sharding does). The train stage calls
    it before any worker starts, each worker before its first step."""
    found = find_tables(model)
    if found is None:
        return
    tables, par = found[1], cfg.parallel
    mode, ranks = par.embedding_sharding, mesh["dp_replicate"] * mesh["dp_shard"]
    if mode == "none" and mesh["dp_shard"] > 1:
        mode, ranks = "row", mesh["dp_shard"]
    size = tables.tables[0].weight.element_size()
    check_budget(tables.rows, tables.dim, size, cfg.optim, par.embedding_budget_mb, mode, ranks)


# ---------------------------------------------------------------------------- lookup


@dataclass
class ExchangeLog:
    """What the all-to-alls of a step cost this rank: their (start, end) times and the
    bytes it sent to other ranks (its own slice stays home)."""

    spans: list[tuple[float, float]] = field(default_factory=list)
    bytes_sent: float = 0.0

    def seconds(self) -> float:
        return sum(end - start for start, end in self.spans)

    def seconds_within(self, start: float, end: float) -> float:
        """Seconds of the exchanges inside the window [start, end]."""
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.spans)

    def take(self) -> ExchangeLog:
        """This log's contents, leaving it empty for the next step."""
        taken = ExchangeLog(self.spans, self.bytes_sent)
        self.spans, self.bytes_sent = [], 0.0
        return taken


class Exchange:
    """all_to_all_single on the tables' own process group, timed and counted."""

    def __init__(self, group, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.log = ExchangeLog()

    def __call__(self, tensor: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """Rows of `tensor` cut into `send[r]` for rank r; returns what every rank sent
        this one (`receive[r]` rows from rank r), in rank order."""
        if self.world == 1:
            return tensor
        tensor = tensor.contiguous()
        out = tensor.new_empty((sum(receive), *tensor.shape[1:]))
        started = time.perf_counter()
        dist.all_to_all_single(out, tensor, receive, send, group=self.group)
        self.log.spans.append((started, time.perf_counter()))
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()  # may be empty
        self.log.bytes_sent += (sum(send) - send[self.rank]) * row_bytes
        return out

    def counts(self, send: torch.Tensor) -> torch.Tensor:
        """How many rows each rank will send this one, given what this one sends each."""
        if self.world == 1:
            return send
        out = torch.empty_like(send)
        started = time.perf_counter()
        dist.all_to_all_single(out, send, group=self.group)
        self.log.spans.append((started, time.perf_counter()))
        self.log.bytes_sent += (self.world - 1) * send.element_size()
        return out


class _LookupOnOwners(torch.autograd.Function):
    """Forward: look up the (table, local row) requests this rank received in the rows it
    holds and send the embeddings back to their askers. Backward: receive the askers'
    output gradients and add them, scaled, into the rows they came from."""

    @staticmethod
    def forward(ctx, requests, anchor, exchange, send, receive, tables, scale, *weights):
        # `anchor` only makes the output require grad on a rank that holds no table, so
        # that its backward runs (and joins the owners' all-to-all) like everyone's.
        table_of, row_of = requests[:, 0], requests[:, 1]
        dtype = weights[0].dtype if weights else anchor.dtype
        found = anchor.new_zeros((len(requests), anchor.shape[1]), dtype=dtype)
        picks = []
        for table, weight in zip(tables, weights, strict=True):
            at = (table_of == table).nonzero().squeeze(1)
            rows = row_of.index_select(0, at)
            found.index_copy_(0, at, weight.detach().index_select(0, rows))
            picks.append((at, rows))
        ctx.exchange, ctx.send, ctx.receive, ctx.scale, ctx.picks = (
            exchange, send, receive, scale, picks
        )  # fmt: skip
        ctx.shapes = [w.shape for w in weights]
        # The embeddings travel back: what was received from rank r returns to rank r.
        return exchange(found, receive, send)

    @staticmethod
    def backward(ctx, grad_out):
        grad_found = ctx.exchange(grad_out, ctx.send, ctx.receive)
        grads = []
        for (at, rows), shape in zip(ctx.picks, ctx.shapes, strict=True):
            grad = grad_found.new_zeros(shape)
            grad.index_add_(0, rows, grad_found.index_select(0, at), alpha=ctx.scale)
            grads.append(grad)
        return (None, None, None, None, None, None, None, *grads)  # one per input


class ShardedEmbeddingTables(nn.Module):
    """An EmbeddingTables whose rows are spread over the ranks of `group` by `plan`:
    the same forward ((N, C) ids -> (N, C, dim)) and the same parameter names
    (`tables.<t>.weight`), each holding only this rank's block (table-wise: only the
    tables this rank owns have a weight)."""

    def __init__(
        self, whole: EmbeddingTables, plan: ShardPlan, rank: int, group, grad_scale: float
    ) -> None:
        super().__init__()
        self.rows, self.dim, self.plan, self.rank = whole.rows, whole.dim, plan, rank
        self.grad_scale = grad_scale
        self.exchange = Exchange(group, rank, plan.world)
        self.tables = nn.ModuleList()
        for t, table in enumerate(whole.tables):
            holder = nn.Module()
            if plan.holds(t, rank):
                start, end = plan.block(t, rank)
                holder.weight = nn.Parameter(table.weight.detach()[start:end].clone())
            self.tables.append(holder)
        device = whole.tables[0].weight.device
        # Not buffers: they are the plan, not state, and stay out of the state dict.
        self._sizes = torch.tensor(self.rows, dtype=torch.int64, device=device)
        self._bounds = torch.tensor(plan.bounds, dtype=torch.int64, device=device)
        self.held = [t for t in range(len(self.rows)) if plan.holds(t, rank)]

    def owned_parameters(self) -> list[nn.Parameter]:
        return [self.tables[t].weight for t in self.held]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, columns = ids.shape
        rows = torch.remainder(ids.long(), self._sizes)  # EmbeddingTables.bucketed
        # The owner of row x of table t is the rank r with bounds[t][r] <= x < bounds[t][r+1].
        owner = torch.searchsorted(
            self._bounds[:, 1:].contiguous(), rows.T.contiguous(), right=True
        ).T
        table = torch.arange(columns, device=ids.device).expand(batch, columns)
        local = rows - self._bounds[table, owner]
        owner = owner.reshape(-1)
        order = torch.argsort(owner, stable=True)  # requests grouped by owner, in rank order
        requests = torch.stack([table.reshape(-1), local.reshape(-1)], dim=1).index_select(0, order)
        send_counts = torch.bincount(owner, minlength=self.plan.world)
        receive_counts = self.exchange.counts(send_counts)
        send, receive = send_counts.tolist(), receive_counts.tolist()
        received = self.exchange(requests, send, receive)
        weights = [self.tables[t].weight for t in self.held]
        dtype = weights[0].dtype if weights else torch.get_default_dtype()
        anchor = self._sizes.new_empty((0, self.dim), dtype=dtype)
        anchor.requires_grad_(torch.is_grad_enabled())
        found = _LookupOnOwners.apply(
            received, anchor, self.exchange, send, receive, self.held, self.grad_scale, *weights
        )
        # Back in the batch's order.
        return found.index_select(0, torch.argsort(order)).view(batch, columns, self.dim)

    def state_bytes(self) -> int:
        """Bytes of the table weights this rank holds."""
        return sum(w.numel() * w.element_size() for w in self.owned_parameters())


def find_tables(model: nn.Module) -> tuple[str, EmbeddingTables] | None:
    """The model's one EmbeddingTables and its dotted name, or None."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, EmbeddingTables)]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ConfigError(
            f"parallel.embedding_sharding shards a model's one EmbeddingTables; this model "
            f"has {len(found)} ({names}): hold all tables in one"
        )
    return found[0] if found else None


def swap_in(model: nn.Module, name: str, sharded: nn.Module) -> None:
    """Put `sharded` where the submodule `name` was (the same dotted name)."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, sharded)


# ------------------------------------------------------------------------ checkpoints


class ShardedEmbeddingState:
    """A Stateful for DCP around a layout's state whose tables are sharded: the same
    keys as the unsharded model's; row blocks (weights and the optimizer's per-row
    state) as DTensors with Shard(0) on a 1-D mesh over the ranks, so DCP reshards them;
    table-wise, plain tensors present only on their owner."""

    def __init__(self, inner, names: dict[str, torch.Size], mesh: DeviceMesh | None) -> None:
        # names: the dotted name of every row-sharded weight -> the whole table's shape.
        self.inner, self.names, self.mesh = inner, names, mesh

    def _whole_shape(self, key: str, value: Any) -> torch.Size | None:
        """The whole table's shape when `key` holds a row block of one (a weight, or an
        optimizer state of the same shape), else None."""
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            return None
        for name, shape in self.names.items():
            if key == name or key.startswith(f"state.{name}."):
                return shape
        return None

    def state_dict(self) -> dict:
        state = self.inner.state_dict()
        for part in ("model", "optim"):
            for key, value in list(state.get(part, {}).items()):
                shape = self._whole_shape(key, value)
                if shape is not None:
                    state[part][key] = DTensor.from_local(
                        value, self.mesh, [Shard(0)], run_check=False, shape=shape,
                        stride=(shape[1], 1),
                    )  # fmt: skip
        return state

    def load_state_dict(self, state: dict) -> None:
        for part in ("model", "optim"):
            for key, value in list(state.get(part, {}).items()):
                if isinstance(value, DTensor):
                    state[part][key] = value.to_local()
        self.inner.load_state_dict(state)


# ----------------------------------------------------------------------------- layout


class EmbeddingParallel(DataParallel):
    """DDP for the dense part, the embedding tables sharded over the same ranks.

    The model's EmbeddingTables is swapped for a ShardedEmbeddingTables holding this
    rank's share; DDP ignores those parameters (their gradients are complete on their
    owner after the backward all-to-all). A forward is a collective (every rank must join
    the lookups), so validation makes the same calls on every rank."""

    forward_is_collective = True
    replicated = False  # the embedding rows are not: the gradient norm is all-reduced

    def __init__(self, model: nn.Module, topo: Topology, cfg: Config, loss_fn, autocast) -> None:
        mode = cfg.parallel.embedding_sharding
        found = find_tables(model)
        if found is None:
            raise ConfigError(
                f"parallel.embedding_sharding={mode} shards a model's EmbeddingTables "
                f"(training.models.embedding_tables, e.g. model.name: dlrm); this model "
                "has none: set parallel.embedding_sharding: none"
            )
        name, whole = found
        world = topo.dp_size
        plan = plan_shards(whole.rows, whole.dim, world, mode)
        # The lookups' all-to-alls on a group of their own: they never interleave with
        # DDP's bucket all-reduces, which run asynchronously during the same backward.
        group = dist.new_group() if world > 1 else None
        # DDP averages the dense gradients; 1/N makes the rows' sums the same average.
        self.tables = ShardedEmbeddingTables(whole, plan, topo.dp_rank, group, 1.0 / world)
        swap_in(model, name, self.tables)
        held = [f"{name}.tables.{t}.weight" for t in self.tables.held]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, held)
        self.held_alone = frozenset(id(p) for p in self.tables.owned_parameters())
        super().__init__(model, topo, cfg, loss_fn, autocast)
        self.mesh = init_device_mesh(topo.device.type, (world,)) if mode == "row" else None
        rows = {
            f"{name}.tables.{t}.weight": torch.Size((r, whole.dim))
            for t, r in enumerate(whole.rows)
        }
        self.row_blocks = rows if mode == "row" else {}
        self.last_exchange = ExchangeLog()  # the latest step's all-to-alls (benchmarks)

    def forward_backward(self, inputs: StepInputs) -> StepResult:
        self.tables.exchange.log.take()  # a fresh log for this step
        result = super().forward_backward(inputs)
        ended = time.perf_counter()
        log = self.last_exchange = self.tables.exchange.log.take()
        # DDP's exposed wait is the window from its last bucket to the end of backward;
        # a backward all-to-all inside that window is already in it.
        window = log.seconds_within(ended - result.sync_wait, ended)
        waited = result.sync_wait + log.seconds() - window
        return StepResult(result.loss, waited, bytes_sent=result.bytes_sent + log.bytes_sent)

    @property
    def state(self) -> ShardedEmbeddingState:
        # DataParallel.resume_state returns this too.
        return ShardedEmbeddingState(super().state, self.row_blocks, self.mesh)

    def embedding_bytes(self) -> int:
        """Bytes of embedding state this rank holds: its rows and their optimizer state."""
        state = self.optimizer.optimizers[0].state
        total = 0
        for param in self.tables.owned_parameters():
            total += param.numel() * param.element_size()
            for value in state.get(param, {}).values():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    total += value.numel() * value.element_size()
        return total
