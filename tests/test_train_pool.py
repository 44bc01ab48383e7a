"""The train stage on a Prefect work pool while the flow runs elsewhere: two checkouts
sharing only a DVC remote folder, the MLflow store and a real Prefect server on
127.0.0.1. One is the "GPU machine" with a process worker on the pool and the
train-only deployment; the other runs the pipeline with orchestrate.train_pool set."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from training.mlops.registry import GATE_TAG

from .conftest import copy_project
from .test_orchestration import _env, _filter, _stop, server  # noqa: F401 (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(450)]

BIN = Path(sys.executable).parent
POOL = "test-gpu"
SMALL = ["data.max_rows=500", "train.epochs=4", "runtime.procs_per_node=1"]


def _run(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _checkout(root: Path, remote: Path, env: dict[str, str]) -> Path:
    """A clone whose DVC remote is the shared folder (in its local, untracked config)."""
    copy_project(root)
    _run(root, env, str(BIN / "dvc"), "remote", "modify", "--local", "local", "url", str(remote))
    return root


def _flow_runs(api: str, flow_name: str, pool: str | None = None) -> list[dict]:
    runs = _filter(api, "flow_runs", {"flows": {"name": {"any_": [flow_name]}}})
    return [r for r in runs if pool in (None, r["work_pool_name"])]


def _wait_for_worker(api: str, worker, log: Path) -> None:
    deadline = time.monotonic() + 60
    while not _filter(api, f"work_pools/{POOL}/workers", {}):
        assert worker.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the worker never reported to the server"
        time.sleep(0.5)


@pytest.fixture
def gpu_worker(server, tmp_path):  # noqa: F811 (the server fixture)
    """The GPU machine: its checkout, the train-only deployment, a process worker."""
    mlflow = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = _env(
        tmp_path / "gpu", server, MLFLOW_TRACKING_URI=mlflow, PREFECT_WORKER_QUERY_SECONDS="1"
    )
    root = _checkout(tmp_path / "gpu", tmp_path / "dvc-remote", env)
    _run(root, env, str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "process")
    _run(root, env, str(BIN / "gradline"), "deploy-train", "--pool", POOL)
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            # --limit 1: the flow runs share the checkout (deploy/README.md)
            [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--limit", "1"],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for_worker(server, worker, log)
        yield root, mlflow, log
    finally:
        _stop(worker, 15)


def test_train_runs_on_the_pool_and_is_recorded_here(server, gpu_worker, tmp_path) -> None:  # noqa: F811
    gpu, mlflow, worker_log = gpu_worker
    env = _env(tmp_path / "main", server, MLFLOW_TRACKING_URI=mlflow)
    main = _checkout(tmp_path / "main", tmp_path / "dvc-remote", env)
    sets = [a for s in [*SMALL, f"orchestrate.train_pool={POOL}"] for a in ("--set", s)]
    proc = subprocess.run(
        [str(BIN / "gradline"), "run", *sets], cwd=main, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + worker_log.read_text()[-4000:]

    # The train stage ran on the worker's checkout, as a flow run of the deployment...
    (remote,) = _flow_runs(server, "gradline-train", POOL)
    (caller,) = [r for r in _flow_runs(server, "gradline") if r["state"]["type"] == "COMPLETED"]
    assert remote["state"]["type"] == "COMPLETED"
    assert remote["work_pool_name"] == POOL and remote["parent_task_run_id"]  # a subflow
    assert any((gpu / "checkpoints").iterdir()), "no checkpoints on the GPU machine"
    # ...and is recorded here as if it had run here: same dvc.lock entry, the model and
    # result.json pulled, nothing stale.
    lock = yaml.safe_load((main / "dvc.lock").read_text())["stages"]
    assert lock["train"] == yaml.safe_load((gpu / "dvc.lock").read_text())["stages"]["train"]
    assert (main / "model").is_dir() and not (main / "checkpoints").exists()
    result = json.loads((main / "result.json").read_text())
    status = _run(main, env, str(BIN / "dvc"), "status", "--json").stdout
    assert json.loads(status or "{}") == {}
    # evaluate and register ran here, on the model trained there, under the caller's run.
    assert (main / "metrics.json").is_file() and "evaluate" in lock
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow, registry_uri=mlflow)
    run = client.get_run(result["run_id"])
    assert run.data.tags["gradline.prefect_flow_run_id"] == caller["id"]
    (version,) = client.search_model_versions(f"run_id = '{result['run_id']}'")
    # Registered and gated, with this run's lineage in its description.
    assert version.tags[GATE_TAG] in ("champion", "challenger"), version.tags
    assert f"Trained in MLflow run {result['run_id']}." in version.description

    # A train stage failing there fails the flow here, naming the pool, the remote flow
    # run and the cause (more workers than the pool machine's quota: a quick failure).
    sets = [*sets, "--set", "train.epochs=5", "--set", "runtime.procs_per_node=64"]
    proc = subprocess.run(
        [str(BIN / "gradline"), "run", *sets], cwd=main, env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    failed = next(r for r in _flow_runs(server, "gradline-train", POOL) if r["id"] != remote["id"])
    out = proc.stdout + proc.stderr
    assert f"work pool {POOL!r} failed: flow run {failed['name']!r}" in out
    assert "runtime.procs_per_node=64 needs 64 device slots" in out
    assert yaml.safe_load((main / "dvc.lock").read_text())["stages"]["train"] == lock["train"]


@pytest.mark.timeout(120)
def test_a_pool_without_the_deployment_is_named(server, tmp_path) -> None:  # noqa: F811
    env = _env(tmp_path / "main", server, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'm.db'}")
    main = _checkout(tmp_path / "main", tmp_path / "dvc-remote", env)
    sets = [a for s in [*SMALL, "orchestrate.train_pool=nowhere"] for a in ("--set", s)]
    proc = subprocess.run(
        [str(BIN / "gradline"), "run", *sets], cwd=main, env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "gradline deploy-train --pool nowhere" in proc.stdout + proc.stderr


@pytest.mark.timeout(120)
def test_train_deployment_on_the_kubernetes_gpu_template(server, tmp_path) -> None:  # noqa: F811
    """The recipe's pool: the deployment starts in the image's checkout, and the flow's
    `gpus` job variable is checked against the template when the run is created."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.exceptions import PrefectHTTPStatusError

    from .conftest import REPO

    env = _env(tmp_path, server)
    template = str(REPO / "deploy" / "prefect" / "gpu-work-pool.json")
    pool = ["--pool", "k8s-gpu"]
    _run(tmp_path, env, str(BIN / "prefect"), "work-pool", "create", *pool[1:], "--type",
         "kubernetes", "--base-job-template", template)  # fmt: skip
    image = ["--image", "registry.example.com/gradline:1"]
    _run(tmp_path, env, str(BIN / "gradline"), "deploy-train", *pool,
         "--project-dir", "/opt/gradline", *image)  # fmt: skip
    with SyncPrefectClient(api=server) as client:
        deployment = client.read_deployment_by_name("gradline-train/k8s-gpu")
        assert deployment.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": "/opt/gradline"}}
        ]
        assert deployment.job_variables == {"image": "registry.example.com/gradline:1"}
        create = functools.partial(
            client.create_flow_run_from_deployment,
            deployment.id,
            parameters={"params": "", "shard_lock": {}, "pool": "k8s-gpu"},
        )
        assert create(job_variables={"gpus": 2}).job_variables == {"gpus": 2}
        with pytest.raises(PrefectHTTPStatusError, match="gpus"):
            create(job_variables={"gpus": "two"})
