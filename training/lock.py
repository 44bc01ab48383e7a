"""One writer per project: an OS file lock held for a whole run.

Everything that writes params.yaml, dvc.lock, data/, model/ or checkpoints/ (`gradline
run`, `stage`, `compare-updates`, `example`, a deployment's flow run) holds
`.gradline/lock`. A second one waits, saying who holds it (pid, command, since), or with
`wait=False` fails at once (exit 2). The kernel drops the lock when its holder dies, so
a dead holder's lock is simply taken over.

A run's own descendants (dvc, then `gradline stage`) find the lock held by their run
(LOCK_ENV names it and the run's token) and go on. Each holds a shared lock on
`.gradline/lock.tree` while it works; a new run takes that one exclusively before it
starts, so it also waits for the stragglers of a run that was killed (its stage still
writing after `gradline run` died).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from training.atomic import recover_swaps
from training.errors import GradlineError

LOCK_ENV = "GRADLINE_PROJECT_LOCK"  # "<lock file>\t<token>" of the run a process belongs to
_POLL_S = 0.5
_held_here: dict[Path, int] = {}  # lock file -> depth, for nested holds in one process
_exclusive_fds: set[int] = set()  # the descriptors of the locks this process took


def _drop_exclusive_in_child() -> None:
    """In a fork of the holder (a stage started cold forks its workers' server, and so
    its workers, from itself): close the inherited descriptors of the exclusive lock, so
    that a fork outliving the holder does not keep the project locked. The lock stays
    the holder's (a flock goes with the last descriptor closed); the fork keeps the
    run's tree lock shared, as every process of the run does, so a next run still
    waits for it. The fork still counts the project as held here (`project_lock` in it
    is a no-op), as a process of the run."""
    for fd in _exclusive_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _exclusive_fds.clear()


os.register_at_fork(after_in_child=_drop_exclusive_in_child)


class ProjectLocked(GradlineError):
    """Another run holds the project and the caller chose not to wait."""


def lock_file(root: Path) -> Path:
    return root.resolve() / ".gradline" / "lock"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def project_lock(
    root: Path, wait: bool = True, say: Callable[[str], None] = _say
) -> Iterator[None]:
    """Hold the project for the block (reentrant; a no-op in the holder's descendants)."""
    path = lock_file(root)
    if path in _held_here:
        _held_here[path] += 1
        try:
            yield
        finally:
            _held_here[path] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with _tree_member(path) if _belongs_to_holder(path) else _top_level(path, wait, say):
        _held_here[path] = 1
        try:
            yield
        finally:
            del _held_here[path]


@contextlib.contextmanager
def _top_level(path: Path, wait: bool, say: Callable[[str], None]) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    _exclusive_fds.add(fd)
    try:
        _acquire(fd, path, wait, say)
        tree = os.open(_tree_file(path), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # A killed run's stages may still be writing: wait until they are gone.
            if not _try_lock(tree, fcntl.LOCK_EX):
                say(f"waiting for processes of an earlier run of {path.parents[1]} to end")
                fcntl.flock(tree, fcntl.LOCK_EX)
            fcntl.flock(tree, fcntl.LOCK_SH)
            token = secrets.token_hex(8)
            _write_holder(fd, token)
            for target, outcome in recover_swaps(path.parents[1]):
                say(f"{target}: an interrupted swap was {outcome}")
            with _env(LOCK_ENV, f"{path}\t{token}"):
                yield
        finally:
            os.close(tree)
    finally:
        if fd in _exclusive_fds:  # (not in a fork, where the at-fork hook closed it)
            _exclusive_fds.discard(fd)
            os.close(fd)  # releases the lock


def _acquire(fd: int, path: Path, wait: bool, say: Callable[[str], None]) -> None:
    announced = None
    while not _try_lock(fd, fcntl.LOCK_EX):
        holder = describe_holder(path)
        if not wait:
            raise ProjectLocked(
                f"{path.parents[1]} is in use by {holder}. Wait for it to end, or run "
                "again without --no-wait to queue behind it."
            )
        if holder != announced:
            say(f"waiting for {path.parents[1]}: in use by {holder}")
            announced = holder
        time.sleep(_POLL_S)


@contextlib.contextmanager
def _tree_member(path: Path) -> Iterator[None]:
    """A process of the run that holds the lock: keep the run's tree lock shared."""
    tree = os.open(_tree_file(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(tree, fcntl.LOCK_SH)
        yield
    finally:
        os.close(tree)


def _belongs_to_holder(path: Path) -> bool:
    """Whether this process was started by the run now holding `path` (not by a run that
    has since died and been replaced: the holder's token would differ)."""
    named, _, token = os.environ.get(LOCK_ENV, "").partition("\t")
    if Path(named) != path or not token:
        return False
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("token") == token:
            return _is_locked(path)
    return False


def _is_locked(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _try_lock(fd, fcntl.LOCK_SH):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        return True
    finally:
        os.close(fd)


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _tree_file(path: Path) -> Path:
    return path.with_name(f"{path.name}.tree")


def _write_holder(fd: int, token: str) -> None:
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": " ".join(Path(sys.argv[0]).name.split() + sys.argv[1:]) or "python",
        "since": datetime.now(UTC).isoformat(timespec="seconds"),
        "token": token,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def describe_holder(path: Path) -> str:
    """`pid 123 on host (gradline run --set ...) since 2026-...` for messages."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return "another run (starting)"
    return f"pid {record['pid']} on {record['host']} ({record['command']}) since {record['since']}"


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
