"""Real servers on 127.0.0.1 for the tests: a Prefect server a test can stop and start
again, and one Prefect server shared by the whole test run.

A `gradline run` with no Prefect server configured starts a temporary one (seconds of
start-up, more on a fresh database). The end-to-end tests whose subject is not that
temporary server point their runs at the shared one instead (conftest's `_env`), as a
team's machines share theirs; the embedded default keeps its own tests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from flows.environment import OFFLINE_DEFAULTS
from flows.prefect_database import save_template, seeded_or_to_create
from flows.stage_host import STAGE_HOST_ENV, stage_host
from flows.temporary_server import prefect_api_answers

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop a process group politely, then surely."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        proc.wait()
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for(what: str, check, seconds: float, context=lambda: ""):
    """Poll `check` until it returns something true; that value and the seconds taken."""
    start = time.monotonic()
    while not (value := check()):
        if time.monotonic() - start > seconds:
            pytest.fail(f"{what}: not within {seconds:g} s\n{context()[-6000:]}")
        time.sleep(1)
    return value, time.monotonic() - start


class PrefectServer:
    """`prefect server start` on 127.0.0.1 with gradline's settings (leases on disk), which
    a test can stop and start again on the same port and database."""

    def __init__(self, home: Path) -> None:
        self.home, self.port = home, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # A new home's database from the template, as a `gradline run` starts its
        # temporary server (flows/prefect_database.py); else made, and kept as one.
        database = self.home / "prefect.db"
        creates = seeded_or_to_create(database)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(OFFLINE_DEFAULTS, PREFECT_HOME=str(self.home))
        cmd = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1"]
        with (self.home / "server.log").open("a") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--port", str(self.port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 300  # ~12 CPU-s: minutes on a loaded 2-core host
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"prefect server did not start:\n{self.log()}")
            time.sleep(0.2)
        if creates:
            save_template(database)

    def _healthy(self) -> bool:
        return prefect_api_answers(self.api)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, signal.SIGTERM)
            self.proc = None

    def log(self) -> str:
        return (self.home / "server.log").read_text()

    def client(self):
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(api=self.api)


def running_prefect_server(tmp_path: Path):
    """A started PrefectServer of the test's own, stopped after it whatever happens."""
    (home := tmp_path / "prefect-server").mkdir()
    server = PrefectServer(home)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class SharedPrefect:
    """The Prefect server of the whole test run: started on first use, stopped when the
    run ends (conftest)."""

    server: PrefectServer | None = None

    @classmethod
    def api(cls) -> str:
        if cls.server is None:
            home = Path(tempfile.mkdtemp(prefix="gradline-tests-prefect-"))
            server = PrefectServer(home)
            server.start()
            cls.server = server
        return cls.server.api

    @classmethod
    def stop(cls) -> None:
        if cls.server is not None:
            cls.server.stop()
            shutil.rmtree(cls.server.home, ignore_errors=True)
            cls.server = None


class SharedStageHost:
    """The stage host (flows/stage_host.py) of a test process: the stages of every flow a
    test runs against the shared Prefect server fork from it, as a flow's stages fork
    from the flow's own host; started on first use, stopped when the run ends."""

    stack: contextlib.ExitStack | None = None
    path = ""

    @classmethod
    def socket(cls) -> str:
        if cls.stack is None:
            stack = contextlib.ExitStack()
            stack.enter_context(stage_host())
            # Named only in the environments of the commands the tests start.
            cls.path = os.environ.pop(STAGE_HOST_ENV)
            cls.stack = stack
        return cls.path

    @classmethod
    def stop(cls) -> None:
        if cls.stack is not None:
            cls.stack.close()
            cls.stack = None
