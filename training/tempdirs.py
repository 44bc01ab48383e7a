"""Temporary folders that a killed process does not leave behind for good.

gradline's processes keep short-lived files in temporary folders: the launcher's agent
folder, a stage's error record, the stage host's socket, a model being logged. Each is
removed on every way out but one: SIGKILL (a drill, the OOM killer, `kill -9` on a run's
tree) leaves it in the system's temporary folder, one more with every such run.

Here a folder's name carries its owner: `<prefix><scope>-<pid>-<random>`, where the scope
says where that pid means that process: this kernel's boot (machines sharing a
temporary folder, as cluster nodes may, boot apart) and this pid namespace (containers
sharing one have pids of their own). Making a folder of a prefix first removes that
prefix's folders of the same scope whose owner is gone. A pid that came back as another
process keeps its folder: a leftover kept, never a live folder removed. Where Linux's
/proc cannot tell the scope, folders are plain and nothing is removed.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from training.atomic import pid_alive


def owner_scope() -> str | None:
    """Where this process's pid names this process, as 8 hex digits: the kernel's boot
    and the pid namespace. None where /proc does not say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return hashlib.sha256(f"{boot} {namespace}".encode()).hexdigest()[:8]


def owned_tempdir(prefix: str) -> str:
    """A new temporary folder named for this process (`mkdtemp`: the caller removes it),
    after removing the leftovers of `prefix` whose owners are gone."""
    scope = owner_scope()
    if scope is None:
        return tempfile.mkdtemp(prefix=prefix)
    remove_orphans(prefix, scope)
    return tempfile.mkdtemp(prefix=f"{prefix}{scope}-{os.getpid()}-")


@contextlib.contextmanager
def owned_temporary_directory(prefix: str) -> Iterator[str]:
    """`owned_tempdir` for the `with` block, then removed (as TemporaryDirectory; a
    removal that fails does not replace the block's own outcome)."""
    folder = owned_tempdir(prefix)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_orphans(prefix: str, scope: str) -> list[Path]:
    """Remove the folders of `prefix` and `scope` in the temporary folder whose owner has
    exited; return those removed."""
    owner = re.compile(rf"{re.escape(prefix)}{scope}-(\d+)-")
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{glob.escape(prefix)}{scope}-*"):
        match = owner.match(folder.name)
        if not match or folder.is_symlink() or not folder.is_dir():
            continue
        if not pid_alive(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():  # (another user's stays: not ours to remove)
                removed.append(folder)
    return removed
