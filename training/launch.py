"""Start N workers under torch.distributed.elastic and wait for them.

The elastic agent owns starting, watching and restarting worker processes: a worker
that dies makes it restart all of them (up to train.max_restarts), and they resume from
the latest checkpoint.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from training.loop import TrainJob, worker_main


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_workers(job: TrainJob, world_size: int, max_restarts: int) -> dict[str, Any]:
    """Run `worker_main(job)` on `world_size` local ranks; return rank 0's result."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    threads = str(job.config["train"]["threads_per_worker"])
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"gradline-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
    )
    results = elastic_launch(config, worker_main)(job)
    return results[0]
