"""Parallelism is applied to the model here and nowhere else.

`parallelize` reads the job's mesh (the topology's shape) and update rule and returns
this rank's `Layout` (training.engine.steps): its model parts with their optimizers,
how one step's forward and backward run on its share of a batch, and the update rule
that combines the replicas' work.

    whole replicas       DataParallel (DDP; sync, local SGD, DiLoCo)    replicas.py
                         AsyncReplicas (a parameter server)            replicas.py
    tables split,        EmbeddingParallel (embedding tables table- or  embedding_sharding.py
    dense replicated       row-wise over the DDP ranks, all-to-all lookups)
    split across ranks   Sharded (FSDP2 / HSDP, tensor parallel)        layouts.py
                         Pipelined (stages, each maybe TP and sharded)  layouts.py
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from training.config import Config
from training.engine.embedding_sharding import EmbeddingParallel, check_tables_fit
from training.engine.layouts import Autocast, Pipelined, Sharded
from training.engine.replicas import AsyncReplicas, DataParallel
from training.engine.steps import Layout, LearningRate, LossFn
from training.engine.topology import Topology


def parallelize(
    build: Callable[[], nn.Module],
    cfg: Config,
    topo: Topology,
    loss_fn: LossFn,
    autocast: Autocast,
    schedule: LearningRate,
) -> Layout:
    """This rank's share of the model for the job's layout. `build()` returns a freshly
    initialised whole model, the same on every rank (seeded). A layout that shards or
    splits needs `topo.device_mesh` (Topology.with_device_mesh)."""
    if cfg.parallel.embedding_budget_mb or cfg.parallel.embedding_sharding != "none":
        model = build()
        check_tables_fit(model, cfg, topo.shape.as_dict())
        if cfg.parallel.embedding_sharding != "none":
            return EmbeddingParallel(model.to(topo.device), topo, cfg, loss_fn, autocast)
        build = lambda: model  # noqa: E731 (built once, laid out below as any model)
    if cfg.update.rule == "async":
        model = build().to(topo.device)
        return AsyncReplicas(model, topo, cfg, loss_fn, autocast, schedule)
    if topo.shape.plain_data_parallel:
        return DataParallel(build().to(topo.device), topo, cfg, loss_fn, autocast)
    if topo.shape.pp > 1:
        return Pipelined(build, topo, cfg, loss_fn, autocast)
    return Sharded(build(), topo, cfg, loss_fn, autocast)
