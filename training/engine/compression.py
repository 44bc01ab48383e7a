"""How data-parallel gradients travel: DDP communication hooks, timed.

DDP hands each gradient bucket to one hook. Ours notes when the bucket was launched
(what backward waits after the last launch is exposed synchronisation, see timing.py),
whether this step synchronises at all (local SGD and DiLoCo skip the all-reduce between
their syncs), and then reduces the bucket:

- none: the mean over ranks in full precision (DDP's default);
- fp16: the bucket travels as float16 (half the bytes), PyTorch's fp16 hook;
- powersgd: low-rank factors P and Q of each matrix travel instead of it (PyTorch's
  PowerSGD hook, Vogels et al. 2019), with error feedback: what compression dropped is
  added back into the next step's gradient, so nothing is lost for good, only delayed.

PowerSGD's state (error feedback, warm-started factors) differs per rank and is part
of exact resume: `state_dict` / `load_state_dict` carry it through checkpoints.
"""

from __future__ import annotations

import io
import logging
import time

import torch
import torch.distributed as dist

log = logging.getLogger("gradline.train")

# PowerSGD runs plain all-reduces for its first steps (DDP rebuilds its buckets after
# the first); 2 is the earliest PyTorch allows with error feedback and warm start.
_POWERSGD_START = 2


class GradientReducer:
    """A DDP comm hook: the gradient mean over ranks, compressed as configured."""

    def __init__(self, world_size: int, compression: str = "none", rank: int = 4) -> None:
        self.world_size, self.compression = world_size, compression
        self.last_launch = 0.0
        self.enabled = True  # False: buckets stay local (steps between local-SGD syncs)
        self.powersgd = None
        if compression == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

            self.powersgd = PowerSGDState(
                process_group=None,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=_POWERSGD_START,
                use_error_feedback=True,
                warm_start=True,
            )

    # No annotations: DDP inspects them, and this module's are strings (future import).
    def hook(self, _state, bucket):
        if not self.enabled:
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future
        self.last_launch = time.perf_counter()
        if self.compression == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                fp16_compress_hook,
            )

            return fp16_compress_hook(None, bucket)
        if self.compression == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

            return powerSGD_hook(self.powersgd, bucket)
        tensor = bucket.buffer().div_(self.world_size)
        future = dist.all_reduce(tensor, async_op=True).get_future()
        return future.then(lambda fut: fut.value()[0])

    def state_dict(self) -> dict:
        """PowerSGD's per-rank state as bytes (empty without it)."""
        if self.powersgd is None:
            return {}
        buffer = io.BytesIO()
        state = {k: getattr(self.powersgd, k) for k in self.powersgd.__slots__}
        state.pop("process_group")
        torch.save(state, buffer)
        return {"powersgd": buffer}

    def load_state_dict(self, state: dict) -> None:
        buffer = state.get("powersgd")
        if self.powersgd is None or buffer is None:
            return
        if isinstance(buffer, io.BytesIO):  # DCP's load hands back what torch.save wrote
            buffer.seek(0)
            # Written by this class into the job's own checkpoint (a numpy RNG inside).
            buffer = torch.load(buffer, weights_only=False)
        for key, value in buffer.items():
            setattr(self.powersgd, key, value)
