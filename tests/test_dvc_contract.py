"""dvc.yaml and the code agree: every computing parameter is a stage dependency, and
every stage reads and writes the paths the code's project layout names."""

from __future__ import annotations

import yaml

from training.config import UNTRACKED_SECTIONS, Config
from training.paths import ProjectPaths

from .conftest import REPO

DVC = yaml.safe_load((REPO / "dvc.yaml").read_text())


def test_every_tracked_parameter_is_a_stage_dependency() -> None:
    declared = {p for stage in DVC["stages"].values() for p in stage.get("params", [])}
    expected = {key for key in Config().flat() if key.split(".")[0] not in UNTRACKED_SECTIONS}
    assert declared == expected


def test_stage_paths_match_project_layout() -> None:
    paths = ProjectPaths(REPO)
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


def test_stage_code_is_a_dependency() -> None:
    # A change to a stage's own code must make that stage stale.
    for stage in DVC["stages"].values():
        for dep in stage["deps"]:
            if dep.endswith(".py"):
                assert (REPO / dep).is_file(), dep
