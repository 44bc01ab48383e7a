"""Topology and process-group lifecycle: the one place that sets torch.distributed up.

`Topology` is this worker's place in the job: global rank, world size, device, and its
coordinates on the job's device mesh (pp, dp_replicate, dp_shard, tp; ranks laid out
with tp varying fastest). The data-parallel coordinates say which share of each global
batch a rank reads: ranks of one tensor- or pipeline-parallel group read the same rows.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from training.config import MESH_DIMS
from training.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    """Rank, world size, device and data-parallel coordinates: built once, passed down."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    # Mesh sizes (pp, dp_replicate, dp_shard, tp); plain data parallelism until set.
    mesh: dict[str, int] = field(default_factory=dict)

    def with_mesh(self, mesh: dict[str, int]) -> Topology:
        return replace(self, mesh=dict(mesh))

    def _size(self, dim: str) -> int:
        return self.mesh.get(dim, self.world_size if dim == "dp_replicate" else 1)

    def coordinate(self, dim: str) -> int:
        """This rank's index along `dim` (the mesh is row-major in MESH_DIMS order)."""
        inner = 1
        for d in reversed(MESH_DIMS):
            if d == dim:
                return (self.rank // inner) % self._size(d)
            inner *= self._size(d)
        raise KeyError(dim)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which share of each global batch this rank reads."""
        return self.coordinate("dp_replicate") * self._size("dp_shard") + self.coordinate(
            "dp_shard"
        )

    @property
    def dp_size(self) -> int:
        """How many shares each global batch is cut into."""
        return self._size("dp_replicate") * self._size("dp_shard")

    @property
    def reports(self) -> bool:
        """Whether this rank's losses and metrics count: one rank per data-parallel share
        (tensor-parallel rank 0 of the last pipeline stage), so shares count once."""
        last_stage = self.coordinate("pp") == self._size("pp") - 1
        return last_stage and self.coordinate("tp") == 0

    @classmethod
    def from_env(cls, backend: str = "auto") -> Topology:
        """Read the variables torch.distributed.elastic sets for each worker."""
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available()
        if backend == "auto":
            backend = "nccl" if cuda else "gloo"
        if backend == "nccl" and not cuda:
            raise ConfigError("runtime.backend=nccl needs CUDA GPUs; use gloo or auto on CPU")
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
        return cls(rank, world_size, local_rank, backend, device)


@contextlib.contextmanager
def process_group(topo: Topology, timeout_s: float = 300.0) -> Iterator[None]:
    """Join the job's process group for the duration of the block, then leave it."""
    if topo.device.type == "cuda":
        torch.cuda.set_device(topo.device)
    timeout = timedelta(seconds=timeout_s)
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
    dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
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
