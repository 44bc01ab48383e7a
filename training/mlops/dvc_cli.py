"""The quick DVC commands whose answer is read, without Prefect: `dvc status` (what
changed since dvc.lock) and a quiet `dvc push` (everything already on the remote?)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from training.errors import GradlineError


class DvcCommandFailed(GradlineError):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def dvc_status(root: Path, *targets: str) -> dict:
    """What `dvc status` says changed since the last run (of `targets`, default all
    stages): {} when nothing did. A target's status includes the stages it depends on."""
    return dvc_status_started(root, *targets)()


def dvc_status_started(root: Path, *targets: str) -> Callable[..., dict]:
    """`dvc status`, started now in the background; call the result for its answer."""
    args = ["status", "--json", *targets]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dvc", *args],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    answered: list[dict] = []  # the answer once read: asking again returns it

    def answer(*_: object) -> dict:
        if not answered:
            out, err = proc.communicate()
            if proc.returncode != 0:
                raise DvcCommandFailed(
                    f"`dvc {' '.join(args)}` failed ({proc.returncode}):\n{err[-4000:]}",
                    proc.returncode,
                )
            answered.append(json.loads(out or "{}"))
        return answered[0]

    return answer


def dvc_push_quietly(root: Path) -> bool:
    """`dvc push` of everything dvc.lock records; whether it succeeded (its output is
    dropped: on failure the caller goes the long way, which reports it)."""
    push = [sys.executable, "-m", "dvc", "push", "-q"]
    return subprocess.run(push, cwd=root, capture_output=True).returncode == 0
