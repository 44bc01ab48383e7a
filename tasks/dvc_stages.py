"""Tasks that drive DVC: each stage runs through `dvc repro`, so dvc.lock records it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prefect import task
from prefect.runtime import flow_run

from training.errors import GradlineError
from training.tracking import FLOW_RUN_ENV
from training.versioning import data_version


class StageFailed(GradlineError):
    pass


def _dvc(root: Path, *args: str) -> str:
    env = dict(os.environ)
    # Stage commands call `gradline`: find it beside this interpreter even if the
    # virtual environment is not activated.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if flow_run.id:
        env[FLOW_RUN_ENV] = str(flow_run.id)
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise StageFailed(f"`dvc {' '.join(args)}` failed ({proc.returncode}):\n{output[-4000:]}")
    return output


@task(name="dvc-repro")
def reproduce_stage(root: str, stage: str) -> bool:
    """Run one stage if DVC finds it stale; True when it ran."""
    output = _dvc(Path(root), "repro", "--single-item", stage)
    # Keep the stage's own output; drop DVC's git hints, which the flow acts on itself.
    hints = ("git add", "To track the changes", "To enable auto staging", "autostage", "dvc push")
    print("\n".join(line for line in output.splitlines() if not any(h in line for h in hints)))
    return "didn't change, skipping" not in output


@task(name="dvc-push-data", retries=2, retry_delay_seconds=2)
def push_data(root: str) -> str:
    """Push the ingested snapshot to the DVC remote; return its data version (md5)."""
    _dvc(Path(root), "push", "ingest")
    return data_version(Path(root))
