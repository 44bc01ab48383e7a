"""Crash windows: a kill at any point of a folder swap leaves the old folder or the new
one, and the next start completes or rolls back what the kill interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from training.atomic import CRASH_AT_ENV, atomic_dir, recover_swap

REPO = Path(__file__).resolve().parents[1]

# Writes a new `data` folder over the old one; SIGKILLs itself mid-body when asked.
_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from training.atomic import atomic_dir
    with atomic_dir(Path(sys.argv[1])) as staging:
        (staging / "part-0").write_text("new")
        if sys.argv[2] == "mid-body":
            os.kill(os.getpid(), signal.SIGKILL)
        (staging / "part-1").write_text("new")
    """
)


def _old_folder(tmp_path: Path) -> Path:
    target = tmp_path / "data"
    target.mkdir()
    (target / "part-0").write_text("old")
    return target


def _killed_writer(target: Path, where: str, crash_at: str = "") -> None:
    env = {**os.environ, CRASH_AT_ENV: crash_at, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _WRITER, str(target), where], env=env, timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_a_kill_between_the_renames_is_completed_on_the_next_start(tmp_path) -> None:
    target = _old_folder(tmp_path)
    _killed_writer(target, "whole", crash_at="atomic_dir.between_renames")
    # The window is real: the old folder is retired and the new one not yet in place.
    assert not target.exists()
    assert recover_swap(target) == "completed"
    assert _contents(target) == {"part-0": "new", "part-1": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_a_kill_while_writing_keeps_the_old_folder_and_drops_the_half_written_one(
    tmp_path,
) -> None:
    target = _old_folder(tmp_path)
    _killed_writer(target, "mid-body")
    assert _contents(target) == {"part-0": "old"}
    assert len(list(tmp_path.glob(".data.staging-*"))) == 1  # the dead writer's
    assert recover_swap(target) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_a_retired_folder_without_a_new_one_is_rolled_back(tmp_path) -> None:
    target = _old_folder(tmp_path)
    os.replace(target, tmp_path / ".data.retired")
    assert recover_swap(target) == "rolled back"
    assert _contents(target) == {"part-0": "old"}


def test_the_next_write_of_the_folder_recovers_first(tmp_path) -> None:
    target = _old_folder(tmp_path)
    _killed_writer(target, "whole", crash_at="atomic_dir.between_renames")
    with pytest.raises(RuntimeError), atomic_dir(target):
        raise RuntimeError("this write fails")
    # The failed write changed nothing, but the interrupted one was finished before it.
    assert _contents(target) == {"part-0": "new", "part-1": "new"}


def test_a_live_writers_staging_folder_is_left_alone(tmp_path) -> None:
    target = _old_folder(tmp_path)
    with atomic_dir(target) as staging:
        (staging / "part-0").write_text("new")
        recover_swap(target)  # another process starting now must not take it away
        assert staging.is_dir()
    assert _contents(target) == {"part-0": "new"}
