"""How data-parallel gradients travel: DDP communication hooks, timed.

DDP hands each gradient bucket to one hook. Ours notes when the bucket was launched
(what backward waits after the last launch is exposed synchronisation, see timing.py),
and then reduces the bucket (local SGD and DiLoCo skip DDP between their syncs):

- none: the mean over ranks in full precision (DDP's default);
- fp16: the bucket travels as float16 (half the bytes), PyTorch's fp16 hook;
- powersgd: low-rank factors P and Q of each matrix travel instead of it (PyTorch's
  PowerSGD hook, Vogels et al. 2019), with error feedback: what compression dropped is
  added back into the next step's gradient, so nothing is lost for good, only delayed.

PowerSGD's state (error feedback, warm-started factors) differs per rank and is part
of exact resume. PyTorch keeps it per DDP bucket, as flat vectors in the bucket's order
of parameters, and DDP re-orders its buckets after the first step of every attempt; so
the checkpoint holds it per parameter name, and a restarted job lays it back into each
bucket's order the first time the bucket comes through the hook.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

log = logging.getLogger("gradline.train")

# PowerSGD runs plain all-reduces for its first steps (DDP rebuilds its buckets after
# the first); 2 is the earliest PyTorch allows with error feedback and warm start.
_POWERSGD_START = 2


class GradientReducer:
    """A DDP comm hook: the gradient mean over ranks, compressed as configured."""

    def __init__(self, world_size: int, compression: str = "none", rank: int = 4) -> None:
        self.world_size, self.compression = world_size, compression
        self.last_launch = 0.0
        self.names: dict[int, str] = {}  # id(parameter) -> its name (set by the owner)
        self.shapes: dict[str, torch.Size] = {}  # name -> shape (set by the owner)
        self.bucket_names: dict[int, list[str]] = {}  # each bucket's parameters, in order
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # restored, not yet laid out
        self.powersgd = None
        if compression == "powersgd":
            self.powersgd = PowerSGDState(
                process_group=None,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=_POWERSGD_START,
                use_error_feedback=True,
                warm_start=True,
            )

    # No annotations: DDP inspects them, and this module's are strings (future import).
    def hook(self, _state, bucket):
        self.last_launch = time.perf_counter()
        if self.compression == "fp16":
            return fp16_compress_hook(None, bucket)
        if self.compression == "powersgd":
            index = bucket.index()
            names = [self.names[id(p)] for p in bucket.parameters()]
            before = self.bucket_names.get(index)
            if before is not None and before != names:  # DDP rebuilt its buckets
                self.pending.update(self._take(index, before))
            self.bucket_names[index] = names
            if self.pending:
                self._lay_out(index, names, bucket.buffer())
            return powerSGD_hook(self.powersgd, bucket)
        tensor = bucket.buffer().div_(self.world_size)
        future = dist.all_reduce(tensor, async_op=True).get_future()
        return future.then(lambda fut: fut.value()[0])

    def _pieces(self, index: int, names: list[str]) -> Iterator[tuple[str, str, slice]]:
        """(kind, parameter name, slice of the bucket's flat vector) for PowerSGD's error
        ("error"), P and Q factors of bucket `index` whose parameters are `names`."""
        shapes = {n: s for n, s in self.shapes.items() if n in names}
        offset, groups = 0, {}
        for name in names:
            numel = shapes[name].numel()
            yield "error", name, slice(offset, offset + numel)
            offset += numel
            rows = shapes[name][0] if len(shapes[name]) else 1
            cols = max(1, numel // max(rows, 1))
            r = min(rows, cols, self.powersgd.matrix_approximation_rank)
            if _should_compress(rows, cols, r, self.powersgd.min_compression_rate):
                groups.setdefault((rows, cols), []).append((name, rows * r, cols * r))
        p_at = q_at = 0  # PyTorch lays factors out grouped by matrix shape, first seen first
        for members in groups.values():
            for name, p_len, q_len in members:
                yield "p", name, slice(p_at, p_at + p_len)
                yield "q", name, slice(q_at, q_at + q_len)
                p_at, q_at = p_at + p_len, q_at + q_len

    def _memories(self) -> dict[str, dict[int, torch.Tensor]]:
        state = self.powersgd
        return {"error": state.error_dict, "p": state.p_memory_dict, "q": state.q_memory_dict}

    def _lay_out(self, index: int, names: list[str], buffer: torch.Tensor) -> None:
        """Put restored per-parameter state into bucket `index`'s flat vectors."""
        if not all(n in self.pending for n in names):
            return
        memories, sizes = self._memories(), {}
        for kind, _, where in self._pieces(index, names):
            sizes[kind] = max(sizes.get(kind, 0), where.stop)
        for kind, size in sizes.items():
            memories[kind][index] = torch.zeros(size, dtype=buffer.dtype, device=buffer.device)
        for kind, name, where in self._pieces(index, names):
            memories[kind][index][where] = self.pending[name][kind]
        for name in names:
            del self.pending[name]
        # A bucket whose state was never created (before PowerSGD starts) has none.
        for kind in ("error", "p", "q"):
            if kind not in sizes:
                memories[kind].pop(index, None)

    def _take(self, index: int, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket `index`'s state, per parameter name (laid out in the order `names`)."""
        per_name: dict[str, dict[str, torch.Tensor]] = {}
        memories = self._memories()
        for kind, name, where in self._pieces(index, names):
            if index in memories[kind]:
                per_name.setdefault(name, {})[kind] = memories[kind][index][where].clone()
        return per_name

    def state_dict(self) -> dict:
        """PowerSGD's per-rank state as bytes (empty without it), per parameter name."""
        if self.powersgd is None:
            return {}
        per_name: dict[str, dict[str, torch.Tensor]] = {}
        for index, names in self.bucket_names.items():
            per_name.update(self._take(index, names))
        for name, pieces in self.pending.items():  # restored, its bucket not yet seen
            per_name.setdefault(name, pieces)
        slots = {"iter": self.powersgd.iter, "rng": _rng_as_tensors(self.powersgd.rng)}
        buffer = io.BytesIO()
        torch.save({"slots": slots, "per_name": per_name}, buffer)
        return {"powersgd": buffer}

    def load_state_dict(self, state: dict) -> None:
        buffer = state.get("powersgd")
        if self.powersgd is None or buffer is None:
            return
        if isinstance(buffer, io.BytesIO):  # DCP's load hands back what torch.save wrote
            buffer.seek(0)
            # Tensors and plain numbers only: weights_only refuses anything that runs code.
            buffer = torch.load(buffer, weights_only=True)
        slots = buffer["slots"]
        self.powersgd.iter = int(slots["iter"])
        self.powersgd.rng = _rng_from_tensors(slots["rng"])
        self.pending = buffer["per_name"]
        for memory in self._memories().values():
            memory.clear()


def _rng_as_tensors(rng: np.random.RandomState) -> dict:
    """PowerSGD's numpy generator (it draws the warm-start factors) as a tensor and plain
    numbers, so the checkpoint holds no pickled object."""
    name, keys, pos, has_gauss, cached_gaussian = rng.get_state()
    if name != "MT19937":
        raise ValueError(f"PowerSGD's generator is {name}, not MT19937: cannot checkpoint it")
    return {
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _rng_from_tensors(saved: dict) -> np.random.RandomState:
    rng = np.random.RandomState()
    keys = saved["keys"].numpy().astype(np.uint32)
    rng.set_state(("MT19937", keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    return rng


def _should_compress(rows: int, cols: int, rank: int, min_rate: float) -> bool:
    """PyTorch PowerSGD's choice: a matrix is compressed when its factors are smaller
    than it by more than `min_rate` (tensors of one dimension never are)."""
    return (rows + cols) * rank * min_rate < rows * cols
