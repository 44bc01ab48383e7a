"""Stage processes forked from a host that imported torch and MLflow once.

A stage is a `gradline stage NAME` command that DVC runs. Started cold, the train and
evaluate stages spend about 4 s of a small machine's CPU importing torch, MLflow,
pyarrow and pandas before their first line of work, every run. Under a flow (or a test
session), a stage host does those imports once, in its own process, and forks a ready
process per stage:

- `stage_host()` starts the host for the commands this process starts and names its
  socket in `GRADLINE_STAGE_HOST`; where that is set already (an outer flow, a test
  session), it uses that host;
- `gradline stage ...` under DVC, seeing `GRADLINE_STAGE_HOST`, asks the host to run it
  (`run_in_host`): it passes its argv, environment, working folder and standard
  streams; the host forks, the fork takes them over and runs the stage as the command
  would have; the command forwards the signals it gets to the fork and exits with the
  fork's exit code. DVC, `dvc.lock` and the flow see the same command as before.
- No host (plain `dvc repro`, a host that is gone): the command runs the stage itself.

The fork dies with the command that asked for it (the host kills it when the command's
connection closes) and with the host; the host ends with the process that started it.
The socket lives in a folder only this user can open, and the host runs nothing but
`gradline stage` commands.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import json
import logging
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

STAGE_HOST_ENV = "GRADLINE_STAGE_HOST"
# What the stages import that costs time; the rest they import themselves, cheaply.
PRELOAD = (
    "torch",
    "pyarrow",
    "pandas",
    "mlflow",
    "mlflow.pyfunc",
    "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.model_registry.sqlalchemy_store",
    "git",  # MLflow reads the source's commit with it
    "sklearn.linear_model",  # the baselines
    "sklearn.pipeline",
    "sklearn.preprocessing",
    "sklearn.datasets",  # the examples' data
    "scipy.sparse",
    "training.stages",
    "training.data.ingest",
    "training.data.shards",
    "training.mlops.drift",
    "training.mlops.jobs",
    "training.mlops.runs",
    "training.mlops.sync",
    "training.engine.worker_start",
    "training.evaluation",
    "training.models.folder",
    "training.plots",
)
_HEADER = struct.Struct("!I")  # the request's length, before the request itself
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


# --- the command's side ---------------------------------------------------------------


def run_in_host(argv: list[str]) -> int | None:
    """Run `gradline argv` (a stage) in the host `GRADLINE_STAGE_HOST` names; its exit
    code, or None when no host answers (the caller runs the stage itself)."""
    path = os.environ.get(STAGE_HOST_ENV)
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        _send_request(conn, argv)
        reply = conn.makefile("r")
        pid = _read_pid(reply)
    except (OSError, ValueError):
        conn.close()
        return None  # gone, or refused before forking: nothing ran, run it here
    with conn, reply:
        _forward_signals_to(pid)
        line = reply.readline()  # the fork's end: `exit N` or `signal N`
    kind, _, value = line.partition(" ")
    if kind == "signal":  # end as the stage ended, so that DVC sees what a shell would
        signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
        return 128 + int(value)
    if kind != "exit":
        print("gradline: the stage host ended before the stage did", file=sys.stderr)
        return 1
    return int(value)


def _send_request(conn: socket.socket, argv: list[str]) -> None:
    request = {
        "argv": argv,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "path": sys.path,
        "umask": _current_umask(),
    }
    payload = json.dumps(request).encode()
    socket.send_fds(conn, [_HEADER.pack(len(payload))], _standard_streams())
    conn.sendall(payload)


def _standard_streams() -> list[int]:
    """This command's stdin, stdout and stderr, /dev/null for one it was started without."""
    fds = []
    modes = (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY)
    for stream, mode in zip((sys.stdin, sys.stdout, sys.stderr), modes, strict=True):
        try:
            fds.append(stream.fileno())
        except (AttributeError, OSError, ValueError):  # None, closed, or not a file
            fds.append(os.open(os.devnull, mode))
    return fds


def _read_pid(reply) -> int:
    kind, _, value = reply.readline().partition(" ")
    if kind != "pid":
        raise ValueError(f"the stage host refused the stage: {value.strip()}")
    return int(value)


def _forward_signals_to(pid: int) -> None:
    def forward(signum: int, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in _FORWARDED:
        signal.signal(signum, forward)


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# --- starting and stopping the host -----------------------------------------------------


@contextlib.contextmanager
def stage_host() -> Iterator[subprocess.Popen | None]:
    """A stage host for the stages this process starts (through `GRADLINE_STAGE_HOST`
    in its environment), unless one is there already or the platform cannot pass
    file descriptors (then None)."""
    if os.environ.get(STAGE_HOST_ENV) or not hasattr(socket, "send_fds"):
        yield None
        return
    folder = tempfile.mkdtemp(prefix="gradline-host-")
    path = str(Path(folder) / "stages.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # bound before anyone is told, so a stage never misses it
    listener.listen(16)
    host = subprocess.Popen(
        [sys.executable, "-m", "flows.stage_host", str(listener.fileno()), str(os.getpid())],
        pass_fds=[listener.fileno()],
        stdin=subprocess.DEVNULL,
    )
    listener.close()
    os.environ[STAGE_HOST_ENV] = path
    try:
        yield host
    finally:
        os.environ.pop(STAGE_HOST_ENV, None)
        stop_host(host)
        with contextlib.suppress(OSError):
            os.unlink(path)
            os.rmdir(folder)


def stop_host(host: subprocess.Popen) -> None:
    host.terminate()
    try:
        host.wait(timeout=10)
    except subprocess.TimeoutExpired:
        host.kill()
        host.wait()


# --- the host --------------------------------------------------------------------------


class _Host:
    """Accepts stage requests on `listener`, forks one process per request, and tells
    each command its fork's pid and, at the end, how the fork ended."""

    def __init__(self, listener: socket.socket, owner: int) -> None:
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.forks: dict[int, socket.socket] = {}  # pid -> the command's connection
        self.stopping = False
        wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(wake_read, selectors.EVENT_READ, "wake")
        self.polled_owner = self._watch_owner(owner)

    def _watch_owner(self, owner: int) -> int | None:
        """Wake up when `owner` exits (a pidfd); where there are none, return the pid for
        the loop to poll."""
        try:
            self.selector.register(os.pidfd_open(owner), selectors.EVENT_READ, "owner")
        except (AttributeError, OSError):
            return owner
        return None

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides when we stop
        while not self.stopping:
            for key, _ in self.selector.select(timeout=1.0):
                self._on_event(key)
            self._reap()
            if self.polled_owner is not None and os.getppid() != self.polled_owner:
                self.stopping = True
        for pid in self.forks:  # stopped with stages running: they go too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _on_event(self, key: selectors.SelectorKey) -> None:
        if key.data == "accept":
            conn, _ = self.listener.accept()
            self._start(conn)
        elif key.data == "wake":
            with contextlib.suppress(BlockingIOError):
                os.read(key.fd, 512)
        elif key.data == "owner":
            self.stopping = True
        else:  # a command's connection: it closed (the command died), so its fork goes
            with contextlib.suppress(ProcessLookupError):
                os.kill(key.data, signal.SIGKILL)
            self.selector.unregister(key.fileobj)  # reaped later, like any end

    def _start(self, conn: socket.socket) -> None:
        try:
            request, streams = _receive_request(conn)
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                conn.sendall(f"refused {exc}\n".encode())
            conn.close()
            return
        pid = os.fork()
        if pid == 0:  # the fork: never returns
            self._let_go()
            conn.close()
            _run_stage(request, streams)
        for fd in streams:
            os.close(fd)
        with contextlib.suppress(OSError):  # the command died already: its end kills the fork
            conn.sendall(f"pid {pid}\n".encode())
        self.forks[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _let_go(self) -> None:
        """In a fork: close what the host holds (the listener, the other stages'
        connections, its wake-up pipe), so that nothing of the host's lives on in it."""
        signal.set_wakeup_fd(-1)
        for key in list(self.selector.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()  # marked closed too: never closed again by number
            else:
                os.close(key.fd)
        self.selector.close()
        os.close(self.wake_write)

    def _reap(self) -> None:
        while self.forks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.forks.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(KeyError):  # gone already if the command died
                self.selector.unregister(conn)
            if os.WIFSIGNALED(status):
                end = f"signal {os.WTERMSIG(status)}"
            else:
                end = f"exit {os.waitstatus_to_exitcode(status)}"
            with contextlib.suppress(OSError):
                conn.sendall(f"{end}\n".encode())
            conn.close()


def _receive_request(conn: socket.socket) -> tuple[dict, list[int]]:
    header, streams, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    if len(header) != _HEADER.size or len(streams) != 3:
        for fd in streams:
            os.close(fd)
        raise ValueError("a request without its length and three standard streams")
    (length,) = _HEADER.unpack(header)
    payload = bytearray()
    while len(payload) < length:
        chunk = conn.recv(min(1 << 20, length - len(payload)))
        if not chunk:
            raise ValueError("the request ended early")
        payload += chunk
    request = json.loads(payload)
    if request.get("argv", [None])[0] != "stage":  # nothing but stages runs here
        raise ValueError(f"not a stage command: {request.get('argv')}")
    return request, streams


def _run_stage(request: dict, streams: list[int]) -> None:
    """In the fork: become the command that asked (its streams, folder, environment,
    signals), run the stage, and end as the interpreter would have."""
    code = 1
    try:
        _become(request, streams)
        code = _command_main()(request["argv"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # as an uncaught exception ends a process: traceback, exit 1
        traceback.print_exc()
    finally:
        _finish(code)


def _become(request: dict, streams: list[int]) -> None:
    _die_with_the_host()
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    environ = dict(request["env"])
    environ.pop(STAGE_HOST_ENV, None)  # the stage runs here, not in another host
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    sys.path[:] = request["path"]
    sys.argv = ["gradline", *request["argv"]]
    unbuffered = bool(environ.get("PYTHONUNBUFFERED"))
    sys.stdout.reconfigure(line_buffering=unbuffered or os.isatty(1), write_through=unbuffered)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    _adopt_thread_count(environ)


def _die_with_the_host() -> None:
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _adopt_thread_count(environ: dict[str, str]) -> None:
    """The OpenMP runtime read OMP_NUM_THREADS when the host imported torch: a stage
    asked for another count gets it set here, as a fresh process would have."""
    wanted = environ.get("OMP_NUM_THREADS", "")
    if wanted != _HOST_THREADS_ENV and wanted.isdigit() and int(wanted) > 0:
        import torch

        torch.set_num_threads(int(wanted))
    elif not wanted and _HOST_THREADS_ENV:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)


def _finish(code: int) -> None:
    """End the fork as the interpreter ends a process: wait for its threads, run the
    exit handlers, flush the streams; then leave without the host's own teardown."""
    with contextlib.suppress(BaseException):
        threading._shutdown()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


_HOST_THREADS_ENV = os.environ.get("OMP_NUM_THREADS", "")


def _command_main() -> Callable[[list[str]], int]:
    """The `gradline` command's entry point, found as its console script finds it
    (loaded once, by `preload`)."""
    global _MAIN
    if _MAIN is None:
        entry = next(
            iter(importlib.metadata.entry_points(group="console_scripts", name="gradline"))
        )
        _MAIN = entry.load()
    return _MAIN


_MAIN: Callable[[list[str]], int] | None = None


def preload() -> None:
    """Import what the stages need, leaving logging as a fresh process has it (an
    import that configures the root logger would silence the stage's own lines)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    for module in PRELOAD:
        with contextlib.suppress(ImportError):  # a stage that needs it will say so
            __import__(module)
    root.handlers[:] = handlers
    root.setLevel(level)
    _command_main()
    _warm_mlflow_package_map()


def _warm_mlflow_package_map() -> None:
    """Logging or loading a model, MLflow checks the model's requirements against the
    installed packages, mapping every installed distribution to its modules first (~1 s,
    then cached): build that map once here, for every stage."""
    with contextlib.suppress(ImportError, AttributeError):
        from mlflow.utils.requirements_utils import _init_packages_to_modules_map

        _init_packages_to_modules_map()


def main() -> None:
    listener_fd, owner = int(sys.argv[1]), int(sys.argv[2])
    listener = socket.socket(fileno=listener_fd)
    preload()
    _Host(listener, owner).serve()
    os._exit(0)  # nothing to flush or close: skip tearing down torch and MLflow (~1 s)


if __name__ == "__main__":
    main()
