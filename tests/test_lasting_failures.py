"""Failures no retry can fix fail at once, saying what to change.

A disk that fills up: the job stops at once naming the path, what it needed and what
is free, without retries; the checkpoints already written stay intact; after space is
freed, running again resumes from the latest one.

The checkpoints live on a 64 MiB tmpfs mounted in a mount namespace of the test's own
(`unshare -m` as root, else `unshare -rm` in a user namespace), so filling it touches
nothing else; a fault fills it at step 12, between two checkpoints."""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from training.config import update_params_file
from training.engine.checkpoint import list_checkpoints, verify
from training.errors import USER_ERROR_EXIT_CODE, DiskFull, as_user_error, is_retryable
from training.host_client import STAGE_HOST_ENV
from training.mlops.tracking import client, ensure_experiment

from .conftest import REPO
from .resume_checks import Resumed, assert_resumed
from .servers import SharedStageHost

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(660)]

GRADLINE = str(Path(sys.executable).parent / "gradline")
PARAMS = {
    "model": {"name": "mlp", "hidden": 32, "depth": 2},
    "train": {"epochs": 3, "batch_size": 32},
    # Saves in the loop: the step-8 checkpoint is surely complete when the disk fills.
    "runtime": {
        "procs_per_node": 1,
        "checkpoint_every_steps": 8,
        "keep_checkpoints": 3,
        "async_checkpoint": False,
    },
}

# Both attempts inside one mount namespace: the tmpfs lives as long as the namespace.
_SCRIPT = """
set -u
mount -t tmpfs -o size=64m gradline-test "$CK"
$TRAIN > "$OUT/first.log" 2>&1; echo $? > "$OUT/first.code"
ls "$CK"/*/ > "$OUT/after-first.txt"
cp -r "$CK" "$OUT/checkpoints-after-first"
rm -f "$CK"/*/fill-ballast
$TRAIN > "$OUT/second.log" 2>&1; echo $? > "$OUT/second.code"
cp -r "$CK" "$OUT/checkpoints-after-second"
"""


def _project(tmp_path: Path, shards: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "dvc.yaml", project / "dvc.yaml")
    shutil.copy(REPO / "params.yaml", project / "params.yaml")
    update_params_file(project / "params.yaml", PARAMS, replace=frozenset({"model"}))
    shutil.copytree(shards, project / "shards")
    return project


def test_a_batch_larger_than_the_data_fails_before_any_worker_or_run(tiny_shards, tmp_path):
    project = _project(tmp_path, tiny_shards)
    update_params_file(project / "params.yaml", {"train": {"batch_size": 1000000}})
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train = [GRADLINE, "stage", "train", "--shards", "shards", "--model", "model"]
    train += ["--checkpoints", str(tmp_path / "ck"), "--result", "result.json"]
    # Run as `gradline run` runs stages: a fork of the stage host (tests/servers.py).
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking, STAGE_HOST_ENV: SharedStageHost.socket()}
    done = subprocess.run(train, cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == USER_ERROR_EXIT_CODE, done.stderr[-3000:]
    assert "fewer than one global batch (1000000); lower train.batch_size" in done.stderr
    assert "attempt(s)" not in done.stderr  # no worker was started, so none restarted
    assert not (tmp_path / "ck").exists() and not (tmp_path / "mlflow.db").exists()


def _namespace() -> list[str]:
    """A command prefix that gives a private mount namespace where tmpfs can be mounted."""
    for prefix in (["unshare", "-m"], ["unshare", "-rm"]):
        probe = subprocess.run(
            [*prefix, "sh", "-c", "mount -t tmpfs -o size=1m probe /mnt 2>/dev/null || "
             "mount -t tmpfs -o size=1m probe /tmp"],
            capture_output=True,
        )  # fmt: skip
        if probe.returncode == 0:
            return prefix
    raise AssertionError(
        "this test needs a mount namespace (util-linux `unshare -m` as root, or user "
        "namespaces for `unshare -rm`) to mount a small tmpfs"
    )


def test_a_full_disk_stops_the_job_at_once_and_a_rerun_resumes(tiny_shards, tmp_path) -> None:
    project, out, ck = _project(tmp_path, tiny_shards), tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    ck.mkdir()
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = ensure_experiment(tracking, "gradline", (tmp_path / "artifacts").as_uri())
    train = [GRADLINE, "stage", "train", "--shards", "shards", "--model", "model"]
    train += ["--checkpoints", str(ck), "--result", "result.json"]
    env = {
        **os.environ,
        "CK": str(ck),
        "OUT": str(out),
        "TRAIN": shlex.join(train),
        "MLFLOW_TRACKING_URI": tracking,
        "GRADLINE_FAULT": "fill:rank=0:step=12:once=1",
    }
    done = subprocess.run([*_namespace(), "bash", "-c", _SCRIPT], cwd=project, env=env, timeout=600)
    assert done.returncode == 0
    first = (out / "first.log").read_text()
    assert (out / "first.code").read_text().strip() == str(USER_ERROR_EXIT_CODE), first[-3000:]
    # It names where, and how much is free; it says a retry would not help.
    assert f"no space left for {ck}/" in first and "free there" in first, first[-3000:]
    assert "a retry would fail the same way" in first
    assert "not restarting" in first or "attempt(s)" in first
    # The checkpoint written before the disk filled is whole: its checksums verify.
    (job,) = [p for p in (out / "checkpoints-after-first").iterdir() if p.is_dir()]
    kept = list_checkpoints(job)
    assert [p.name for p in kept] == ["step-00000008"]
    verify(kept[0])
    second = (out / "second.log").read_text()
    assert (out / "second.code").read_text().strip() == "0", second[-3000:]
    assert "resumed from" in second and "at step 8" in second, second[-3000:]
    (job,) = [p for p in (out / "checkpoints-after-second").iterdir() if p.is_dir()]
    assert_resumed(job, Resumed(8, written_by=1, resumed_by=1))
    (run,) = client(tracking).search_runs([experiment])
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client(tracking).get_metric_history(run.info.run_id, "train_loss")]
    assert steps == sorted(set(steps)) == list(range(1, len(steps) + 1))  # one per step


def test_out_of_space_is_the_users_to_fix_not_a_crash_to_retry(tmp_path) -> None:
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "shards" / "x"))
    error = as_user_error(full)
    assert isinstance(error, DiskFull) and not is_retryable(full)
    assert f"no space left for {tmp_path}/shards/x" in str(error) and "free there" in str(error)
    assert is_retryable(OSError(errno.EIO, "I/O error"))  # a flaky disk may pass next time
