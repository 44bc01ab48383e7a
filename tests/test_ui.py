"""`gradline ui`: both servers answer on 127.0.0.1 and Ctrl-C stops both."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import copy_project

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_ui_serves_both_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    root = copy_project(tmp_path / "gradline")
    mlflow_port, prefect_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "gradline"),
            "ui",
            "--mlflow-port",
            str(mlflow_port),
            "--prefect-port",
            str(prefect_port),
        ],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        urls = [
            f"http://127.0.0.1:{mlflow_port}/health",
            f"http://127.0.0.1:{prefect_port}/api/health",
        ]
        deadline = time.monotonic() + 150
        while not all(_answers(u) for u in urls):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the UIs did not come up"
            time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    assert f"MLflow UI:  http://127.0.0.1:{mlflow_port}" in output
    assert f"Prefect UI: http://127.0.0.1:{prefect_port}" in output
    deadline = time.monotonic() + 15
    while _listening(mlflow_port) or _listening(prefect_port):
        assert time.monotonic() < deadline, "a UI server still listens after Ctrl-C"
        time.sleep(0.5)
