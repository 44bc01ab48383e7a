"""Write-aside-then-swap helpers, so a failure never leaves a half-written output."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Names a crash_point at which the process kills itself (tests and drills only).
CRASH_AT_ENV = "GRADLINE_CRASH_AT"


def fsync_dir(path: Path) -> None:
    """Persist a rename: the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(target: Path, mode: str = "wb") -> Iterator[Any]:
    """Yield a handle on a temp file beside `target`; on success fsync and rename it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(target: Path, payload: Any) -> None:
    with atomic_file(target, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.write("\n")


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield an empty staging folder beside `target`; on success it replaces `target`.

    On any exception the staging folder is removed and `target` is left as it was. A
    kill at any point leaves either the old `target` or the new one, never neither: the
    swap is recoverable (see `recover_swap`, which the next write of `target` and the
    project lock's holder run first).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_swap(target)
    staging = Path(
        tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.staging-{os.getpid()}-")
    )
    try:
        yield staging
        # Renaming the finished staging folder to the fixed name `.incoming` marks it
        # complete: from here on, recovery finishes the swap instead of dropping it.
        os.replace(staging, _incoming(target))
        fsync_dir(target.parent)
        _finish_swap(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _incoming(target: Path) -> Path:
    return target.with_name(f".{target.name}.incoming")


def _retired(target: Path) -> Path:
    return target.with_name(f".{target.name}.retired")


def _finish_swap(target: Path) -> None:
    """Retire `target` (if any) and move the complete `.incoming` folder into its place.
    Idempotent: a kill anywhere in it is finished by running it again."""
    incoming, retired = _incoming(target), _retired(target)
    if target.exists():
        shutil.rmtree(retired, ignore_errors=True)  # left by a kill after the swap
        os.replace(target, retired)
    crash_point("atomic_dir.between_renames")
    os.replace(incoming, target)
    fsync_dir(target.parent)
    shutil.rmtree(retired, ignore_errors=True)


def recover_swap(target: Path) -> str | None:
    """Complete or roll back a swap of `target` that a kill interrupted; say which.

    A complete new folder (`.incoming`) is swapped in; otherwise a retired old folder
    comes back if `target` is missing. Staging folders of processes that no longer
    exist (half-written, never complete) are removed.
    """
    if not target.parent.is_dir():
        return None
    outcome = None
    if _incoming(target).is_dir():
        _finish_swap(target)
        outcome = "completed"
    elif _retired(target).is_dir():
        if target.exists():
            shutil.rmtree(_retired(target), ignore_errors=True)
        else:
            os.replace(_retired(target), target)
            fsync_dir(target.parent)
            outcome = "rolled back"
    for staging in target.parent.glob(f".{glob.escape(target.name)}.staging-*"):
        if not pid_alive(_staging_pid(staging)):
            shutil.rmtree(staging, ignore_errors=True)
    return outcome


def _staging_pid(staging: Path) -> int:
    pid = staging.name.rsplit(".staging-", 1)[1].split("-", 1)[0]
    return int(pid) if pid.isdigit() else 0


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (someone else's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def crash_point(name: str) -> None:
    """Fault injection for tests and drills: with GRADLINE_CRASH_AT=name, the process is
    killed here (SIGKILL: no cleanup runs, as on a power cut or the OOM killer)."""
    if os.environ.get(CRASH_AT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def recover_swaps(root: Path, depth: int = 3) -> list[tuple[Path, str]]:
    """`recover_swap` for every folder under `root` (not hidden, `depth` levels deep)
    that a killed swap left behind; the ones completed or rolled back, and how."""
    recovered = []
    for folder in _visible_folders(root, depth):
        names = {
            match["name"]
            for entry in folder.iterdir()
            if (match := _SWAP_LEFTOVER.match(entry.name))
        }
        for name in sorted(names):
            if outcome := recover_swap(folder / name):
                recovered.append((folder / name, outcome))
    return recovered


# `.<name>.incoming`, `.<name>.retired`, `.<name>.staging-<pid>-<random>` (see atomic_dir)
_SWAP_LEFTOVER = re.compile(r"^\.(?P<name>.+?)\.(incoming|retired|staging-\d+-[^.]*)$")


def _visible_folders(root: Path, depth: int) -> Iterator[Path]:
    yield root
    if depth == 0:
        return
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and not entry.name.startswith("."):
            yield from _visible_folders(entry, depth - 1)
