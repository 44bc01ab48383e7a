"""One line naming the machine a job trains on, recorded on its run for the model card.

It runs in the launcher, which must not initialise CUDA (seconds and GPU memory spent
for nothing: the workers use the GPUs), so GPU names come from `nvidia-smi` where it
exists. On several nodes it describes the node that opened the run.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

TAG_HARDWARE = "gradline.hardware"


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _gpus() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def describe_hardware() -> str:
    """e.g. "16 CPU cores (x86_64, Linux), 1 x NVIDIA H100 80GB HBM3" or "..., no GPU"."""
    cpus = f"{_cpu_count()} CPU cores ({platform.machine()}, {platform.system()})"
    gpus = _gpus()
    if not gpus:
        return f"{cpus}, no GPU"
    counts: dict[str, int] = {}
    for name in gpus:
        counts[name] = counts.get(name, 0) + 1
    return f"{cpus}, " + ", ".join(f"{n} x {name}" for name, n in counts.items())
