"""The temporary Prefect server of a `gradline run` that has no server to talk to,
started first thing.

Left to Prefect, the temporary server starts at the flow's first API call: after the
command has imported Prefect (~3 s here) and the server package itself (another ~3 s,
only to start a subprocess), and then the command waits ~4 s (~10 s on a new
PREFECT_HOME, whose database is created) for it to answer. Started here, before those
imports, it comes up while they run, and the command never imports the server package.

It is the same server Prefect would start (its uvicorn command and settings: an
ephemeral API without the UI, on a free port of 127.0.0.1, on PREFECT_HOME's database),
stopped when the command exits; uvicorn's command runs with Python's collector tuned
(flows/tuned_uvicorn.py). PREFECT_API_URL points the command (and what it starts)
at it, and `tasks.prefect_api.TEMPORARY_SERVER_ENV` says it is a temporary one, for what
differs (leases, links to the UI).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from flows.environment import OFFLINE_DEFAULTS
from flows.prefect_database import ServerDatabase, default_database
from tasks.prefect_api import TEMPORARY_SERVER_ENV
from training.errors import OrchestratorUnreachable

_PORT_TAKEN = 3  # uvicorn's exit code when the port went to someone else meanwhile


class TemporaryServer:
    """A Prefect API server for this command only."""

    def __init__(self) -> None:
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.ready = False
        # PREFECT_HOME's database: seeded from the template, or kept as the template once
        # the server made it; its block types registered only where they may be missing
        # (flows/prefect_database.py).
        self.database = ServerDatabase(None, {}, creates=False, registers=False)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> None:
        self.database = ServerDatabase.prepare(default_database())
        self.port = _free_port()
        self.proc = subprocess.Popen(self._command(), env=self._environment())

    def _command(self) -> list[str]:
        spec = importlib.util.find_spec("prefect")  # found, not imported
        assert spec is not None and spec.origin is not None
        return [
            sys.executable,
            "-m",
            "flows.tuned_uvicorn",  # uvicorn's command, with the collector tuned first
            "--app-dir",
            str(Path(spec.origin).parent.parent),
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ]

    def _environment(self) -> dict[str, str]:
        # What Prefect sets for its own temporary server (no UI, an ephemeral API), and
        # whether it registers the block types (flows/prefect_database.py).
        return {
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            **self.database.settings,
        }

    def wait_until_ready(self) -> None:
        """Block until the server answers (it started while this process went on)."""
        setting = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
        timeout = float(os.environ.get(setting, OFFLINE_DEFAULTS[setting]))
        deadline = time.monotonic() + timeout
        while not self.ready:
            assert self.proc is not None
            if self.proc.poll() == _PORT_TAKEN:
                self.start()
                self.point_here()
            elif self.proc.poll() is not None:
                raise OrchestratorUnreachable(
                    f"the temporary Prefect server exited ({self.proc.returncode}) before "
                    "answering: see its output above; or start a server (`prefect server "
                    "start`) and set PREFECT_API_URL"
                )
            elif time.monotonic() > deadline:
                self.stop()
                raise OrchestratorUnreachable(
                    f"the temporary Prefect server did not answer within {timeout:g} s "
                    "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)"
                )
            self.ready = prefect_api_answers(self.api_url)
            if not self.ready:
                time.sleep(0.1)
        self.database.server_answers()

    def point_here(self) -> None:
        os.environ["PREFECT_API_URL"] = self.api_url
        os.environ[TEMPORARY_SERVER_ENV] = "1"

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()  # uvicorn shuts the app down: its last writes are kept
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def prefect_api_answers(api_url: str) -> bool:
    """Whether the Prefect API at `api_url` says it is healthy."""
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def temporary_prefect_server(needed: bool) -> Iterator[TemporaryServer | None]:
    """When `needed` (no Prefect API is configured), a temporary server starting now;
    the caller waits for it (`wait_until_ready`) before its first Prefect call. Prefect
    must not have been imported yet: it reads PREFECT_API_URL when imported."""
    if not needed:
        yield None
        return
    server = TemporaryServer()
    server.start()
    server.point_here()
    # Stopped at exit, as Prefect stops its own: after Prefect has sent the last logs and
    # events of the run (it drains its workers when the interpreter shuts down, and
    # would retry for minutes against a server already gone).
    atexit.register(server.stop)
    yield server
