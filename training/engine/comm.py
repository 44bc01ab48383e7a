"""Counting collective communication: bytes each rank sends and seconds it spends in it.

`CommMeter` is a dispatch mode: while active, the bytes of every collective that goes
through the dispatcher (c10d ops from FSDP2, DDP and pipeline send/recv; functional
collectives from tensor parallelism) are counted. Bytes follow the ring model each rank
pays: an all-reduce of S bytes over n ranks sends 2(n-1)/n x S, an all-gather or
reduce-scatter of S bytes in total (n-1)/n x S, a send S.

Time is what a rank waits: a c10d op only launches its work, and a blocking collective
then waits outside the dispatcher (`work.wait()`), so the meter times the blocking
torch.distributed calls themselves (FSDP2's all-gathers and reduce-scatters, gradient
all-reduces) and tensor parallelism's waits (`wait_tensor`). Pipeline send/recv waits
are not counted: they are the pipeline's bubble. The mode costs a Python call per
operator, so the loop turns it on for one sampled step per interval.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from training.engine.timing import adds_seconds

_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# torch.distributed calls that return only once the collective is done (unless async).
_BLOCKING = (
    "all_reduce",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "broadcast",
)


def _tensors(value: object) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


# Argument names that hold what a rank contributes (outputs of gathers are not sent).
_INPUTS = ("input_tensor", "input_tensors", "input", "inputs", "tensors", "tensor", "self")


def _named(func, args: tuple, kwargs: dict) -> dict:
    return dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs


def _payload(named: dict) -> int:
    for name in _INPUTS:
        if name in named:
            return sum(t.numel() * t.element_size() for t in _tensors(named[name]))
    return 0


def _group_size(named: dict) -> int:
    """The number of ranks a collective spans, from its group size, group or group name."""

    if isinstance(named.get("group_size"), int):
        return named["group_size"]
    if isinstance(named.get("process_group"), torch.ScriptObject):  # c10d ops
        return ProcessGroup.unbox(named["process_group"]).size()
    if isinstance(named.get("group_name"), str):  # functional collectives
        return _resolve_process_group(named["group_name"]).size()
    return 1


def ring_bytes(op: str, payload: int, n: int) -> float:
    """Bytes one rank sends for collective `op` whose tensors hold `payload` bytes."""
    if n <= 1 or "wait" in op or op.startswith("recv") or "barrier" in op:
        return 0.0
    if "allreduce" in op or "all_reduce" in op:
        return 2.0 * (n - 1) / n * payload
    if "gather" in op:  # the input is this rank's shard: it goes to n-1 peers
        return float((n - 1) * payload)
    if "reduce_scatter" in op:  # the input is the whole: all but this rank's share leaves
        return (n - 1) / n * payload
    return float(payload)  # send, broadcast, and the rest: what is handed over


class CommMeter(TorchDispatchMode):
    """Bytes sent and seconds waited in collectives while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_sent = 0.0
        self.seconds = 0.0
        self.calls = 0
        self._originals: dict[str, Callable] = {}

    def __enter__(self):
        # Callers look these up as `dist.<name>` at call time, so the timed versions are
        # what runs while the meter is active; __exit__ puts the originals back.
        for name in _BLOCKING:
            original = self._originals[name] = getattr(dist, name)
            setattr(dist, name, adds_seconds(original, self))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in _NAMESPACES:
            return func(*args, **kwargs)
        op = func._schema.name.split("::")[-1]
        named = _named(func, args, kwargs)
        started = time.perf_counter()
        out = func(*args, **kwargs)
        if op == "wait_tensor":  # a functional collective's wait: time spent waiting
            self.seconds += time.perf_counter() - started
        self.bytes_sent += ring_bytes(op, _payload(named), _group_size(named))
        self.calls += 1
        return out


# torch.distributed calls a data-parallel step makes (DDP's hooks, parameter averaging),
# with the ring_bytes name of what each one does.
_WIRE_CALLS = {"all_reduce": "allreduce", "broadcast": "broadcast", "send": "send", "isend": "send"}


class WireCounter:
    """Bytes this rank hands to torch.distributed while `active()`: one wrapper per call
    (not per operator, unlike CommMeter), so it can stay on for every step. Under plain
    data parallelism every byte of a step goes through these calls: the gradient hooks
    (full, fp16 or PowerSGD factors) and local SGD's parameter averaging."""

    def __init__(self) -> None:
        self.bytes_sent = 0.0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        originals = {name: getattr(dist, name) for name in _WIRE_CALLS}
        for name, original in originals.items():
            setattr(dist, name, self._counting(original, _WIRE_CALLS[name]))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)

    def _counting(self, fn: Callable, op: str) -> Callable:
        def counted(tensor, *args, **kwargs):
            group = kwargs.get("group")
            n = dist.get_world_size(group) if op != "send" else 2
            self.bytes_sent += ring_bytes(op, tensor.numel() * tensor.element_size(), n)
            return fn(tensor, *args, **kwargs)

        return counted
