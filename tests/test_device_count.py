"""How many device slots a new quota gets (tasks.quota.devices_here): the GPUs torch sees,
or the CPU cores this process may use; without a GPU driver, known without torch."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

_COUNT = """
import sys
from tasks import quota
quota.GPU_DRIVER_PATHS = (sys.argv[1],)
if len(sys.argv) > 2:  # a driver, and torch counting its GPUs
    import torch
    torch.cuda.device_count = lambda: int(sys.argv[2])
print(quota.devices_here(), "torch" in sys.modules)
"""


def _count(*args: str) -> tuple[int, bool]:
    done = subprocess.run(
        [sys.executable, "-c", _COUNT, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    count, imported = done.stdout.split()
    return int(count), imported == "True"


def test_without_a_gpu_driver_the_cores_this_process_may_use_and_no_torch(tmp_path) -> None:
    assert _count(str(tmp_path / "no-driver")) == (len(os.sched_getaffinity(0)), False)


def test_with_a_gpu_driver_the_gpus_torch_sees_else_the_cores(tmp_path) -> None:
    driver = tmp_path / "nvidiactl"
    driver.touch()
    assert _count(str(driver), "3") == (3, True)
    assert _count(str(driver), "0") == (len(os.sched_getaffinity(0)), True)  # a CPU build
