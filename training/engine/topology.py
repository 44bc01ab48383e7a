"""Topology and process-group lifecycle: the one place that sets torch.distributed up.

`Topology` is this worker's place in the job: global rank, world size, device, its node
and the restart attempt, and its coordinates on the job's device mesh (pp, dp_replicate,
dp_shard, tp; ranks laid out with tp varying fastest). The mesh's sizes (`shape`) and
the `DeviceMesh` built over them (`device_mesh`, for the layouts that shard) are two
names for two things. The data-parallel coordinates say which share of each global
batch a rank reads: ranks of one tensor- or pipeline-parallel group read the same rows.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from training.config import MESH_DIMS
from training.engine.listen import serve_store, wait_until_listening
from training.errors import ConfigError, StoreUnreachable


@dataclass(frozen=True)
class MeshShape:
    """The device mesh's sizes, outermost first (MESH_DIMS order)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @classmethod
    def of(cls, sizes: dict[str, int]) -> MeshShape:
        return cls(**{d: int(sizes[d]) for d in MESH_DIMS})

    def as_dict(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in MESH_DIMS}

    @property
    def size(self) -> int:
        product = 1
        for f in fields(self):
            product *= getattr(self, f.name)
        return product

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def plain_data_parallel(self) -> bool:
        """Whole replicas only: nothing sharded, tensor-parallel or pipelined."""
        return self.dp_shard == 1 and self.tp == 1 and self.pp == 1


@dataclass(frozen=True)
class Topology:
    """Where this worker is in the job: built once from the environment, passed down."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    node_rank: int = 0  # which node of this rendezvous round (torch elastic's group rank)
    nodes: int = 1  # nodes in this round
    attempt: int = 0  # restarts of the workers so far (0 on the first attempt)
    # Mesh sizes; plain data parallelism over every rank until set.
    shape: MeshShape | None = None
    device_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.shape is None:
            object.__setattr__(self, "shape", MeshShape(dp_replicate=self.world_size))

    def with_shape(self, sizes: dict[str, int] | MeshShape) -> Topology:
        shape = sizes if isinstance(sizes, MeshShape) else MeshShape.of(sizes)
        return replace(self, shape=shape, device_mesh=None)

    def with_device_mesh(self) -> Topology:
        """The same worker with the DeviceMesh of its shape (a collective: every rank
        builds it at the same point)."""
        sizes = tuple(getattr(self.shape, d) for d in MESH_DIMS)
        mesh = init_device_mesh(self.device.type, sizes, mesh_dim_names=MESH_DIMS)
        return replace(self, device_mesh=mesh)

    def coordinate(self, dim: str) -> int:
        """This rank's index along `dim` (the mesh is row-major in MESH_DIMS order)."""
        inner = 1
        for d in reversed(MESH_DIMS):
            size = getattr(self.shape, d)
            if d == dim:
                return (self.rank // inner) % size
            inner *= size
        raise KeyError(dim)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which share of each global batch this rank reads."""
        return self.coordinate("dp_replicate") * self.shape.dp_shard + self.coordinate("dp_shard")

    @property
    def dp_size(self) -> int:
        """How many shares each global batch is cut into."""
        return self.shape.data_parallel

    @property
    def reports(self) -> bool:
        """Whether this rank's losses and metrics count: one rank per data-parallel share
        (tensor-parallel rank 0 of the last pipeline stage), so shares count once."""
        last_stage = self.coordinate("pp") == self.shape.pp - 1
        return last_stage and self.coordinate("tp") == 0

    def per_node(self, workers: int) -> str:
        """What `workers` in all means for `runtime.procs_per_node` on this job's nodes:
        what a message that asks the user to resume on `workers` tells them to set."""
        if self.nodes > 1 and workers % self.nodes == 0:
            return (
                f"runtime.procs_per_node={workers // self.nodes} on each of {self.nodes} nodes "
                f"({workers} workers)"
            )
        if self.nodes > 1:
            return f"{workers} workers in all (runtime.procs_per_node x nodes)"
        return f"runtime.procs_per_node={workers}"

    @classmethod
    def from_env(cls, backend: str = "auto", env: dict[str, Any] | None = None) -> Topology:
        """Read the variables torch.distributed.elastic sets for each worker."""
        env = os.environ if env is None else env
        rank = int(env.get("RANK", "0"))
        world_size = int(env.get("WORLD_SIZE", "1"))
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world_size))
        cuda = torch.cuda.is_available()
        if backend == "auto":
            backend = "nccl" if cuda else "gloo"
        if backend == "nccl" and not cuda:
            raise ConfigError("runtime.backend=nccl needs CUDA GPUs; use gloo or auto on CPU")
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
        return cls(
            rank,
            world_size,
            local_rank,
            backend,
            device,
            node_rank=int(env.get("GROUP_RANK", "0")),
            nodes=int(env.get("GROUP_WORLD_SIZE", max(1, world_size // max(local_world, 1)))),
            attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )


@contextlib.contextmanager
def process_group(topo: Topology, timeout_s: float = 300.0) -> Iterator[None]:
    """Join the job's process group for the duration of the block, then leave it."""
    if topo.device.type == "cuda":
        torch.cuda.set_device(topo.device)
    timeout = timedelta(seconds=timeout_s)
    _reach_the_workers_store(topo, timeout)
    # With NCCL, a gloo side too: the loop's small control tensors (losses, timings,
    # the stop flag, the gradient norm) and checkpoint coordination stay on the CPU.
    backend = "cpu:gloo,cuda:nccl" if topo.backend == "nccl" else topo.backend
    dist.init_process_group(
        backend=backend,
        rank=topo.rank,
        world_size=topo.world_size,
        # env:// rendezvous on the store rank 0 serves at MASTER_ADDR:MASTER_PORT, a new
        # one every rendezvous round (launch.py turns torch's shared agent store off).
        timeout=timeout,
    )
    yield
    # Only on success. After an error, a graceful destroy can wait on a peer that is
    # itself blocked in a collective waiting for us; exiting instead closes our sockets
    # and the peers fail at once ("connection closed by peer"), so the agent restarts.
    end_process_groups()


# How long the gloo threads get to finish with their last work once the groups are
# destroyed. 0.1 s ended a hang that struck 2 runs in 3 of a 4-rank load on 2 cores.
GLOO_DRAIN_SECONDS = 0.1


def end_process_groups() -> None:
    """Destroy every process group, then let gloo's worker threads finish.

    A gloo worker thread releases its last finished collective after the caller has
    moved on, and that release drops Python tensors, so it needs the GIL. Whatever
    still holds the group (DDP's reducer, a layout) frees it later from Python, with
    the GIL held, and the group's destructor joins that thread: a deadlock that hangs
    the process at exit (torch 2.13; pytorch/pytorch#56297). Sleeping hands the GIL
    over so the threads are idle before anything can free the groups."""
    dist.destroy_process_group()
    time.sleep(GLOO_DRAIN_SECONDS)


def _reach_the_workers_store(topo: Topology, timeout: timedelta) -> None:
    """Rank 0 serves the env:// store itself on MASTER_ADDR only: the one
    init_process_group would start listens on every interface. Started elastic-style (no
    agent store), init_process_group then reuses this server (same process, same port).
    The other ranks wait until it listens, so that their first try to connect succeeds
    (a refused one costs torch's back-off: `wait_until_listening`)."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        return  # the agent serves it; rank 0 only connects
    if topo.rank == 0:
        serve_store(address, int(port), timeout)
    elif not wait_until_listening(address, int(port), timeout.total_seconds()):
        raise StoreUnreachable(
            f"rank {topo.rank}: the workers' store at {address}:{port}, which rank 0 serves, "
            f"did not listen within {timeout.total_seconds():g} s (runtime.collective_timeout_s)."
            " See rank 0's error; across machines, check that this node reaches that address "
            "(the first node's runtime.local_addr) and port"
        )


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """The largest value over the ranks (the tensor itself outside a process group)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def reduce_over_shares(tensor: torch.Tensor, topo: Topology) -> torch.Tensor:
    """Sum a per-rank statistic over the data-parallel shares, each counted once."""
    if not topo.reports:
        tensor.zero_()
    return all_reduce_sum(tensor)


def broadcast_object(value: object, topo: Topology) -> object:
    """Rank 0's value on every rank (e.g. which checkpoint to resume from)."""
    box = [value if topo.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
