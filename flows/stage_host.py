"""Stage processes and DVC commands forked from a host that imported torch, MLflow and
DVC once.

A stage is a `gradline stage NAME` command that DVC runs. Started cold, the train and
evaluate stages spend about 4 s of a small machine's CPU importing torch, MLflow,
pyarrow and pandas before their first line of work, every run, and each `dvc` command
the flow runs half a second importing DVC. Under a flow (or a test session), a stage
host does those imports once, in its own process, and forks a ready process per
command:

- `stage_host()` starts the host for the commands this process starts and names its
  socket in `GRADLINE_STAGE_HOST`; where that is set already (an outer flow, a test
  session), it uses that host;
- `gradline stage ...` under DVC, seeing `GRADLINE_STAGE_HOST`, asks the host to run it
  (`training.host_client.run_in_host`): it passes its argv, environment, working folder
  and standard streams; the host forks, the fork takes them over and runs the stage as
  the command would have; the command forwards the signals it gets to the fork and
  exits with the fork's exit code. DVC, `dvc.lock` and the flow see the same command.
- the flow's `dvc ...` commands (`training.mlops.dvc_cli.dvc_process`) are forks of the
  host too, used as a `subprocess.Popen` is. The host loads DVC first and serves them
  at once; it loads the rest between requests, in phases: what every stage imports,
  then what training and evaluation import besides, then what later commands import.
  A stage command is held until the phases it needs are loaded (ingest and shard need
  only the first: the rest loads while they run).
- No host (plain `dvc repro`, a host that is gone): each command runs itself.

A fork dies with the command that asked for it (the host kills it when the command's
connection closes) and with the host; the host ends with the process that started it.
The socket lives in a folder only this user can open, and the host runs nothing but
`gradline stage` and `dvc` commands.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import gc
import importlib.metadata
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from flows.process_end import end_process
from training.gc_tuning import tune_collector
from training.host_client import HEADER, STAGE_HOST_ENV
from training.tempdirs import owned_tempdir

# What DVC's commands import (most of it lazily, as a command needs it): loaded first,
# so that the flow's `dvc` commands fork from the host within a fraction of a second.
DVC_PRELOAD = (
    "dvc.cli.parser",
    "dvc.repo",
    "dvc.repo.reproduce",
    "dvc.repo.status",
    "dvc.repo.push",
    "dvc.repo.pull",
    "dvc.repo.fetch",
    "dvc.stage",
    "dvc.stage.cache",
    "dvc.output",
    "dvc.dependency",
    "dvc.dvcfile",
    "dvc.lock",
    "dvc.config",
    "dvc_data.index",
    "dvc_data.index.checkout",
    "dvc_data.hashfile.transfer",
    "dvc_data.hashfile.build",
    "dvc_objects.fs.local",
    "scmrepo.git",
    "dulwich.repo",
    "ruamel.yaml",
)
# What the stages import that costs time; the rest they import themselves, cheaply.
# First what every stage imports (ingest and shard need no more: DATA_STAGES), then
# what training and evaluation import besides (torch, the engine). A stage waits for
# what it needs only: the rest loads on another core while ingest and shard run.
PRELOAD = (
    "pyarrow",
    "pandas",
    "mlflow",
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
    "training.mlops.runs",
    "training.mlops.sync",
    "flows.cli",  # what the stages run through (the entry point, flows/command.py, is light)
)
DATA_STAGES = ("ingest", "shard")
MODEL_PRELOAD = (
    "torch",
    "mlflow.pyfunc",
    "training.mlops.jobs",
    "training.engine.worker_start",
    "training.engine.worker",  # the workers' forkserver is then a fork of the stage
    "torch._dynamo",  # the rest of that server's preload (training.engine.worker_start)
    "training.evaluation",
    "training.models.folder",
    "training.plots",
    "training.mlops.registration",  # the flow's register step
)
# What later commands import beyond the above, loaded last, between requests and while
# the first stages run; no command waits for these (one that starts before they are
# loaded imports what it needs itself, as it would without a host). Small ones only: a
# request waits for the import under way.
LATER_PRELOAD = (
    # What train imports besides: the agent's rendezvous, MLflow's SQLite dialect and its
    # model logging's tracing, and the checkpoint reader consolidation uses.
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.checkpoint._fsspec_filesystem",
    "multiprocessing.popen_forkserver",
    "sqlalchemy.dialects.sqlite",
    "mlflow.tracing.processor.otel",
    "mlflow.tracing.processor.base_mlflow",
    "pyarrow.pandas_compat",
    # The rest of what DVC's repro, status and push import (~0.03 s each command).
    "dvc.repo.index",
    "dvc.repo.open_repo",
    "dvc.repo.stage",
    "dvc.repo.plots",
    "dvc.repo.metrics",
    "dvc.repo.params",
    "dvc.repo.artifacts",
    "dvc.repo.datasets",
    "dvc.repo.worktree",
    "dvc.repo.brancher",
    "dvc.data_cloud",
    "dvc.cachemgr",
    "dvc.rwlock",
    "dvc.utils.strictyaml",
    "dvc_data.index.push",
    "dvc_data.index.fetch",
    "dvc_data.hashfile.status",
    "dvc_data.hashfile.db.index",
    "dvc_render.vega",
    "dvc_render.html",
    "dulwich.index",
    "configobj",
    "platformdirs",
)
COMMANDS = ("stage", "dvc")  # `gradline stage ...` and `dvc ...`: all the host runs


# --- starting and stopping the host -----------------------------------------------------


@contextlib.contextmanager
def stage_host() -> Iterator[subprocess.Popen | None]:
    """A stage host for the stages this process starts (through `GRADLINE_STAGE_HOST`
    in its environment), unless one is there already or the platform cannot pass
    file descriptors (then None)."""
    if os.environ.get(STAGE_HOST_ENV) or not hasattr(socket, "send_fds"):
        yield None
        return
    folder = owned_tempdir("gradline-host-")
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


@dataclass
class Preload:
    """Steps the host takes between requests, and which stages wait until they are done
    (a stage forked earlier would import it all again itself)."""

    steps: collections.deque[Callable[[], None]]
    holds: Callable[[str], bool]  # the stage's name -> whether it waits


class _Host:
    """Accepts requests on `listener`, forks one process per request, and tells each
    command its fork's pid and, at the end, how the fork ended. It serves DVC commands
    at once; between requests it goes on with the preloads, one step at a time, in
    order, and holds each stage command until those it waits for are done."""

    def __init__(self, listener: socket.socket, owner: int, preloads: list[Preload]) -> None:
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.forks: dict[int, socket.socket] = {}  # pid -> the command's connection
        self.preloads = preloads
        self.held: list[tuple[socket.socket, dict, list[int]]] = []  # stages waiting
        self.releasing: list[tuple[socket.socket, dict, list[int]]] = []  # about to start
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
            busy = any(preload.steps for preload in self.preloads)
            for key, _ in self.selector.select(timeout=0 if busy else 1.0):  # a look only
                self._on_event(key)
            self._reap()
            if busy:
                self._preload_next()
            if self.polled_owner is not None and os.getppid() != self.polled_owner:
                self.stopping = True
        for pid in self.forks:  # stopped with stages running: they go too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _preload_next(self) -> None:
        step = next(preload for preload in self.preloads if preload.steps).steps.popleft()
        try:
            step()
            _skip_torch_teardown_at_exit()
        except Exception as exc:  # a step only saves time: the stages go on without it
            # Stages forked from the host may be running: the host must not end under
            # them. A command that needs what failed meets the failure itself.
            print(f"gradline stage host: a preload step failed ({exc!r})", file=sys.stderr)
        # Those released now leave `held` for `releasing`, where a fork made meanwhile
        # still sees them and closes its copies (`_let_go`).
        self.releasing = [entry for entry in self.held if not self._waits(entry[1]["argv"])]
        self.held = [entry for entry in self.held if self._waits(entry[1]["argv"])]
        while self.releasing:
            self._fork(*self.releasing.pop(0))

    def _waits(self, argv: list[str]) -> bool:
        if argv[0] != "stage":
            return False
        stage = argv[1] if len(argv) > 1 else ""
        return any(preload.steps and preload.holds(stage) for preload in self.preloads)

    def _start_or_hold(self, conn: socket.socket, request: dict, streams: list[int]) -> None:
        if self._waits(request["argv"]):
            self.held.append((conn, request, streams))
        else:
            self._fork(conn, request, streams)

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
        self._start_or_hold(conn, request, streams)

    def _fork(self, conn: socket.socket, request: dict, streams: list[int]) -> None:
        # The fork's garbage collector would walk every object of the host (torch's,
        # MLflow's, DVC's), writing to each page and so copying it: ~1 s of every command.
        # Frozen, they are left alone.
        gc.freeze()
        pid = os.fork()
        if pid == 0:  # the fork: never returns
            self._let_go()
            conn.close()
            _run_command(request, streams)
        for fd in streams:
            os.close(fd)
        with contextlib.suppress(OSError):  # the command died already: its end kills the fork
            conn.sendall(f"pid {pid}\n".encode())
        self.forks[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _let_go(self) -> None:
        """In a fork: close what the host holds (the listener, the other commands'
        connections, its wake-up pipe), so that nothing of the host's lives on in it."""
        signal.set_wakeup_fd(-1)
        for conn, _, streams in self.others_waiting():
            conn.close()
            for fd in streams:
                os.close(fd)
        for key in list(self.selector.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()  # marked closed too: never closed again by number
            else:
                os.close(key.fd)
        self.selector.close()
        os.close(self.wake_write)

    def others_waiting(self) -> list[tuple[socket.socket, dict, list[int]]]:
        """The requests not started yet (held, or released but not forked yet)."""
        return [*self.held, *self.releasing]

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
    header, streams, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    if len(header) != HEADER.size or len(streams) != 3:
        for fd in streams:
            os.close(fd)
        raise ValueError("a request without its length and three standard streams")
    (length,) = HEADER.unpack(header)
    payload = bytearray()
    while len(payload) < length:
        chunk = conn.recv(min(1 << 20, length - len(payload)))
        if not chunk:
            raise ValueError("the request ended early")
        payload += chunk
    request = json.loads(payload)
    if (request.get("argv") or [None])[0] not in COMMANDS:  # nothing else runs here
        raise ValueError(f"neither a stage nor a DVC command: {request.get('argv')}")
    return request, streams


def _run_command(request: dict, streams: list[int]) -> None:
    """In the fork: become the command that asked (its streams, folder, environment,
    signals), run it, and end as the interpreter would have."""
    code = 1
    try:
        _become(request, streams)
        code = _entry_point(request["argv"][0])(request["argv"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:  # as an uncaught exception ends a process: traceback, exit 1
        traceback.print_exc()
    finally:
        end_process(code)  # as the interpreter would, without the host's own teardown


def _become(request: dict, streams: list[int]) -> None:
    _die_with_the_host()
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    stage = request["argv"][0] == "stage"
    environ = dict(request["env"])
    if stage:  # the stage runs here, not in another host (DVC's stages do go there)
        environ.pop(STAGE_HOST_ENV, None)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    sys.path[:] = request["path"]
    sys.argv = ["gradline", *request["argv"]] if stage else list(request["argv"])
    unbuffered = bool(environ.get("PYTHONUNBUFFERED"))
    sys.stdout.reconfigure(line_buffering=unbuffered or os.isatty(1), write_through=unbuffered)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    if stage:
        _adopt_thread_count(environ)


def _die_with_the_host() -> None:
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _adopt_thread_count(environ: dict[str, str]) -> None:
    """The OpenMP runtime read OMP_NUM_THREADS when the host imported torch: a stage
    asked for another count gets it set here, as a fresh process would have. A stage
    forked before the host imported torch (ingest, shard) imports it, if at all, with
    its own environment already."""
    if "torch" not in sys.modules:
        return
    wanted = environ.get("OMP_NUM_THREADS", "")
    if wanted != _HOST_THREADS_ENV and wanted.isdigit() and int(wanted) > 0:
        import torch

        torch.set_num_threads(int(wanted))
    elif not wanted and _HOST_THREADS_ENV:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)


_HOST_THREADS_ENV = os.environ.get("OMP_NUM_THREADS", "")


def _entry_point(command: str) -> Callable[[list[str]], int]:
    """What runs `argv` in the fork: `gradline`'s entry point for a stage, DVC's for
    `dvc ...` (as `python -m dvc` runs it)."""
    if command == "dvc":
        from dvc.cli import main as dvc_main

        return lambda argv: dvc_main(argv[1:])
    return _command_main()


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


def preload_steps(modules: Iterable[str]) -> list[Callable[[], None]]:
    """One step per module to import, then the last steps every stage needs (`gradline`'s
    entry point, MLflow's newest schema revision)."""
    return [*import_steps(modules), _command_main, _remember_mlflow_schema_head]


def model_steps(modules: Iterable[str]) -> list[Callable[[], None]]:
    """MLflow's package map (logging a model), then one step per module to import. The
    map is the longest step (~0.8 s): first, rather than last, it is less likely to be
    under way when the flow's first `dvc` command asks, which then waits for it."""
    return [_warm_mlflow_package_map, *import_steps(modules)]


def import_steps(modules: Iterable[str]) -> list[Callable[[], None]]:
    return [lambda m=module: _import_keeping_logging(m) for module in modules]


def _import_keeping_logging(module: str) -> None:
    """Import `module`, leaving logging as a fresh process has it (an import that
    configures the root logger would silence the commands' own lines)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        __import__(module)
    except ImportError:  # not installed: a command that needs it will say so
        pass
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _warm_mlflow_package_map() -> None:
    """Logging or loading a model, MLflow checks the model's requirements against the
    installed packages, mapping every installed distribution to its modules first (~1 s,
    then cached): build that map once here, for every stage."""
    with contextlib.suppress(ImportError, AttributeError):
        from mlflow.utils.requirements_utils import _init_packages_to_modules_map

        _init_packages_to_modules_map()


def _remember_mlflow_schema_head() -> None:
    """Each SQL store MLflow opens (a stage's, rank 0's tracking helper's) first finds the
    newest schema revision by loading every one of its ~70 migration scripts (~15 ms,
    each time). The answer is fixed for the installed MLflow: find it once here, for the
    stages forked from the host and what they fork in turn."""
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.store.db import utils
    except ImportError:
        return
    # A broken install (two heads) is left for the store that needs it to report.
    with contextlib.suppress(AttributeError, MlflowException):
        if not hasattr(utils._get_latest_schema_revision, "cache_info"):
            utils._get_latest_schema_revision = functools.cache(utils._get_latest_schema_revision)
        utils._get_latest_schema_revision()


def _skip_torch_teardown_at_exit() -> None:
    """A fork ends by running the exit handlers it inherited from the host's imports
    (`end_process`). torch's free nothing the OS does not: a table of compile times logged
    at INFO (importing `tabulate` to draw it) and ~170 operator libraries unregistered
    one by one. ~0.06 s at the end of every fork, two a stage (DVC's and the stage's), so
    off for the forks, once torch is imported: the handlers a command registers itself
    still run. (`finalize._registry` is private: where it is missing, nothing changes.)"""
    compile_times = getattr(sys.modules.get("torch._dynamo.utils"), "dump_compile_times", None)
    if compile_times is not None:
        atexit.unregister(compile_times)
    unregister = getattr(sys.modules.get("torch.library"), "_del_library", None)
    if unregister is None:
        return
    for finalizer in list(getattr(weakref.finalize, "_registry", ())):
        held = finalizer.peek()
        if held is not None and held[1] is unregister:
            finalizer.atexit = False


def _remove_socket(listener: socket.socket) -> None:
    """The socket and its private folder, which the owner removes as it ends: when it
    was killed (SIGKILL), the host is the one left to do it."""
    path = listener.getsockname()
    with contextlib.suppress(OSError):
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


def main() -> None:
    tune_collector()  # before the preload: ~1.2 CPU-s less of it (training/gc_tuning.py)
    listener_fd, owner = int(sys.argv[1]), int(sys.argv[2])
    listener = socket.socket(fileno=listener_fd)
    for module in DVC_PRELOAD:  # ~0.3 s: the flow's first `dvc` command may be waiting
        _import_keeping_logging(module)
    preloads = [
        Preload(collections.deque(preload_steps(PRELOAD)), holds=lambda stage: True),
        Preload(
            collections.deque(model_steps(MODEL_PRELOAD)),
            holds=lambda stage: stage not in DATA_STAGES,
        ),
        Preload(collections.deque(import_steps(LATER_PRELOAD)), holds=lambda stage: False),
    ]
    _Host(listener, owner, preloads).serve()
    _remove_socket(listener)
    os._exit(0)  # nothing to flush or close: skip tearing down torch and MLflow (~1 s)


if __name__ == "__main__":
    main()
