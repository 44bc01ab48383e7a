"""How worker processes start: forked from a server that imported the engine once.

With torch elastic's default, `spawn`, every worker of every launch starts a fresh
interpreter and imports torch and the engine (about 2.5 s of CPU each on a small
machine). Here the workers come from multiprocessing's forkserver, which imports
`training.engine.worker` (and MLflow's store) once and forks a ready process per worker:
a launch, an elastic restart after a failure, or the next job of a sweep in the same
process starts its ranks in a fraction of a second.

A forked worker inherits the server's state, not the launcher's state of now, so the
launcher hands over what a spawned worker would have inherited (`LaunchContext`): its
environment at launch (a test's or a sweep's changes since the server started) and,
on Linux, its standard output and error (the server keeps those of the launcher's
first launch; pytest replaces them for every test). `adopt` applies them first thing in
the worker, keeping what torch elastic set for this worker itself.

`GRADLINE_WORKER_START=spawn` goes back to spawning (and platforms without a forkserver
always spawn).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from dataclasses import dataclass, field

START_ENV = "GRADLINE_WORKER_START"
# The engine, and MLflow's SQL store: rank 0 of a tracked job then forks its tracking
# helper from itself (training/mlops/tracking._helper_start_method) instead of spawning
# an interpreter that imports MLflow (~2.5 s of CPU each job, with rank 0 waiting). And
# TorchDynamo, which the engine does not import but every worker would, ~0.35 s of CPU
# each attempt: torch's optimizers import it as they are built (they keep the compiler
# off some of their methods).
PRELOAD = ["training.engine.worker", "mlflow.store.tracking.sqlalchemy_store", "torch._dynamo"]
# multiprocessing's server imports this module alone: it imports PRELOAD its own way.
SERVER_PRELOAD = "training.engine.forkserver_preload"

# This process's environment as it was when the engine was imported: in a forked worker,
# the forkserver's; in a spawned one, the launcher's. Whatever differs from it by the
# time the worker runs was set by torch elastic for this worker (its rank, the store).
_ENVIRONMENT_AT_IMPORT = dict(os.environ)
# What torch elastic sets for every worker (its agent's worker_env), kept as it set them
# even where a value happens to equal the server's.
_ELASTIC_KEYS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)


@dataclass(frozen=True)
class LaunchContext:
    """What a spawned worker would inherit from its launcher, captured at launch."""

    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    launcher_pid: int = field(default_factory=os.getpid)


_launcher_pid: int | None = None  # set in a worker by `adopt`


def launcher_pid() -> int:
    """The process that launched this worker (its agent): not always the parent, which
    may be the forkserver."""
    return _launcher_pid if _launcher_pid is not None else os.getppid()


def start_method() -> str:
    """`forkserver` with the engine preloaded, unless told to spawn or unavailable."""
    wanted = os.environ.get(START_ENV, "forkserver")
    if wanted != "forkserver" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # multiprocessing's own server: the engine imported with a tuned collector, then its
    # heap frozen, before it forks any worker (training/engine/forkserver_preload.py).
    multiprocessing.set_forkserver_preload([SERVER_PRELOAD])
    return "forkserver"


def start_worker_server() -> None:
    """Start the forkserver now, where workers will start from it.

    Where this process runs no other thread and has a CPU-only torch, the server is a
    fork of it: in a stage forked from the stage host (flows/stage_host.py) the engine is
    imported already; in a stage started cold (plain `dvc repro`, a node of a multi-node
    job) this process imports it first, as it would for the job anyway. Nothing is
    imported twice: a new interpreter for the server would import torch, the engine and
    MLflow's store again (~5 s of CPU) beside this process importing most of them.
    Otherwise (a CUDA build, another thread) it is multiprocessing's own, a new
    interpreter that imports the engine while this process goes on, instead of at the
    first launch, with the launcher waiting."""
    if start_method() != "forkserver":
        return
    import multiprocessing.forkserver as forkserver  # Unix only, as the method itself

    if _may_fork_server(forkserver):
        import_preload()
    if _can_fork_server(forkserver):
        _fork_server(forkserver)
    else:
        forkserver.ensure_running()


def _may_fork_server(forkserver) -> bool:
    """Whether this process could serve forks once it has the engine imported."""
    import threading

    import torch

    server = forkserver._forkserver
    return (
        set(vars(server)) == _FORKSERVER_STATE
        and server._forkserver_pid is None
        and threading.active_count() == 1  # a fork keeps no other thread, nor its locks
        and cpu_only_torch(torch)
    )


def import_preload() -> None:
    """As multiprocessing's server does: a module that is not installed (MLflow, where
    the engine runs without tracking) is skipped, and the server is then not a fork."""
    import importlib

    for module in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)


def cpu_only_torch(torch) -> bool:
    # A CUDA build's first device query (the config's, choosing nccl) marks every later
    # fork unable to use CUDA, and nothing says whether it happened: there, the workers
    # come from a new interpreter, as before.
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


# multiprocessing's forkserver state as Python 3.11 to 3.13 keep it; a server is forked
# only where it is kept so (3.14 adds an authentication key, for one).
_FORKSERVER_STATE = {
    "_forkserver_address",
    "_forkserver_alive_fd",
    "_forkserver_pid",
    "_inherited_fds",
    "_lock",
    "_preload_modules",
}


def _can_fork_server(forkserver) -> bool:
    return _may_fork_server(forkserver) and all(module in sys.modules for module in PRELOAD)


def _fork_server(forkserver) -> None:
    """What `ensure_running` does, with a fork of this process as the server: a listener
    only this user can reach, a liveness pipe every client holds, the server's loop."""
    import gc
    import socket
    from multiprocessing import connection, resource_tracker

    server = forkserver._forkserver
    with server._lock:
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            # As the stage host does before its forks: the server's and each worker's
            # collector would otherwise walk, and so copy, every page of torch's and
            # MLflow's objects, which a stage started cold has not frozen.
            gc.freeze()
            _flush_output()  # or what is buffered would be written again by each fork
            pid = os.fork()
            if pid == 0:  # the server: serves until every client is gone, then exits
                _serve_forks(forkserver, listener.fileno(), alive_r, alive_w)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid


def _serve_forks(forkserver, listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The forked server's life: it never returns into the caller's code."""
    global _ENVIRONMENT_AT_IMPORT
    import threading
    import traceback

    from training.engine.process_title import set_process_title

    code = 1
    try:
        # Not the stage's command line, which its workers and tracking helper would
        # inherit too: `pkill -f "gradline stage train"` must reach the stage alone.
        set_process_title(f"gradline-workers (server of pid {os.getppid()})")
        os.close(alive_w)
        # Held by the parent as it forked: a fresh one, as a new server would have.
        forkserver._forkserver._lock = threading.Lock()
        # The server's environment is this one: a worker compares its own against it.
        _ENVIRONMENT_AT_IMPORT = dict(os.environ)
        forkserver.main(listener_fd, alive_r, preload=[])
        code = 0
    except SystemExit as stop:  # the server's way out when its clients are gone
        code = stop.code if isinstance(stop.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def adopt(context: LaunchContext | None) -> None:
    """In the worker, before anything reads the environment: the launcher's environment
    with torch elastic's variables for this worker on top, and the launcher's output."""
    global _launcher_pid
    if context is None:
        return
    _launcher_pid = context.launcher_pid
    merged = launch_environment(context.environ, dict(os.environ), _ENVIRONMENT_AT_IMPORT)
    os.environ.clear()
    os.environ.update(merged)
    if os.getppid() != context.launcher_pid:  # forked by the server, not the launcher
        _reattach_output(context.launcher_pid)


def launch_environment(
    launcher: dict[str, str], current: dict[str, str], at_import: dict[str, str]
) -> dict[str, str]:
    """The launcher's environment, with what torch elastic set in this worker on top:
    whatever changed since the engine was imported here, and elastic's own keys."""
    set_by_elastic = {
        key: value
        for key, value in current.items()
        if at_import.get(key) != value or key in _ELASTIC_KEYS or key.startswith("TORCHELASTIC_")
    }
    return {**launcher, **set_by_elastic}


def _reattach_output(launcher_pid: int) -> None:
    """Point this process's stdout and stderr where the launcher's point now (Linux:
    through /proc; elsewhere the server's are kept). Appending, never truncating."""
    if sys.platform != "linux":
        return
    for fd in (1, 2):
        with contextlib.suppress(OSError):  # a socket, or the launcher is gone
            target = os.open(f"/proc/{launcher_pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
            try:
                if not _same_file(target, fd):
                    _flush(fd)
                    os.dup2(target, fd)
            finally:
                os.close(target)


def _same_file(a: int, b: int) -> bool:
    try:
        first, second = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def _flush_output() -> None:
    for fd in (1, 2):
        _flush(fd)


def _flush(fd: int) -> None:
    stream = sys.stdout if fd == 1 else sys.stderr
    with contextlib.suppress(OSError, ValueError, AttributeError):
        stream.flush()
