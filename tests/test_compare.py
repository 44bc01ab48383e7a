"""`gradline compare-updates`: bad input named by its flag before anything runs; the
table's arithmetic; and, end to end, one parent MLflow run whose children are real
training runs of each rule, with the table and the three plots on the parent."""

from __future__ import annotations

import csv
import io
import math
import multiprocessing.forkserver as forkserver
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.config import update_params_file
from training.errors import ConfigError
from training.mlops.compare import parse_rules, plan_comparison
from training.mlops.compare_report import COLUMNS, ChildRun, curves, table_rows

from .conftest import REPO, assert_drawn, copy_project


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ("sync,fedavg", r"--rules: unknown update rule 'fedavg'; choose from sync, local_sgd"),
        ("sync,sync", r"--rules: a rule is named twice"),
        (",", r"--rules: name at least one rule"),
    ],
)
def test_bad_rules_are_named(rules: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_rules(rules)


@pytest.mark.parametrize(
    ("slow_rank", "slow_factor", "overrides", "message"),
    [
        (2, 2.0, [], r"--slow-rank 2: ranks are 0\.\.1 \(runtime\.procs_per_node=2"),
        (-1, 2.0, [], r"--slow-rank -1: ranks are 0\.\.1"),
        (1, 1.0, [], r"--slow-factor 1: must be above 1"),
        (1, 0.5, [], r"--slow-factor 0\.5: must be above 1"),
        (None, 3.0, [], r"--slow-factor needs --slow-rank"),
        (None, None, ["data.max_rows=10"], r"--set data\.max_rows=10: .*ingest/shard"),
        (None, None, ["shard.val_fraction=0.2"], r"--set shard\.val_fraction=0\.2"),
        (None, None, ["update.rule=async"], r"--set update\.rule=async: .*--rules"),
        (None, None, ["task.type=regression"], r"--set task\.type=regression: .*ingest/shard"),
        (None, None, ["optim.lr=fast"], r"optim\.lr"),
    ],
)
def test_bad_flags_fail_before_anything_runs(slow_rank, slow_factor, overrides, message) -> None:
    """Planning only reads params.yaml: the repository itself serves."""
    with pytest.raises(ConfigError, match=message):
        plan_comparison(REPO, ("sync", "local_sgd"), overrides, slow_rank, slow_factor)


def test_a_rule_that_cannot_combine_with_the_config_names_the_rule() -> None:
    with pytest.raises(ConfigError, match=r"(?s)--rules local_sgd: .*grad_compression"):
        plan_comparison(REPO, ("sync", "local_sgd"), ["update.grad_compression=fp16"])


def test_the_plan_sets_each_rule_and_the_slow_rank_fault(monkeypatch) -> None:
    monkeypatch.delenv("GRADLINE_FAULT", raising=False)
    plan = plan_comparison(REPO, ("local_sgd", "sync"), ["train.max_steps=5"], 1, 3.0)
    assert {rule: cfg.update.rule for rule, cfg in plan.children.items()} == {
        "local_sgd": "local_sgd",
        "sync": "sync",
    }
    assert plan.reference == "sync" and plan.children["sync"].train.max_steps == 5
    assert plan.fault == "slow:rank=1:step=0:factor=3"
    monkeypatch.setenv("GRADLINE_FAULT", "hiccup:rank=-1:prob=0.02:factor=10")
    plan = plan_comparison(REPO, ("diloco", "async"), [])
    assert plan.reference == "diloco"  # no sync: the first rule named
    assert plan.fault == "hiccup:rank=-1:prob=0.02:factor=10"  # passed on to the children


def _child(rule: str, **result) -> ChildRun:
    return ChildRun(rule, f"run-{rule}", 32, {"step": 100, **result}, wall_seconds=9.0)


def test_table_rows_are_relative_to_the_reference_rule() -> None:
    sync = _child(
        "sync", loop_seconds=2.0, loop_steps=100, val_loss=1.0, comm_bytes_per_step=1000.0
    )
    local = _child(
        "local_sgd", loop_seconds=1.0, loop_steps=100, val_loss=1.1, comm_bytes_per_step=125.0
    )
    rows = {r["rule"]: r for r in table_rows([sync, local], "sync")}
    assert rows["sync"]["samples_per_s"] == pytest.approx(1600.0)
    assert rows["local_sgd"]["throughput_ratio"] == pytest.approx(2.0)
    assert rows["local_sgd"]["val_loss_delta"] == pytest.approx(0.1)
    assert rows["local_sgd"]["bytes_ratio"] == pytest.approx(0.125)
    assert rows["sync"]["train_seconds"] == 2.0  # loop seconds when train_seconds is absent
    missing = table_rows([_child("sync", loop_seconds=1.0, loop_steps=10)], "sync")[0]
    assert math.isnan(missing["val_loss"]) and math.isnan(missing["bytes_ratio"])


def test_curves_read_cumulative_quantities_at_the_validation_steps() -> None:
    child = _child("sync")
    child.history = {
        "val_loss": [(10, 2.0), (20, 1.0)],
        "train_seconds": [(5, 1.0), (20, 4.0)],
        "comm_bytes_total": [(20, 2000.0)],
    }
    lines = curves(child)
    assert lines["samples"] == ([320.0, 640.0], [2.0, 1.0])
    assert lines["seconds"][0] == pytest.approx([2.0, 4.0])
    assert lines["bytes"][0] == pytest.approx([1000.0, 2000.0])
    # Without train_seconds: each interval's steps x batch / samples_per_s.
    child.history = {"val_loss": [(10, 2.0)], "samples_per_s": [(10, 320.0)]}
    assert curves(child)["seconds"][0] == pytest.approx([1.0])
    assert "bytes" not in curves(child)


# --- end to end -----------------------------------------------------------------------


def _gradline(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env.pop("GRADLINE_FAULT", None)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    return subprocess.run(
        [str(Path(sys.executable).parent / "gradline"), *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )


TINY = (
    "train.max_steps=12",
    "runtime.log_every_steps=4",
    "runtime.eval_every_steps=4",
    "runtime.checkpoint_every_steps=1000",
    "runtime.max_restarts=0",
    "runtime.collective_timeout_s=60",
)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_compare_updates_trains_children_under_one_parent(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from flows.cli import main
    from flows.environment import OFFLINE_DEFAULTS
    from flows.supervise import SUPERVISED_ENV

    project = copy_project(tmp_path / "gradline")
    update_params_file(project / "params.yaml", {"data": {"max_rows": 300}})
    params_before = (project / "params.yaml").read_text()
    # Bad input through the CLI (in this process: the refusal comes before any work).
    for key, value in OFFLINE_DEFAULTS.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    monkeypatch.chdir(project)
    monkeypatch.setenv(SUPERVISED_ENV, "1")  # the command itself, not its supervisor
    server_before = forkserver._forkserver._forkserver_pid
    assert main(["compare-updates", "--rules", "sync", "--slow-rank", "2"]) == 2
    assert "gradline: error: --slow-rank 2: ranks are 0..1" in capsys.readouterr().err
    assert not (project / "data" / "shards").exists()  # refused before the data stages
    # Nor a workers' server started: here it would be a fork of this test process.
    assert forkserver._forkserver._forkserver_pid == server_before
    monkeypatch.delenv(SUPERVISED_ENV)  # the real command next: under its supervisor

    sets = [f"--set={o}" for o in TINY]
    args = ["--rules", "sync,local_sgd", "--slow-rank", "1", "--slow-factor", "2", *sets]
    proc = _gradline(project, "compare-updates", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gradline compare-updates complete" in proc.stdout
    assert "local_sgd" in proc.stdout and "http://127.0.0.1:5000/#/experiments/" in proc.stdout

    store = f"sqlite:///{project / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    experiment = client.get_experiment_by_name("gradline")
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.run_id in proc.stdout and parent.info.status == "FINISHED"
    assert parent.data.params["compare.GRADLINE_FAULT"] == "slow:rank=1:step=0:factor=2"
    assert parent.data.params["compare.rules"] == "sync,local_sgd"
    children = {r.data.tags["gradline.compare.rule"]: r for r in runs if r is not parent}
    assert set(children) == {"sync", "local_sgd"}
    for rule, child in children.items():
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.params["update.rule"] == rule
        assert child.data.params["train.max_steps"] == "12"
        assert child.data.tags["gradline.compare.fault"] == "slow:rank=1:step=0:factor=2"
        assert child.info.status == "FINISHED"
        assert "val_loss" in child.data.metrics
    assert len({c.data.tags["gradline.job_key"] for c in children.values()}) == 2

    for name in ("val_loss_vs_seconds.png", "val_loss_vs_samples.png", "val_loss_vs_bytes.png"):
        assert_drawn(
            Path(client.download_artifacts(parent.info.run_id, f"compare/{name}", str(tmp_path)))
        )
    table = client.download_artifacts(parent.info.run_id, "compare/updates.csv", str(tmp_path))
    rows = list(csv.DictReader(io.StringIO(Path(table).read_text())))
    assert [row["rule"] for row in rows] == ["sync", "local_sgd"]
    for row in rows:
        for key in set(COLUMNS) - {"rule", "steps", "run_id"}:
            assert math.isfinite(float(row[key])), (row["rule"], key, row[key])
        assert row["run_id"] == children[row["rule"]].info.run_id
    # Each rule's throughput against the first rule's, from the rows' own figures.
    sync, local = (float(row["samples_per_s"]) for row in rows)
    assert float(rows[1]["throughput_ratio"]) == pytest.approx(local / sync, rel=1e-3)

    # The pipeline's own outputs are untouched; params.yaml keeps no override.
    assert (project / "params.yaml").read_text() == params_before
    for output in ("model", "result.json", "metrics.json"):
        assert not (project / output).exists(), output
    assert not client.search_registered_models()
