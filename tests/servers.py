"""Real servers on 127.0.0.1 for the tests: a Prefect server a test can stop and start
again, and one Prefect server shared by the whole test run.

A `gradline run` with no Prefect server configured starts a temporary one (seconds of
start-up, more on a fresh database). The end-to-end tests whose subject is not that
temporary server point their runs at the shared one instead (conftest's `_env`), as a
team's machines share theirs; the embedded default keeps its own tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from flows.environment import OFFLINE_DEFAULTS
from flows.prefect_database import ServerDatabase
from flows.stage_host import STAGE_HOST_ENV, stage_host
from flows.temporary_server import prefect_api_answers
from training.atomic import pid_alive

BIN = Path(sys.executable).parent
# The test run's own folder, shared by its test processes (conftest makes it).
RUN_DIR_ENV = "GRADLINE_TESTS_RUN_DIR"


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
        # As a `gradline run`'s temporary server: a new home's database from the template
        # (flows/prefect_database.py), else made and kept as one; the block types
        # registered only where they may be missing.
        database = ServerDatabase.prepare(self.home / "prefect.db")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(OFFLINE_DEFAULTS, **database.settings, PREFECT_HOME=str(self.home))
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
        database.server_answers()

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


def made_once_for_the_run(name: str, make) -> Path:
    """The file `name` in the test run's folder, made by `make(path)` in the first test
    process that asks (the others wait for it under a lock, then read what it wrote): a
    reference result several processes' tests compare with is computed once a run."""
    folder = Path(os.environ[RUN_DIR_ENV])
    made = folder / name
    with (folder / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            staged = folder / f".{name}.{os.getpid()}.part"
            make(staged)
            os.replace(staged, made)  # whole or not at all: a failed make leaves none
    return made


class SharedPrefect:
    """The Prefect server of the whole test run, shared by all its test processes.

    The first process that needs it starts it, under a lock in the run's own folder
    (`RUN_DIR_ENV`, made by the run's first process, conftest), and writes down where it
    is; the others find it there. Only the process that made the folder stops it, when
    the run ends: a test process that started it may finish while others still use it.
    One server rather than one per test process: an idle server costs about a CPU-second
    a minute, and starting one several more.
    """

    api_url: str | None = None

    @classmethod
    def api(cls) -> str:
        if cls.api_url is None:
            folder = Path(os.environ[RUN_DIR_ENV])
            with (folder / "prefect.lock").open("w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait while one starts it
                record = folder / "prefect.json"
                known = json.loads(record.read_text()) if record.exists() else None
                if known is None or _ended(known["pid"]):  # none yet, or it died
                    known = _start_shared_server(folder)
                    record.write_text(json.dumps(known))
                cls.api_url = known["api"]
        return cls.api_url

    @classmethod
    def stop(cls, folder: Path) -> None:
        """Stop the run's server, if any process started one (the run's end)."""
        record = folder / "prefect.json"
        if record.exists():
            _stop_foreign_group(json.loads(record.read_text())["pid"])
        cls.api_url = None


def _start_shared_server(folder: Path) -> dict:
    """A started server with the flows' device limit: its address and process. A start
    that fails or is interrupted (a test's timeout) leaves no server behind, and the next
    test to ask tries again in a home of its own."""
    server = PrefectServer(Path(tempfile.mkdtemp(prefix="prefect-home-", dir=folder)))
    try:
        server.start()
        _device_quota_per_test_process(server)
    except BaseException:
        server.stop()
        raise
    return {"api": server.api, "pid": server.proc.pid}


def _device_quota_per_test_process(server: PrefectServer) -> None:
    """The flows' device limit with a machine's quota for each test process, as when each
    process had a server of its own: no test process queues for another's slots. (Tests
    of the quota itself name limits of their own.)"""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    from tasks.quota import devices_here
    from training.config.sections import OrchestrateConfig

    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    limit = GlobalConcurrencyLimitCreate(
        name=OrchestrateConfig().device_limit, limit=devices_here() * processes
    )
    with server.client() as client:
        client.create_global_concurrency_limit(limit)


def _stop_foreign_group(pid: int, seconds: float = 30.0) -> None:
    """Stop the process group led by `pid`, which another process started (so it cannot
    be waited for): politely, then surely; unless that pid is no longer a Prefect server
    (it ended, and the pid went to another process)."""
    if Path("/proc/self").exists():  # else no way to tell: trust the record
        try:
            if b"prefect" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                return
        except OSError:  # gone
            return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + seconds
        while not _ended(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _ended(pid):
            return


def _ended(pid: int) -> bool:
    """Whether process `pid` has exited: gone, or a zombie its parent has yet to reap
    (this process, reaped here, when it started the server itself)."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return not pid_alive(pid)  # no /proc here: a zombie reads as alive
    return state == "Z"


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
