"""Orchestration against a real `prefect server start` on 127.0.0.1: the served cron
deployment, skip-when-unchanged, retraining on new data, the device quota, retries that
resume, failures that do not retry, lineage and the run list."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import yaml

from flows.stage_host import STAGE_HOST_ENV

from .conftest import REPO, WebhookReceiver, copy_project
from .resume_checks import Resumed, assert_resume_tags, assert_resumed, job_of_run, stopped_steps
from .servers import PrefectServer, SharedStageHost
from .servers import stop_group as _stop

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BIN = Path(sys.executable).parent
MODEL = "gradline-digits"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
# Small and quick: 1 worker, a few epochs, checkpoints often enough to resume mid-run.
SMALL = {
    "runtime.procs_per_node": 1,
    "train.epochs": 40,
    "runtime.checkpoint_every_steps": 10,
    "orchestrate.retry_delay_s": 1,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real Prefect server on 127.0.0.1 with its own database, for this module."""
    prefect = PrefectServer(tmp_path_factory.mktemp("prefect-server"))
    prefect.start()
    try:
        yield prefect.api
    finally:
        prefect.stop()


def _client(api: str):
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(api=api)


def _env(root: Path, api: str, **extra: str) -> dict[str, str]:
    """A user's environment against `api`. The stages fork from the test process's shared
    stage host (tests/servers.py), as those of conftest's runs do, unless the test follows
    every process the run starts by its GRADLINE_TEST_MARK (`_processes_marked`): such a
    run starts its own host, whose forks are the run's alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env["PATH"] = str(BIN) + os.pathsep + env["PATH"]
    env.update(
        PREFECT_HOME=str(root / ".prefect-home"),
        PREFECT_API_URL=api,
        PREFECT_RUNNER_POLL_FREQUENCY="1",
        GRADLINE_PROGRESS="plain",
    )
    if "GRADLINE_TEST_MARK" not in extra:
        env[STAGE_HOST_ENV] = SharedStageHost.socket()
    env.update(extra)
    return env


def _gradline(root: Path, api: str, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "gradline"), *args],
        cwd=root,
        env=_env(root, api, **extra),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _project(root: Path, **params) -> Path:
    from training.config import write_overrides

    copy_project(root)
    settings = {**SMALL, **params}
    write_overrides(root / "params.yaml", [f"{k}={v}" for k, v in settings.items()])
    return root


def _write_digits_csv(path: Path, rows: slice) -> None:
    """Real data as a user would drop it in: sklearn's digits, one CSV per delivery."""
    import pandas as pd
    from sklearn.datasets import load_digits

    digits = load_digits()
    frame = pd.DataFrame(digits.data[rows], columns=[f"p{i}" for i in range(64)])
    frame.insert(0, "label", digits.target[rows])
    frame.insert(0, "key", np.arange(len(digits.target))[rows])
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)


def _write_moons_csv(path: Path, rows: slice) -> None:
    """Two interleaved half-moons, one CSV per delivery: a boundary no linear model draws,
    so the MLP beats its logistic-regression baseline by a wide margin (~0.97 vs ~0.86)
    and the first delivery's model is surely champion (on digits the two tie often)."""
    import pandas as pd
    from sklearn.datasets import make_moons

    points, labels = make_moons(n_samples=1800, noise=0.2, random_state=0)
    frame = pd.DataFrame(points[rows], columns=["x", "y"])
    frame.insert(0, "label", labels[rows])
    frame.insert(0, "key", np.arange(len(labels))[rows])
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)


def _mlflow(root: Path):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{root / 'mlflow' / 'mlflow.db'}"
    return MlflowClient(tracking_uri=store, registry_uri=store)


def _wait_for_flow_run(api: str, flow_run_id, timeout: float = 400):
    deadline = time.monotonic() + timeout
    with _client(api) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(flow_run_id)
            if run.state and run.state.type.value in TERMINAL:
                return run
            time.sleep(1)
    pytest.fail(f"flow run {flow_run_id} did not finish in {timeout} s")


def _filter(api: str, what: str, body: dict) -> list[dict]:
    """POST /{what}/filter with only the fields given. (Prefect 3.8.8's client sends
    explicit nulls for the others, which its server rejects with 422 here.)"""
    request = urllib.request.Request(
        f"{api}/{what}/filter",
        data=json.dumps({"limit": 200, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _task_runs(api: str, flow_run_id, expect: tuple[str, ...]) -> dict[str, list[dict]]:
    """The flow run's task runs by name, once those in `expect` exist and every one has
    finished: the server records task-run states from events, shortly after the fact."""
    deadline = time.monotonic() + 90
    while True:
        runs = _filter(api, "task_runs", {"flow_runs": {"id": {"any_": [str(flow_run_id)]}}})
        by_name: dict[str, list[dict]] = {}
        for run in runs:
            by_name.setdefault(run["name"], []).append(run)
        settled = all((r.get("state") or {}).get("type") in TERMINAL for r in runs)
        if settled and set(expect) <= set(by_name):
            return by_name
        if time.monotonic() > deadline:
            pytest.fail(f"task runs of {flow_run_id} never settled: {sorted(by_name)}")
        time.sleep(1)


def _summary_markdown(api: str, flow_run_id) -> str:
    artifacts = _filter(
        api, "artifacts", {"artifacts": {"flow_run_id": {"any_": [str(flow_run_id)]}}}
    )
    summaries = [a for a in artifacts if a["key"] == "gradline-run-summary"]
    assert len(summaries) == 1, [(a["key"], a["type"], a["description"]) for a in artifacts]
    return summaries[0]["data"]


@pytest.fixture(scope="module")
def served(server, tmp_path_factory):
    """A CSV-fed project whose prefect.yaml deployment is served against the server."""
    csv = {"data.source": "csv", "data.key_column": "key", "data.num_classes": 2}
    # 15 epochs are enough on the half-moons: the MLP scores ~0.97 (~0.98 after 40), its
    # baseline ~0.81.
    root = _project(tmp_path_factory.mktemp("served") / "gradline", **csv, **{"train.epochs": 15})
    _write_moons_csv(root / "data" / "incoming" / "part-1.csv", slice(0, 1200))
    log = (root / "serve.log").open("w")
    proc = subprocess.Popen(
        [str(BIN / "gradline"), "serve"],
        cwd=root,
        env=_env(root, server),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield root, proc
    finally:
        _stop(proc, signal.SIGINT)  # what Ctrl-C does: serve pauses its schedule and exits
        log.close()


def _deployment(api: str, proc, timeout: float = 120):
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout
    with _client(api) as client:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "gradline serve exited"
            try:
                return client.read_deployment_by_name("gradline/nightly")
            except ObjectNotFound:
                time.sleep(1)
    pytest.fail("the deployment was not registered")


def _run_deployment(api: str, deployment_id, **parameters):
    with _client(api) as client:
        flow_run = client.create_flow_run_from_deployment(deployment_id, parameters=parameters)
    return _wait_for_flow_run(api, flow_run.id)


def test_served_deployment_retrains_only_when_something_changed(server, served) -> None:
    root, proc = served
    deployment = _deployment(server, proc)
    declared = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"][0]
    crons = [(s.schedule.cron, s.schedule.timezone) for s in deployment.schedules]
    assert crons == [(s["cron"], s["timezone"]) for s in declared["schedules"]]
    assert deployment.parameters == {"overrides": [], "force": False}

    first = _run_deployment(server, deployment.id)
    assert first.state.type.value == "COMPLETED", (root / "serve.log").read_text()[-4000:]
    mlflow = _mlflow(root)
    v1 = mlflow.get_model_version(MODEL, "1")
    assert mlflow.get_run(v1.run_id).data.tags["gradline.prefect_flow_run_id"] == str(first.id)
    markdown = _summary_markdown(server, first.id)
    assert f"/#/experiments/1/runs/{v1.run_id}" in markdown
    assert f"/#/models/{MODEL}/versions/1" in markdown
    assert "| test_accuracy |" in markdown
    snapshot = {p.name: p.read_bytes() for p in (root / "data" / "raw").iterdir()}

    second = _run_deployment(server, deployment.id)
    assert second.state.name == "Skipped"
    assert second.state.message == f"up to date with run {v1.run_id}"
    assert "train" not in _task_runs(server, second.id, ("check-up-to-date", "publish-summary"))
    assert len(mlflow.search_model_versions(f"name='{MODEL}'")) == 1

    _write_moons_csv(root / "data" / "incoming" / "part-2.csv", slice(1200, 1800))
    third = _run_deployment(server, deployment.id)
    assert third.state.type.value == "COMPLETED", (root / "serve.log").read_text()[-4000:]
    v2 = mlflow.get_model_version(MODEL, "2")
    assert v2.tags["gradline.data_version"] != v1.tags["gradline.data_version"]
    assert v2.tags["gradline.prefect_flow_run_id"] == str(third.id)
    assert v2.tags["gradline.git_commit"] == v1.tags["gradline.git_commit"]
    assert v1.tags["gradline.data_version"] in v1.description
    # The gate re-scored champion v1 on the new test split, by the evaluate stage's own
    # routine, and compared like for like: check the numbers and the verdict.
    assert v1.tags["gradline.gate"] == "champion", v1.description
    from training.mlops.serving import rescore_champion
    from training.project import Project

    store = f"sqlite:///{root / 'mlflow' / 'mlflow.db'}"
    shards, champion_uri = root / "data" / "shards", f"models:/{MODEL}/1"
    config = Project(root).config()
    rescored = rescore_champion(config, shards, champion_uri, "test_accuracy", store)
    new_score = mlflow.get_run(v2.run_id).data.metrics["test_accuracy"]
    assert f"champion v1's {rescored:.4f} on the same test data" in v2.description
    wins = new_score > rescored and new_score > float(v2.tags["baseline_test_accuracy"])
    assert v2.tags["gradline.gate"] == ("champion" if wins else "challenger")
    aliases = mlflow.get_registered_model(MODEL).aliases
    assert int(aliases["champion"]) == (2 if wins else 1)
    # The compare view lines runs up: the same param and metric names on both.
    run1, run2 = mlflow.get_run(v1.run_id), mlflow.get_run(v2.run_id)
    assert set(run1.data.params) == set(run2.data.params)
    assert {"test_accuracy", "val_loss"} <= set(run1.data.metrics) & set(run2.data.metrics)
    artifacts = {a.path for a in mlflow.list_artifacts(v2.run_id, "evaluation")}
    assert artifacts == {
        "evaluation/confusion_matrix.png",
        "evaluation/details.json",  # the model card's intervals (tests/test_model_card.py)
        "evaluation/loss_curves.png",
    }

    # Lineage of the first version names its data version, and DVC checks it out again
    # although data/raw has moved on.
    proc_lineage = _gradline(root, server, "lineage", f"{MODEL}/1")
    assert proc_lineage.returncode == 0, proc_lineage.stderr
    out = proc_lineage.stdout
    assert f"data version {v1.tags['gradline.data_version']}" in out
    assert v1.tags["gradline.git_commit"] in out and str(first.id) in out
    assert f"runs/flow-run/{first.id}" in out
    assert "train.epochs" in out and "test_accuracy" in out
    restored = _gradline(root, server, "lineage", f"{MODEL}/1", "--restore-data", "data/v1")
    assert restored.returncode == 0, restored.stderr
    assert {p.name: p.read_bytes() for p in (root / "data" / "v1").iterdir()} == snapshot

    listing = _gradline(root, server, "runs")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert "baseline" in lines[0] and "test_accuracy" in lines[1]  # the task's gate metric
    assert lines[1].split()[2] == v2.run_id[:12] and "v2" in lines[1]
    assert lines[2].split()[2] == v1.run_id[:12] and "v1" in lines[2]


def test_deployment_with_bad_overrides_fails_without_retry(server, served) -> None:
    _, proc = served
    deployment = _deployment(server, proc)
    failed = _run_deployment(server, deployment.id, overrides=["optim.lr=fast"])
    assert failed.state.type.value == "FAILED"
    assert "optim.lr" in failed.state.message
    tasks = _task_runs(server, failed.id, ("apply-params",))
    assert [t["run_count"] for t in tasks["apply-params"]] == [1]
    assert "ingest" not in tasks and "train" not in tasks
    assert "optim.lr" in _summary_markdown(server, failed.id)


def test_bad_data_fails_at_once_with_the_cause(server, tmp_path) -> None:
    root = _project(
        tmp_path / "gradline",
        **{"data.source": "csv", "data.key_column": "key", "data.num_classes": 5},
    )
    _write_digits_csv(root / "data" / "incoming" / "part-1.csv", slice(0, 300))
    with WebhookReceiver() as hook:  # the team's alert channel
        proc = _gradline(
            root, server, "run", "--set", "orchestrate.notify=env:TEAM_WEBHOOK",
            TEAM_WEBHOOK=hook.url,
        )  # fmt: skip
    assert proc.returncode != 0
    assert "label" in proc.stderr
    (alert,) = hook.bodies  # one alert for one failed run
    assert alert["text"].startswith(":x: gradline run failed in `ingest`")
    details = alert["blocks"][1]["text"]["text"]
    assert "DataError" in details and "flow-run/" in details
    flow_run_id = next(
        line.split("flow-run/")[1].split()[0]
        for line in (proc.stdout + proc.stderr).splitlines()
        if "flow-run/" in line
    )
    ingest = _task_runs(server, flow_run_id, ("ingest",))["ingest"]
    assert [t["run_count"] for t in ingest] == [1]  # stage retries are for crashes only
    assert ingest[0]["state"]["type"] == "FAILED"
    assert "DataError" in _summary_markdown(server, flow_run_id)


def test_a_run_waiting_for_taken_slots_gives_up_naming_the_quota(server, tmp_path) -> None:
    # Every slot taken (by a run elsewhere, or leaked by one that was killed): the run
    # says what it waits for and gives up after orchestrate.quota_wait_s.
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    limit = "gradline-taken-devices"
    with _client(server) as client:
        client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name=limit, limit=1, active_slots=1)
        )
    root = _project(
        tmp_path / "gradline",
        **{"orchestrate.device_limit": limit, "orchestrate.quota_wait_s": 3, "data.max_rows": 300},
    )
    proc = _gradline(root, server, "run")
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "waiting for 1 of 1 slots of device quota 'gradline-taken-devices'" in output
    assert "waited 3 s for 1 of the 1 slots of device quota 'gradline-taken-devices'" in output
    assert "--active-slots 0" in output
    assert not (root / "model").exists()  # it never trained


@pytest.fixture(scope="module")
def quota_projects(server, tmp_path_factory):
    """Two projects whose flows start together under a device quota of one slot."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    limit = "gradline-test-devices"
    with _client(server) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=limit, limit=1))
    base = tmp_path_factory.mktemp("quota")
    roots = [
        _project(base / name, **{"orchestrate.device_limit": limit, "data.max_rows": 600})
        for name in ("a", "b")
    ]
    # Training slowed down so that the two flows surely want the device at the same time.
    slow = {"GRADLINE_FAULT": "slow:rank=0:step=0:seconds=0.1"}
    procs = [
        subprocess.Popen(
            [str(BIN / "gradline"), "run"],
            cwd=root,
            env=_env(root, server, **slow),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for root in roots
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-4000:]
    # Read now: later tests run these projects again (result.json then names their runs).
    return QuotaPair(
        roots,
        trains=[_train_task_run(server, root) for root in roots],
        shards=[_train_task_run(server, root, "shard") for root in roots],
    )


@dataclass
class QuotaPair:
    """The two projects, with the train and shard task runs of their concurrent flows."""

    roots: list[Path]
    trains: list[dict]
    shards: list[dict]

    def __getitem__(self, index: int) -> Path:
        return self.roots[index]


def _train_task_run(api: str, root: Path, name: str = "train"):
    run_id = json.loads((root / "result.json").read_text())["run_id"]
    flow_run_id = _mlflow(root).get_run(run_id).data.tags["gradline.prefect_flow_run_id"]
    (task_run,) = _task_runs(api, flow_run_id, (name, "publish-summary"))[name]
    return task_run


def test_flows_sharing_one_device_train_one_after_the_other(server, quota_projects) -> None:
    trains, shards = quota_projects.trains, quota_projects.shards
    first, second = sorted(range(2), key=lambda i: trains[i]["start_time"])
    at = datetime.fromisoformat
    # The second flow was ready to train (its shard stage done) while the first trained,
    # and it started training only when the first had released the device: it waited.
    assert at(shards[second]["end_time"]) < at(trains[first]["end_time"])
    assert at(trains[first]["end_time"]) <= at(trains[second]["start_time"])

    # A job that needs more devices than the quota has fails at once, saying so.
    root = quota_projects[0]
    params = (root / "params.yaml").read_text()
    proc = _gradline(root, server, "run", "--set", "runtime.procs_per_node=2")
    assert proc.returncode == 2
    assert "raise the limit" in proc.stderr and "gradline-test-devices" in proc.stderr
    assert (root / "params.yaml").read_text() == params  # refused before anything was written


def test_retried_training_continues_the_same_run(server, quota_projects) -> None:
    root = quota_projects[1]
    proc = _gradline(
        root,
        server,
        "run",
        "--force",
        *("--set", "runtime.max_restarts=0"),
        # Checkpoints written in the loop: the step-10 one is surely whole at step 15.
        *("--set", "runtime.async_checkpoint=false"),
        # Only the every-10-steps cadence writes checkpoints (select=best also saves each
        # new best validation, which would move the resume point off step 10).
        *("--set", "train.select=last"),
        GRADLINE_FAULT="fail:rank=0:step=15:once=1",
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    train = _train_task_run(server, root)
    assert train["run_count"] == 2  # failed once, retried once
    run_id = json.loads((root / "result.json").read_text())["run_id"]
    assert f"MLflow run {run_id} (resumed)" in proc.stdout + proc.stderr
    # Failed at step 15: the retry continued from the step-10 checkpoint, not step 0.
    resumed = [Resumed(10, written_by=1, resumed_by=1)]
    assert_resumed(job_of_run(root / "checkpoints", run_id), *resumed)
    assert_resume_tags(_mlflow(root), run_id, resumed)
    history = _mlflow(root).get_metric_history(run_id, "train_loss")
    steps = sorted(m.step for m in history)
    assert steps == list(range(1, steps[-1] + 1))  # one value per step, no gap
    job_runs = _mlflow(root).search_runs(
        [_mlflow(root).get_run(run_id).info.experiment_id],
        filter_string=f"tags.`gradline.prefect_flow_run_id` = '{train['flow_run_id']}'",
    )
    assert [r.info.run_id for r in job_runs] == [run_id]


def test_preemptions_spend_their_own_retry_budget(server, quota_projects) -> None:
    # Three spot reclaims in one night with no crash retries left: the preemption budget
    # (not stage_retries) carries the run through, resuming each time where it stopped.
    root = quota_projects[1]
    notices = ";".join(f"term:rank=0:step={step}:once=1" for step in (5, 15, 25))
    proc = _gradline(
        root,
        server,
        "run",
        "--force",
        *("--set", "orchestrate.stage_retries=0", "--set", "orchestrate.preemption_retries=3"),
        *("--set", "orchestrate.retry_delay_s=0"),
        # Stop requests are read every step: each notice ends its own launch.
        *("--set", "runtime.control_every_steps=1"),
        GRADLINE_FAULT=notices,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert _train_task_run(server, root)["run_count"] == 4  # preempted 3 times, then done
    run_id = json.loads((root / "result.json").read_text())["run_id"]
    assert f"MLflow run {run_id} (resumed)" in proc.stdout + proc.stderr
    # Each of the three runs after a notice resumed from the checkpoint of its stop (a
    # stop may be reported by the stage and again by the flow: one step each).
    stops = sorted(set(stopped_steps(proc.stdout + proc.stderr)))
    assert len(stops) == 3, stops
    resumed = [Resumed(step, written_by=1, resumed_by=1) for step in stops]
    assert_resumed(job_of_run(root / "checkpoints", run_id), *resumed)
    assert_resume_tags(_mlflow(root), run_id, resumed)
    steps = sorted(m.step for m in _mlflow(root).get_metric_history(run_id, "train_loss"))
    assert steps == list(range(1, steps[-1] + 1))  # one value per step, no gap


def _processes_marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark`: everything a command started,
    orphans included."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"GRADLINE_TEST_MARK={mark}".encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


@pytest.mark.parametrize("how", ["ctrl-c to the terminal's group", "SIGTERM to gradline"])
def test_a_signal_stops_the_whole_tree_and_the_next_run_resumes(server, tmp_path, how) -> None:
    root = _project(tmp_path / "gradline", **{"data.max_rows": 600})
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    slow = "slow:rank=0:step=0:seconds=0.2"  # training long enough to be stopped midway
    log = (tmp_path / "run.log").open("w")
    proc = subprocess.Popen(
        [str(BIN / "gradline"), "run"],
        cwd=root,
        env=_env(root, server, GRADLINE_FAULT=slow, GRADLINE_TEST_MARK=mark),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal gives a command
    )
    first = root / "checkpoints"
    deadline = time.monotonic() + 300
    while not list(first.glob("*/step-*[0-9]")):  # training is under way
        assert proc.poll() is None and time.monotonic() < deadline, (
            tmp_path / "run.log"
        ).read_text()
        time.sleep(0.5)
    stopped_at = time.monotonic()
    if how.startswith("ctrl-c"):
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=200)
    took = time.monotonic() - stopped_at
    print(f"{how}: the whole tree stopped in {took:.1f} s")
    output = (tmp_path / "run.log").read_text()
    assert code == 128 + (signal.SIGINT if how.startswith("ctrl-c") else signal.SIGTERM), output
    assert took < 120, output
    assert _processes_marked(mark) == [], output  # nothing it started is left
    assert "stopped on request at step" in output  # training checkpointed first
    stopped_step = int(output.split("stopped on request at step ")[1].split(";")[0])
    flow_run_id = output.split("flow-run/")[1].split()[0]
    (flow_run,) = _filter(server, "flow_runs", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    assert flow_run["state"]["type"] == "CANCELLED", flow_run["state"]
    if how.startswith("ctrl-c"):
        return
    done = _gradline(root, server, "run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"at step {stopped_step}" in done.stdout + done.stderr  # resumed where it stopped
    run_id = json.loads((root / "result.json").read_text())["run_id"]
    job = job_of_run(root / "checkpoints", run_id)
    assert_resumed(job, Resumed(stopped_step, written_by=1, resumed_by=1))
