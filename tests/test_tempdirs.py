"""Temporary folders named for their owner (training.tempdirs): a SIGKILLed process's
folder is removed by the next folder of its kind, and nothing else is."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from training.tempdirs import (
    owned_tempdir,
    owned_temporary_directory,
    owner_scope,
    remove_orphans,
)


@pytest.fixture
def prefix():
    """A prefix of this test's own, so no real gradline folder is touched."""
    prefix = f"gradline-test-{secrets.token_hex(4)}-"
    yield prefix
    for leftover in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def test_a_sigkilled_owner_s_folder_goes_with_the_next_folder_of_its_kind(prefix) -> None:
    code = (
        "import os, signal, sys\n"
        "from training.tempdirs import owned_tempdir\n"
        f"folder = owned_tempdir({prefix!r})\n"
        "open(os.path.join(folder, 'error.json'), 'w').write('{}')\n"
        "print(folder, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = Path(proc.stdout.strip())
    assert left.is_dir() and (left / "error.json").exists()  # SIGKILL left it behind
    assert left.name.startswith(f"{prefix}{owner_scope()}-")

    mine = Path(owned_tempdir(prefix))
    try:
        assert not left.exists()  # its owner is gone: removed
        assert mine.is_dir() and mine.name.startswith(f"{prefix}{owner_scope()}-{os.getpid()}-")
    finally:
        mine.rmdir()


def test_only_folders_of_gone_owners_of_this_scope_are_removed(prefix) -> None:
    base, scope = Path(tempfile.gettempdir()), owner_scope()
    assert scope is not None and len(scope) == 8  # Linux: a boot and a pid namespace
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = base / f"{prefix}{scope}-{_dead_pid()}-abc"
        live = base / f"{prefix}{scope}-{living.pid}-abc"  # another process, alive
        other_scope = base / f"{prefix}0{scope[1:]}-{_dead_pid()}-abc"  # another machine's
        unnamed = base / f"{prefix}{scope}-notapid-abc"
        for folder in (gone, live, other_scope, unnamed):
            folder.mkdir()
            (folder / "file").write_text("x")
        a_file = base / f"{prefix}{scope}-{_dead_pid()}-file"
        a_file.write_text("not a folder")
        elsewhere = base / f"{prefix}target"
        elsewhere.mkdir()
        a_link = base / f"{prefix}{scope}-{_dead_pid()}-link"
        a_link.symlink_to(elsewhere)

        assert remove_orphans(prefix, scope) == [gone]
        assert not gone.exists()
        assert live.is_dir() and other_scope.is_dir() and unnamed.is_dir()
        assert a_file.is_file() and a_link.is_symlink() and elsewhere.is_dir()
    finally:
        living.kill()
        living.wait()


def test_the_block_s_folder_is_removed_on_the_way_out_even_on_an_error(prefix) -> None:
    failing = pytest.raises(RuntimeError, match="the block failed")
    with failing, owned_temporary_directory(prefix) as folder:
        (Path(folder) / "record.json").write_text("{}")
        raise RuntimeError("the block failed")
    assert not Path(folder).exists()
