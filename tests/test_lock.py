"""One writer per project: a second run waits (saying who holds the project) or, with
--no-wait, exits 2 at once; a dead holder's lock is taken over; a run's own stages go on
under its lock; a killed run's stragglers are waited for."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from training.lock import LOCK_ENV

from .conftest import REPO

pytestmark = pytest.mark.timeout(360)  # above the waits below: hangs end in their asserts
GRADLINE = str(Path(sys.executable).parent / "gradline")

# Holds the project until killed; with "child", also starts a process of its run that
# holds the run's tree lock for `seconds` after this one is gone.
_HOLDER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from pathlib import Path
    from training.lock import project_lock
    root, child, seconds = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    with project_lock(root):
        if child == "child":
            straggler = subprocess.Popen(
                [sys.executable, "-c", STRAGGLER, str(root), seconds],
                stdout=subprocess.PIPE, text=True,
            )
            assert straggler.stdout.readline().strip() == "taken"  # its lock is held now
        print("held", flush=True)
        time.sleep(600)
    """
)
_STRAGGLER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from training.lock import project_lock
    with project_lock(Path(sys.argv[1]), wait=False):  # a member of its run: no waiting
        print("taken", flush=True)
        time.sleep(float(sys.argv[2]))
    """
)


@pytest.fixture
def project(tmp_path) -> Path:
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _hold(project: Path, child: str = "", seconds: float = 0) -> subprocess.Popen:
    code = f"STRAGGLER = {_STRAGGLER!r}\n{_HOLDER}"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(project), child or "-", str(seconds)],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _gradline(project: Path, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [GRADLINE, *args], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, **kwargs,
    )  # fmt: skip


def _model_name(project: Path) -> str:
    return yaml.safe_load((project / "params.yaml").read_text())["model"]["name"]


def test_no_wait_exits_2_at_once_naming_the_holder_and_changes_nothing(project) -> None:
    holder = _hold(project)
    try:
        before = (project / "params.yaml").read_text()
        proc = _gradline(project, "run", "--no-wait", "--set", "train.seed=1", env=_env())
        # The holder keeps the lock for ten minutes: a run that waited for it would outlast
        # the timeout (which only bounds a loaded machine's start-up), so ending at all,
        # with the holder named, is the proof that it did not wait.
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err
        assert f"in use by pid {holder.pid}" in err and "-c" in err and "since" in err
        assert (project / "params.yaml").read_text() == before  # the --set was not written
    finally:
        holder.kill()
        holder.wait()


def test_a_second_writer_waits_and_takes_over_when_the_holder_dies(project) -> None:
    holder = _hold(project)
    waiter = _gradline(project, "example", "digits-cnn", env=_env())
    try:
        time.sleep(3)
        assert waiter.poll() is None  # still waiting
        assert _model_name(project) == "mlp"
    finally:
        holder.send_signal(signal.SIGKILL)  # no cleanup: the kernel drops the lock
        holder.wait()
    _, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    assert f"waiting for {project}: in use by pid {holder.pid}" in err
    assert _model_name(project) == "cnn"


def test_a_process_of_the_holding_run_goes_on(project) -> None:
    holder = _hold(project)
    try:
        lock = project / ".gradline" / "lock"
        token = json.loads(lock.read_text())["token"]
        env = {**_env(), LOCK_ENV: f"{lock}\t{token}"}
        member = _gradline(project, "example", "digits-cnn", "--no-wait", env=env)
        _, err = member.communicate(timeout=60)
        assert member.returncode == 0, err
        # A forged or stale token is not the holder's run: it must wait like any other.
        env[LOCK_ENV] = f"{lock}\tnot-the-token"
        stranger = _gradline(project, "example", "digits-mlp", "--no-wait", env=env)
        _, err = stranger.communicate(timeout=60)
        assert stranger.returncode == 2 and f"pid {holder.pid}" in err
    finally:
        holder.kill()
        holder.wait()


def test_a_new_run_waits_for_the_stragglers_of_a_killed_one(project) -> None:
    holder = _hold(project, child="child", seconds=6)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    killed_at = time.monotonic()
    proc = _gradline(project, "example", "digits-cnn", env=_env())
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "waiting for processes of an earlier run" in err
    assert time.monotonic() - killed_at > 3  # it waited for the straggler to end


# Holds the project, forks a process that outlives it (as a stage started cold forks its
# workers' server), prints the fork's pid and lets go.
_FORKING_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from training.lock import project_lock
    with project_lock(Path(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)  # the caller reads the holder's output to its end
            os.dup2(null, 2)
            time.sleep(600)
            os._exit(0)
        print(pid, flush=True)
    """
)


def test_a_fork_of_the_holder_keeps_the_runs_tree_but_not_the_project(project) -> None:
    import fcntl

    from training.lock import _is_locked, lock_file

    proc = subprocess.run(
        [sys.executable, "-c", _FORKING_HOLDER, str(project)],
        env=_env(), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    fork = int(proc.stdout.strip())
    try:
        assert not _is_locked(lock_file(project))  # the holder is gone: the project is free
        tree = os.open(project / ".gradline" / "lock.tree", os.O_RDWR)
        try:
            # ... but a next run waits for the fork, a process of the run still working.
            with pytest.raises(BlockingIOError):
                fcntl.flock(tree, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(tree)
    finally:
        os.kill(fork, signal.SIGKILL)
