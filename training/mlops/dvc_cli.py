"""DVC commands, without Prefect: `dvc_process` starts one (forked from the stage host
when there is one); `dvc status` (what changed since dvc.lock) and a quiet `dvc push`
(everything already on the remote?) are the quick ones whose answer is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from training.errors import GradlineError
from training.host_client import HostedProcess, HostRefused, start_in_host


class DvcCommandFailed(GradlineError):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def dvc_process(
    root: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
) -> HostedProcess | subprocess.Popen:
    """`dvc args` in `root`, started now, its pipes text: a fork of the stage host that
    `GRADLINE_STAGE_HOST` names (ready in ~0.1 s, DVC imported already), else a fresh
    `python -m dvc` (~0.5 s of imports first). Either is used as a `subprocess.Popen`."""
    env = dict(os.environ if env is None else env)
    try:
        return start_in_host(["dvc", *args], cwd=str(root), env=env, stdout=stdout, stderr=stderr)
    except HostRefused:
        command = [sys.executable, "-m", "dvc", *args]
        return subprocess.Popen(
            command, cwd=root, env=env, stdout=stdout, stderr=stderr, text=True, bufsize=1
        )


def dvc_status(root: Path, *targets: str) -> dict:
    """What `dvc status` says changed since the last run (of `targets`, default all
    stages): {} when nothing did. A target's status includes the stages it depends on."""
    return dvc_status_started(root, *targets)()


def dvc_status_started(root: Path, *targets: str) -> Callable[..., dict]:
    """`dvc status`, started now in the background; call the result for its answer."""
    args = ["status", "--json", *targets]
    proc = dvc_process(root, *args)

    answered: list[dict | DvcCommandFailed] = []  # read once: asking again gives the same
    reading = threading.Lock()  # asked from two threads (StatusThenPush)

    def answer(*_: object) -> dict:
        with reading:
            if not answered:
                out, err = proc.communicate()
                if proc.returncode != 0:
                    command = f"dvc {' '.join(args)}"
                    message = f"`{command}` failed ({proc.returncode}):\n{err[-4000:]}"
                    answered.append(DvcCommandFailed(message, proc.returncode))
                else:
                    answered.append(json.loads(out or "{}"))
        if isinstance(answered[0], DvcCommandFailed):
            raise answered[0]
        return answered[0]

    return answer


class StatusThenPush:
    """`dvc status` of every stage, started now in the background, and, once it says
    nothing changed, the quiet `dvc push` an up-to-date run makes next (an unchanged
    rerun's two DVC commands, overlapping the caller's own check)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.status = dvc_status_started(root)
        self._pushed: list[bool] = []
        self._thread = threading.Thread(target=self._push_if_unchanged, daemon=True)
        self._thread.start()

    def _push_if_unchanged(self) -> None:
        try:
            unchanged = self.status() == {}
        except DvcCommandFailed:
            unchanged = False
        self._pushed.append(unchanged and dvc_push_quietly(self.root))

    def pushed(self) -> bool:
        """Whether everything dvc.lock records is on the remote: False when the status
        found a change or failed, or the push failed. Both commands have ended after."""
        self._thread.join()
        return self._pushed[0]


def dvc_push_quietly(root: Path) -> bool:
    """`dvc push` of everything dvc.lock records; whether it succeeded (its output is
    dropped: on failure the caller goes the long way, which reports it)."""
    push = dvc_process(root, "push", "-q")
    push.communicate()
    return push.returncode == 0
