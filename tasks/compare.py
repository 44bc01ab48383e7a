"""Bring the data up to date for `gradline compare-updates`, the way `gradline run` does:
the ingest and shard stages through `dvc repro` (DVC skips what is up to date, and
dvc.lock records what ran). Called outside a flow run, so it streams the stages' output
to this terminal instead of a task log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from training.errors import ERROR_FILE_ENV, GradlineError


class DataStageFailed(GradlineError):
    """`dvc repro shard` failed: the stage's own error (bad data, bad config) or DVC's."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def reproduce_shards(root: Path) -> None:
    """`dvc repro shard` (ingest first if stale): data/shards as params.yaml makes it."""
    env = dict(os.environ)
    # The stages call `gradline`: find it beside this interpreter even outside the venv.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    with tempfile.TemporaryDirectory(prefix="gradline-compare-") as tmp:
        record = Path(tmp) / "error.json"
        env[ERROR_FILE_ENV] = str(record)
        proc = subprocess.run(
            [sys.executable, "-m", "dvc", "repro", "shard"],
            cwd=root,
            env=env,
            stdout=sys.stderr,  # stdout is the comparison's table
            stderr=sys.stderr,
        )
        if proc.returncode == 0:
            return
        if record.is_file():
            cause = json.loads(record.read_text())
            raise DataStageFailed(
                f"preparing the data (`dvc repro shard`) failed: {cause['message']}",
                int(cause["exit_code"]),
            )
    raise DataStageFailed(
        f"preparing the data (`dvc repro shard`) failed with exit code {proc.returncode} "
        "(see DVC's message above)",
        proc.returncode,
    )
