"""dvc.yaml and the code agree: every computing parameter is a stage dependency and no
run-only one is, every stage reads and writes the paths the code's project layout names,
and a change to a stage's code makes that stage (and only what depends on it) stale."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.config import OPEN_SECTIONS, Config, is_tracked
from training.project import Project

from .conftest import REPO, copy_project

DVC = yaml.safe_load((REPO / "dvc.yaml").read_text())


def _declared() -> set[str]:
    return {p for stage in DVC["stages"].values() for p in stage.get("params", [])}


def test_every_computing_parameter_is_a_stage_dependency() -> None:
    declared = _declared()
    for key in Config().flat():
        section = key.split(".")[0]
        if not is_tracked(key):
            assert key not in declared and section not in declared, key
        elif section in OPEN_SECTIONS:  # keys vary by model: the section is the dep
            assert section in declared, section
        else:
            assert key in declared, key
    known = set(Config().flat()) | OPEN_SECTIONS
    assert declared <= known, declared - known


def test_stage_paths_match_project_layout() -> None:
    paths = Project(REPO)
    rel = {
        name: str(getattr(paths, name).relative_to(REPO))
        for name in ("raw", "shards", "model", "checkpoints", "train_result", "metrics", "plots")
    }
    stages = DVC["stages"]
    assert f"--out {rel['raw']}" in stages["ingest"]["cmd"]
    assert rel["raw"] in stages["shard"]["deps"]
    assert f"--out {rel['shards']}" in stages["shard"]["cmd"]
    train_cmd = stages["train"]["cmd"]
    for flag, key in [("--model", "model"), ("--checkpoints", "checkpoints")]:
        assert f"{flag} {rel[key]}" in train_cmd
    assert f"--result {rel['train_result']}" in train_cmd
    evaluate_cmd = stages["evaluate"]["cmd"]
    assert f"--metrics {rel['metrics']}" in evaluate_cmd
    assert f"--plots {rel['plots']}" in evaluate_cmd


def test_every_code_dependency_exists() -> None:
    for stage in DVC["stages"].values():
        for dep in stage["deps"]:
            if dep.startswith("training"):
                assert (REPO / dep).exists(), dep


def _dvc(root: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def locked(tmp_path_factory) -> Path:
    """A copy of the project whose dvc.lock records every stage as done (outputs are
    placeholders: `dvc commit` hashes deps and outs without running anything)."""
    root = copy_project(tmp_path_factory.mktemp("locked") / "gradline")
    for folder in ("data/raw", "data/quarantine", "data/shards", "model", "plots"):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "placeholder").write_text(folder)
    for file in ("data/ingest.json", "result.json", "metrics.json"):
        (root / file).write_text("{}")
    _dvc(root, "commit", "--force", "--quiet")
    assert json.loads(_dvc(root, "status", "--json") or "{}") == {}
    return root


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("module", "stale"),
    [
        ("training/data/validate.py", {"ingest", "shard", "train", "evaluate"}),
        ("training/data/text.py", {"ingest", "shard", "train", "evaluate"}),
        ("training/data/tokens.py", {"shard", "train", "evaluate"}),
        ("training/models/mlp.py", {"train", "evaluate"}),
        ("training/engine/loop.py", {"train", "evaluate"}),
        ("training/objectives.py", {"train", "evaluate"}),
        ("training/evaluate.py", {"evaluate"}),
        # Code that only reports or runs the job computes nothing: changing it never retrains.
        ("training/engine/intervals.py", set()),
        ("training/engine/launch.py", set()),
        ("training/tracking.py", set()),
        ("training/progress.py", set()),
    ],
)
def test_a_change_to_code_makes_exactly_its_stages_stale(locked: Path, module, stale) -> None:
    path = locked / module
    original = path.read_text()
    path.write_text(original + "\n# an edit\n")
    try:
        changed = json.loads(_dvc(locked, "status", "--json") or "{}")
    finally:
        path.write_text(original)
    # `dvc status` lists the stages whose own deps changed; what runs is those and every
    # stage after the first of them.
    assert _with_downstream(set(changed)) == stale, changed


def _with_downstream(stages: set[str]) -> set[str]:
    order = ["ingest", "shard", "train", "evaluate"]
    if not stages:
        return set()
    return set(order[min(order.index(s) for s in stages) :])
