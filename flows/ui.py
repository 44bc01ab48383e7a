"""`gradline ui`: the MLflow UI and a Prefect server on 127.0.0.1, until Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from training.tracking import default_artifact_location, default_tracking_uri


def serve_uis(root: Path, mlflow_port: int, prefect_port: int) -> int:
    bin_dir = Path(sys.executable).parent
    tracking_uri = default_tracking_uri(root)
    (root / "mlflow").mkdir(exist_ok=True)
    mlflow_cmd = [
        str(bin_dir / "mlflow"),
        "server",
        "--backend-store-uri",
        tracking_uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(mlflow_port),
    ]
    if artifacts := default_artifact_location(root, tracking_uri):
        mlflow_cmd += ["--default-artifact-root", artifacts]
    prefect_cmd = [
        str(bin_dir / "prefect"),
        "server",
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(prefect_port),
    ]
    procs = [
        subprocess.Popen(mlflow_cmd, start_new_session=True),
        subprocess.Popen(prefect_cmd, start_new_session=True),
    ]
    print(f"MLflow UI:  http://127.0.0.1:{mlflow_port}")
    print(f"Prefect UI: http://127.0.0.1:{prefect_port}")
    print(
        "Runs show up in this Prefect UI when started with "
        f"PREFECT_API_URL=http://127.0.0.1:{prefect_port}/api (gradline run, gradline serve)."
    )
    print("Ctrl-C stops both.", flush=True)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            _wait_for_group(proc.pid)
    failed = [p.args[0] for p in procs if p.returncode not in (0, -signal.SIGTERM, None)]
    return 1 if failed else 0


def _wait_for_group(pgid: int, timeout: float = 10.0) -> None:
    """Return once every process of the group is gone (server workers outlive their
    parent by a moment, holding the port); kill what is left after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
