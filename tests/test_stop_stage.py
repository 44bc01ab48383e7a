"""A flow's stop reaches the stage, not the processes the stage forked.

A train stage started without the stage host forks its workers' server from itself, and
its workers from that (training/engine/worker_start.py): all of them carry the stage's
command line. The stop (tasks/dvc_stages.stop_stage) must go to the stage alone, which
stops its workers at a checkpoint; the rest is killed only after the grace period.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

import psutil
import pytest

from tasks.dvc_stages import stop_stage

# A stand-in `gradline stage train` that forks a child and a grandchild, as a cold stage
# forks its workers' server and the server its workers. Each notes the SIGTERM it gets.
STAGE = """\
import os, signal, sys, time
out = sys.argv[-1]
who = "stage"
if os.fork() == 0:
    who = "server"
    if os.fork() == 0:
        who = "worker"
def on_term(signum, frame):
    open(os.path.join(out, who + ".term"), "w").close()
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(out, who + ".ready"), "w").close()
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_the_stop_goes_to_the_outermost_stage_and_the_rest_is_killed_after_the_grace(
    tmp_path,
) -> None:
    command = tmp_path / "bin" / "gradline"
    command.parent.mkdir()
    command.write_text(f"#!{sys.executable}\n{STAGE}")
    command.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    # As dvc runs a stage: through a shell that stays its parent.
    dvc = subprocess.Popen(
        ["/bin/sh", "-c", f'"{command}" stage train "{out}"; true'],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while len(list(out.glob("*.ready"))) < 3:
        assert time.monotonic() < deadline, sorted(p.name for p in out.iterdir())
        time.sleep(0.05)
    tree = [psutil.Process(dvc.pid), *psutil.Process(dvc.pid).children(recursive=True)]

    stop_stage(dvc, collections.deque(maxlen=10), lambda line: None, grace_s=1.0)

    assert sorted(p.name for p in out.glob("*.term")) == ["stage.term"]
    assert dvc.returncode is not None
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in tree):
        assert time.monotonic() < deadline, [p.pid for p in tree if _alive(p)]
        time.sleep(0.05)
    assert not os.path.exists(out / "server.term")


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
