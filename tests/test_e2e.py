"""End to end, as a user runs it: the real `gradline` CLI in a fresh copy of the project,
with the ephemeral Prefect API, DVC and the SQLite MLflow store; then `dvc repro`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import copy_project

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SMALL = ["--set", "data.max_rows=500", "--set", "train.epochs=8"]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return copy_project(tmp_path_factory.mktemp("clone") / "gradline")


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    env["PREFECT_HOME"] = str(root / ".prefect-home")
    return env


def _run(root: Path, *cmd: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=root, env=_env(root), capture_output=True, text=True, timeout=timeout
    )


def _gradline(root: Path, *args: str) -> subprocess.CompletedProcess:
    return _run(root, str(Path(sys.executable).parent / "gradline"), *args)


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    proc = _run(root, sys.executable, "-m", "dvc", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _client(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{root / 'mlflow' / 'mlflow.db'}")


def test_bad_params_fail_naming_the_key_and_write_nothing(project: Path) -> None:
    params = project / "params.yaml"
    original = params.read_text()
    params.write_text(original.replace("  epochs: 30", "  epochs: 30\n  epoch: 3"))
    try:
        proc = _gradline(project, "run")
        assert proc.returncode != 0
        assert "train.epoch: unknown key" in proc.stderr
        proc = _gradline(project, "run", "--set", "train.lr=fast")
    finally:
        params.write_text(original)
    assert proc.returncode != 0 and "train.lr" in proc.stderr
    for output in ("data/raw", "data/shards", "checkpoints", "model", "mlflow/mlflow.db"):
        assert not (project / output).exists(), output
    assert params.read_text() == original


def test_run_trains_evaluates_and_registers(project: Path) -> None:
    proc = _gradline(project, "run", *SMALL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gradline run complete" in proc.stdout and "gradline ui" in proc.stdout

    params = yaml.safe_load((project / "params.yaml").read_text())
    assert params["data"]["max_rows"] == 500 and params["train"]["epochs"] == 8

    client = _client(project)
    champion = client.get_model_version_by_alias("gradline-digits", "champion")
    assert int(champion.version) == 1
    run = client.get_run(champion.run_id)
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    raw_md5 = next(o["md5"] for o in lock["stages"]["ingest"]["outs"] if o["path"] == "data/raw")
    assert run.data.tags["gradline.data_version"] == raw_md5
    assert run.data.tags["gradline.prefect_flow_run_id"]
    assert len(run.data.tags["mlflow.source.git.commit"]) == 40
    assert run.data.params["train.epochs"] == "8"
    (dataset,) = [d.dataset for d in run.inputs.dataset_inputs]
    assert dataset.digest == raw_md5 and dataset.name == "digits-raw"
    assert json.loads(dataset.source)["uri"].endswith("/data/raw")
    assert run.data.metrics["test_accuracy"] > 0.8
    for key in ("test_macro_f1", "test_loss", "val_accuracy", "samples_per_s"):
        assert key in run.data.metrics
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert steps == sorted(set(steps)) and len(steps) > 10
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert artifacts, "no checkpoint recorded on the run"
    assert {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")} == {
        "evaluation/confusion_matrix.png",
        "evaluation/loss_curves.png",
    }
    # The data version was pushed to the DVC remote.
    assert any((project / ".dvcstore").rglob("*"))


def test_dvc_agrees_with_the_flow(project: Path) -> None:
    assert "up to date" in _dvc(project, "status").stdout
    assert "Running stage" not in _dvc(project, "repro").stdout

    params = project / "params.yaml"
    params.write_text(params.read_text().replace("lr: 0.003", "lr: 0.002"))
    out = _dvc(project, "repro").stdout
    ran = {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}
    assert ran == {"train", "evaluate"}


def test_second_run_adds_a_version_and_gates_the_champion(project: Path) -> None:
    proc = _gradline(project, "run", "--set", "train.seed=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = _client(project)
    versions = {
        int(v.version): client.get_run(v.run_id).data.metrics["test_accuracy"]
        for v in client.search_model_versions("name='gradline-digits'")
    }
    assert set(versions) == {1, 2}
    champion = int(client.get_model_version_by_alias("gradline-digits", "champion").version)
    expected = 2 if versions[2] > versions[1] else 1
    assert champion == expected
    if expected == 1:
        challenger = client.get_model_version_by_alias("gradline-digits", "challenger")
        assert int(challenger.version) == 2
    assert "up to date" in _dvc(project, "status").stdout
