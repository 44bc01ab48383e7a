"""dvc.yaml and the code agree: each stage's params are exactly the keys JobSpec says it
reads (and no run-only key is one), every stage reads and writes the paths the code's
project layout names, and a change to a stage's code makes that stage (and only what
depends on it) stale."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.config import Config, jobspec
from training.project import Project

from .conftest import REPO, copy_project

DVC = yaml.safe_load((REPO / "dvc.yaml").read_text())


@pytest.mark.parametrize("stage", jobspec.STAGES)
def test_each_stage_lists_exactly_the_params_jobspec_gives_it(stage) -> None:
    assert DVC["stages"][stage].get("params", []) == jobspec.stage_params(stage)


def test_run_only_keys_are_no_stage_params_and_every_key_has_one_use() -> None:
    declared = {p for stage in DVC["stages"].values() for p in stage.get("params", [])}
    for key in Config().flat():
        use = jobspec.use(key)  # raises KeyError for a section JobSpec does not know
        section = key.split(".")[0]
        if not use.stages:
            assert key not in declared and section not in declared, key
        if use.in_job_key or use.decides_data:
            assert use.mlflow == "param", key


def test_the_job_key_holds_what_computes_the_model_and_nothing_about_how_it_runs() -> None:
    base = Config()
    key = jobspec.job_key(base, "md5")
    computes = [
        "optim.lr=0.01",
        "update.rule=local_sgd",
        "shard.val_fraction=0.2",
        "task.type=regression",
    ]
    runs = [
        "runtime.procs_per_node=4",
        "parallel.dp_shard=2",
        "evaluate.top_k=5",
        "registry.model_name=x",
    ]
    for change in computes + runs:
        section, _, rest = change.partition(".")
        name, _, value = rest.partition("=")
        values = base.model_dump()
        values[section][name] = yaml.safe_load(value)
        if section == "task":  # the task must fit the data
            values["data"]["source"] = "diabetes"
        changed = jobspec.job_key(Config.model_validate(values), "md5")
        assert (changed != key) == (change in computes), change
    assert jobspec.job_key(base, "other-md5") != key


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
    for file in ("data/ingest.json", "data/profile.json", "result.json", "metrics.json"):
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
        ("training/data/profile.py", {"ingest", "shard", "train", "evaluate"}),
        ("training/models/mlp.py", {"train", "evaluate"}),
        ("training/engine/loop.py", {"train", "evaluate"}),
        ("training/objectives/classification.py", {"train", "evaluate"}),
        ("training/engine/layouts.py", {"train", "evaluate"}),
        ("training/evaluation.py", {"evaluate"}),
        # Code that only reports or runs the job computes nothing: changing it never retrains.
        ("training/engine/intervals.py", set()),
        ("training/engine/launch.py", set()),
        ("training/mlops/tracking.py", set()),
        ("training/mlops/jobs.py", set()),
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


@pytest.mark.timeout(120)
def test_python_s_bytecode_caches_in_code_dependencies_change_nothing(locked: Path) -> None:
    """Importing the code writes __pycache__ folders into training/ (unless the
    environment forbids it): a stage whose deps are folders of code must stay up to date."""
    written = []
    for folder in ("training/models", "training/objectives", "training/data"):
        cache = locked / folder / "__pycache__"
        cache.mkdir(exist_ok=True)
        (cache / "mlp.cpython-311.pyc").write_bytes(b"bytecode")
        (locked / folder / "stray.pyc").write_bytes(b"bytecode")
        written += [cache, locked / folder / "stray.pyc"]
    try:
        assert json.loads(_dvc(locked, "status", "--json") or "{}") == {}
    finally:
        for path in written:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _with_downstream(stages: set[str]) -> set[str]:
    order = ["ingest", "shard", "train", "evaluate"]
    if not stages:
        return set()
    return set(order[min(order.index(s) for s in stages) :])
