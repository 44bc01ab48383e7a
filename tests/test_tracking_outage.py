"""A tracking server that goes down mid-training and comes back: training's records wait
in the journal and ship once it answers, each value exactly once.

A real `mlflow server` on 127.0.0.1 with a SQLite store, stopped and started again on
the same port and store; rank 0's tracker (journal and helper process) writes through
the outage."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from training.engine.launch import free_port
from training.mlops.tracking import MlflowTracker, client

pytestmark = pytest.mark.timeout(240)


class Server:
    def __init__(self, base: Path) -> None:
        self.port, self.base = free_port(), base
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        store = f"sqlite:///{self.base / 'mlflow.db'}"
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--backend-store-uri", store, "--workers", "1"]
        command += ["--default-artifact-root", (self.base / "artifacts").as_uri()]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=(self.base / "server.log").open("a"),
        )
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return
            except OSError:
                assert self.proc.poll() is None, (self.base / "server.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture
def server(tmp_path):
    served = Server(tmp_path)
    served.start()
    yield served
    served.stop()


def test_records_written_while_the_server_is_down_ship_once_it_is_back(server, tmp_path):
    mlflow_client = client(server.uri)
    experiment = mlflow_client.create_experiment("outage")
    run_id = mlflow_client.create_run(experiment).info.run_id
    tracker = MlflowTracker(server.uri, run_id, tmp_path / "job" / "tracking.jsonl")
    for step in range(1, 11):
        tracker.log_metrics({"train_loss": 1.0 / step}, step)
    time.sleep(3)  # the helper ships these
    server.stop()
    started = time.perf_counter()
    for step in range(11, 31):  # training goes on while the server is down
        tracker.log_metrics({"train_loss": 1.0 / step}, step)
        tracker.set_tag("gradline.last_step", str(step))
    assert time.perf_counter() - started < 1.0  # the loop never waits for the server
    time.sleep(4)  # the helper meets the outage and waits it out
    server.start()
    tracker.close(timeout_s=120)
    history = client(server.uri).get_metric_history(run_id, "train_loss")
    steps = sorted(m.step for m in history)
    assert steps == list(range(1, 31))  # every value, once: no gap, no duplicate
    assert client(server.uri).get_run(run_id).data.tags["gradline.last_step"] == "30"
