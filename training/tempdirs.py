"""Temporary folders that a killed process does not leave behind for good.

gradline's processes keep short-lived files in temporary folders: the launcher's agent
folder, a stage's error record, the stage host's socket, a model being logged. Each is
removed on every way out but one: SIGKILL (a drill, the OOM killer, `kill -9` on a run's
tree) leaves it in the system's temporary folder, one more with every such run.

Here a folder's name carries its owner: `<prefix><pid namespace>-<pid>-<random>`. Making
a folder of a prefix first removes that prefix's folders whose owner is gone. Only owners
in this process's pid namespace are judged (another container sharing the folder has
pids of its own), and a pid that came back as another process keeps its folder: a
leftover kept, never a live folder removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from training.atomic import pid_alive


def _pid_namespace() -> str:
    """This process's pid namespace, as a number ("0" where the platform has none)."""
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or "0"
    except OSError:
        return "0"


def owned_tempdir(prefix: str) -> str:
    """A new temporary folder named for this process (`mkdtemp`: the caller removes it),
    after removing the leftovers of `prefix` whose owners are gone."""
    namespace = _pid_namespace()
    remove_orphans(prefix, namespace)
    return tempfile.mkdtemp(prefix=f"{prefix}{namespace}-{os.getpid()}-")


@contextlib.contextmanager
def owned_temporary_directory(prefix: str) -> Iterator[str]:
    """`owned_tempdir` for the `with` block, then removed (as TemporaryDirectory; a
    removal that fails does not replace the block's own outcome)."""
    folder = owned_tempdir(prefix)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_orphans(prefix: str, namespace: str | None = None) -> list[Path]:
    """Remove the folders of `prefix` in the temporary folder whose owner, in this pid
    namespace, has exited; return them."""
    namespace = namespace or _pid_namespace()
    owner = re.compile(rf"{re.escape(prefix)}{namespace}-(\d+)-")
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{prefix}{namespace}-*"):
        match = owner.match(folder.name)
        if match and folder.is_dir() and not pid_alive(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
