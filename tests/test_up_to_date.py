"""Whether the last run is up to date (training.mlops.summary.up_to_date_run): the flow
asks DVC first and imports MLflow only when nothing changed; the CLI reads MLflow while
its `dvc status` runs in the background."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import REPO

_CHECK = """
import json, sys
from pathlib import Path
from training.mlops.summary import up_to_date_run
from training.project import Project
root, first = Path(sys.argv[1]), sys.argv[2] == "changes-first"
said, order = [], []
def stale(_root):
    order.append("dvc" if "mlflow" not in sys.modules else "dvc after mlflow")
    return {"train": ["changed deps"]}
latest = up_to_date_run(root, Project(root).config(), stale, said.append, changes_first=first)
mlflow = "mlflow" in sys.modules
print(json.dumps({"latest": latest, "said": said, "order": order, "mlflow": mlflow}))
"""


def _check(root: Path, mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, str(root), mode],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_changed_project_is_found_stale_before_mlflow_is_imported(tmp_path) -> None:
    root = tmp_path / "project"
    root.mkdir()
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(REPO / name, root / name)
    (root / "result.json").write_text(json.dumps({"run_id": "0" * 32}))  # an earlier run
    flow = _check(root, "changes-first")
    assert flow == {
        "latest": None,
        "said": ["changed since the last run: train"],
        "order": ["dvc"],
        "mlflow": False,
    }, flow
    cli = _check(root, "mlflow-first")  # the same answer, MLflow read meanwhile
    assert cli["latest"] is None and cli["said"] == flow["said"], cli
    assert cli["order"] == ["dvc after mlflow"] and cli["mlflow"], cli
