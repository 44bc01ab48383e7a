"""Model FLOPs utilization: how much of the devices' peak the training arithmetic uses.

MFU = (model FLOPs per sample x samples per second) / (peak FLOP/s per device x devices).

- Model FLOPs per sample: one forward of the unsharded model counted by torch's
  FlopCounterMode (matmuls, convolutions and attention, on the meta device: no memory, no
  compute), times 3 for forward plus backward (the backward costs about twice the
  forward), the convention of the PaLM paper's MFU. Recomputation (activation
  checkpointing) is not counted: it is not model work.
- Peak: a table of known GPUs by dtype (dense, no sparsity), `runtime.peak_tflops` when
  set, and on a CPU the measured matmul rate of one rank's threads on this host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger("gradline.train")

# Dense TFLOP/s per GPU by the dtype of the matmuls (vendor data sheets). The first
# name fragment found in torch.cuda.get_device_name() wins: more specific ones first.
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("GH200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM / HBM3
    ("B200", {"bf16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
)

# The CPU matmul that measures a host's peak: a product of side 384 per thread's worth of
# work reaches it (sides 256 to 1024 measured the same peak here, on 1 and 2 threads) in
# about 2 ms; the best of a few. Every job measures it as it starts, so it is kept short.
CPU_PROBE_SIDE, CPU_PROBE_REPEATS = 384, 6


def cpu_probe_side(threads: int) -> int:
    """The side of the probe's matrices: its work (side^3) grows with the threads."""
    return max(CPU_PROBE_SIDE, round(CPU_PROBE_SIDE * threads ** (1 / 3) / 128) * 128)


def gpu_peak_tflops(name: str, dtype: str) -> float | None:
    """The table's TFLOP/s for a GPU called `name` at `dtype`, or None when unknown."""
    for fragment, peaks in GPU_PEAK_TFLOPS:
        if fragment in name:
            return peaks.get(dtype)
    return None


def cpu_peak_flops(dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of square matmuls on this process's torch threads: the best of a few, so
    a moment of contention does not lower it (a busy host lowers MFU, not the peak)."""
    side = cpu_probe_side(torch.get_num_threads())
    a = torch.randn(side, side, dtype=dtype)
    b = torch.randn(side, side, dtype=dtype)
    a @ b  # warm-up: first-call allocations and kernel choice
    best = float("inf")
    for _ in range(CPU_PROBE_REPEATS):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * side**3 / best


def matmul_dtype(device: torch.device, bf16: bool) -> str:
    """The dtype the peak is read for: bf16 under autocast, else TF32 where CUDA allows it."""
    if bf16:
        return "bf16"
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def device_peak_flops(device: torch.device, bf16: bool, override_tflops: float | None) -> float:
    """Peak FLOP/s of one rank's device; NaN for a GPU the table does not know (then MFU is
    not logged; set runtime.peak_tflops)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cpu":
        return cpu_peak_flops(torch.bfloat16 if bf16 else torch.float32)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    tflops = gpu_peak_tflops(name, matmul_dtype(device, bf16))
    if tflops is None:
        log.warning("no peak FLOP/s known for %s: no MFU (set runtime.peak_tflops)", name)
        return float("nan")
    return tflops * 1e12


def training_flops_per_sample(build: Callable[[], nn.Module], example: torch.Tensor) -> float:
    """3 x the forward FLOPs of one sample of `example` (a batch), counted on the meta
    device. NaN when the model cannot run there (a user model that reads values)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    try:
        with torch.device("meta"):
            model = build()
        with counter, torch.no_grad():
            model(example.to("meta"))
    except Exception as exc:  # any model code may fail on meta: MFU is optional, never fatal
        log.warning("the model's FLOPs cannot be counted on the meta device (%s): no MFU", exc)
        return float("nan")
    return 3.0 * counter.get_total_flops() / example.shape[0]


@dataclass(frozen=True)
class Throughput:
    """What turns an interval's samples/s into tokens/s and MFU."""

    flops_per_sample: float  # training FLOPs (NaN: not countable)
    peak_flops: float  # of all the job's devices together (NaN: unknown)
    tokens_per_sample: int | None  # token windows: the context; else None

    def metrics(self, samples_per_s: float) -> dict[str, float]:
        out = {"model_flops_per_s": self.flops_per_sample * samples_per_s}
        if self.tokens_per_sample:
            out["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        out["mfu"] = out["model_flops_per_s"] / self.peak_flops
        return {k: v for k, v in out.items() if v == v}  # NaN: not known, not logged


def measure_throughput(
    build: Callable[[], nn.Module],
    example: torch.Tensor,
    device: torch.device,
    bf16: bool,
    override_tflops: float | None,
    tokens_per_sample: int | None,
) -> Throughput:
    """This job's Throughput: the model counted once, each rank's device peak summed over
    the ranks (every rank measures its own on a CPU, all at once, as they will train)."""
    from training.engine.topology import all_reduce_sum

    peak = torch.tensor([device_peak_flops(device, bf16, override_tflops)], dtype=torch.float64)
    total_peak = all_reduce_sum(peak).item() if torch.distributed.is_initialized() else peak.item()
    flops = training_flops_per_sample(build, example)
    return Throughput(flops, total_peak, tokens_per_sample)
