"""A tracking server that goes down mid-training and comes back: training's records wait
in the journal and ship once it answers, each value exactly once.

A real `mlflow server` on 127.0.0.1 with a SQLite store, stopped and started again on
the same port and store; rank 0's tracker (journal and helper process) writes through
the outage."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from training.engine.launch import free_port
from training.mlops.tracking import MlflowTracker, client

pytestmark = pytest.mark.timeout(480)


class Server:
    def __init__(self, base: Path) -> None:
        self.base, self.started = base, False
        self._use_port(free_port())
        self.proc: subprocess.Popen | None = None

    def _use_port(self, port: int) -> None:
        self.port, self.uri = port, f"http://127.0.0.1:{port}"

    def start(self) -> None:
        """Start the server; its first start moves to another free port if another process
        took this one meanwhile (the server takes seconds to bind: a window the suite's
        other processes and their servers can fall into). A restart keeps its port."""
        for _ in range(3):
            if self._start_once():
                self.started = True
                return
            log = (self.base / "server.log").read_text()
            assert not self.started and "address already in use" in log, log[-3000:]
            self._use_port(free_port())
        raise AssertionError("mlflow server found no free port in 3 tries")

    def _start_once(self) -> bool:
        """Start the server on self.port; whether it answers (False: it exited)."""
        store = f"sqlite:///{self.base / 'mlflow.db'}"
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--backend-store-uri", store, "--workers", "1"]
        command += ["--default-artifact-root", (self.base / "artifacts").as_uri()]
        self.proc = subprocess.Popen(
            command,
            # As `gradline ui` starts it: no job-runner processes (MLflow's GenAI jobs).
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            stdout=subprocess.DEVNULL,
            stderr=(self.base / "server.log").open("a"),
        )
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return True
            except OSError:
                if self.proc.poll() is not None:
                    self.proc = None
                    return False
                assert time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture
def server(tmp_path):
    served = Server(tmp_path)
    served.start()
    yield served
    served.stop()


@pytest.mark.parametrize(("setting", "expected"), [(None, 19), ("7", 7)])
def test_the_helper_yields_the_cpu_to_training(tmp_path, monkeypatch, setting, expected):
    """Shipping never competes with the training loop: the helper runs at the lowest
    priority from its start (its MLflow import included), or at the one set. (The suite
    sets 0 in conftest: at 19, beside other test processes on a loaded host, a helper
    waited more than 120 s for the CPU to import MLflow.)"""
    from training.mlops.tracking import TRACKER_NICE_ENV

    if setting is None:
        monkeypatch.delenv(TRACKER_NICE_ENV, raising=False)
    else:
        monkeypatch.setenv(TRACKER_NICE_ENV, setting)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow_client = client(uri)
    run_id = mlflow_client.create_run(mlflow_client.create_experiment("nice")).info.run_id
    tracker = MlflowTracker(uri, run_id, tmp_path / "job" / "tracking.jsonl")
    try:
        own = os.getpriority(os.PRIO_PROCESS, 0)  # never above the training's own priority
        assert os.getpriority(os.PRIO_PROCESS, tracker._process.pid) == max(expected, own)
    finally:
        tracker._process.kill()
        tracker._process.join(30)


@pytest.mark.parametrize("setting", ["-5", "20", "low", ""])
def test_a_bad_helper_niceness_is_refused_before_anything_starts(tmp_path, monkeypatch, setting):
    from training.errors import ConfigError
    from training.mlops.tracking import TRACKER_NICE_ENV

    monkeypatch.setenv(TRACKER_NICE_ENV, setting)
    with pytest.raises(ConfigError, match=f"{TRACKER_NICE_ENV}=.*whole number from 0"):
        MlflowTracker("sqlite:///unused.db", "run", tmp_path / "job" / "tracking.jsonl")
    assert not multiprocessing.active_children()  # no helper left behind


def test_records_written_while_the_server_is_down_ship_once_it_is_back(server, tmp_path):
    mlflow_client = client(server.uri)
    experiment = mlflow_client.create_experiment("outage")
    run_id = mlflow_client.create_run(experiment).info.run_id
    tracker = MlflowTracker(server.uri, run_id, tmp_path / "job" / "tracking.jsonl")
    for step in range(1, 11):
        tracker.log_metrics({"train_loss": 1.0 / step}, step)
    time.sleep(3)  # the helper ships these
    server.stop()
    started = time.perf_counter()
    for step in range(11, 31):  # training goes on while the server is down
        tracker.log_metrics({"train_loss": 1.0 / step}, step)
        tracker.set_tag("gradline.last_step", str(step))
    assert time.perf_counter() - started < 1.0  # the loop never waits for the server
    time.sleep(4)  # the helper meets the outage and waits it out
    server.start()
    tracker.close(timeout_s=300)
    history = client(server.uri).get_metric_history(run_id, "train_loss")
    steps = sorted(m.step for m in history)
    assert steps == list(range(1, 31))  # every value, once: no gap, no duplicate
    assert client(server.uri).get_run(run_id).data.tags["gradline.last_step"] == "30"


def test_a_helper_ends_when_a_left_over_helper_already_shipped_its_writers_end(tmp_path):
    """Rank 0 killed, its helper lagging: the left-over helper holds the journal's lock
    and ships the restarted writer's records too, its `end` among them when that writer
    finished first. The new writer's helper then finds nothing new: it must end, not wait
    for an `end` already shipped (its writer's close() would wait up to 10 minutes)."""
    import json
    import threading

    from training.atomic import write_json
    from training.mlops.tracking import _tracking_process

    journal = tmp_path / "tracking.jsonl"
    old = {"kind": "metrics", "step": 1, "values": {"train_loss": 1.0}}
    journal.write_text(json.dumps(old) + "\n")
    begins = journal.stat().st_size  # where the restarted writer's records start
    new = [{**old, "step": 2}, {"kind": "end", "writer": os.getpid()}]
    with journal.open("a") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in new)
    write_json(journal.with_name("tracking.jsonl.shipped"), {"offset": journal.stat().st_size})
    uri = f"http://127.0.0.1:{free_port()}"  # never asked: nothing is left to ship
    args = (uri, "run", str(journal), os.getpid(), begins)
    helper = threading.Thread(target=_tracking_process, args=args, daemon=True)
    helper.start()
    helper.join(timeout=20)
    assert not helper.is_alive(), "the helper waits for an end that was already shipped"


def test_finish_never_waits_and_lets_the_helper_ship_the_rest_and_end_before_close(tmp_path):
    """Rank 0 finishes its tracker as training ends and closes it once the process group
    has ended. finish() returns at once even with the helper stopped (SIGSTOP), writes one
    `end`, and is all the helper needs to ship every record and end by itself: close()
    then finds it done."""
    import signal

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow_client = client(uri)
    run_id = mlflow_client.create_run(mlflow_client.create_experiment("finish")).info.run_id
    tracker = MlflowTracker(uri, run_id, tmp_path / "job" / "tracking.jsonl")
    for step in range(1, 6):
        tracker.log_metrics({"train_loss": 1.0 / step}, step)
    os.kill(tracker._process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        tracker.finish()
        tracker.finish()  # once only: a second call adds nothing
        assert time.monotonic() - started < 1.0
    finally:
        os.kill(tracker._process.pid, signal.SIGCONT)
    # Without the writer's end the helper would poll the journal for good: it ends
    # here only because finish() told it there is nothing more.
    tracker._process.join(120)
    assert not tracker._process.is_alive(), "the helper did not end after finish()"
    assert tracker._process.exitcode == 0
    steps = sorted(m.step for m in mlflow_client.get_metric_history(run_id, "train_loss"))
    assert steps == [1, 2, 3, 4, 5]
    started = time.monotonic()
    tracker.close(timeout_s=60)
    assert time.monotonic() - started < 5.0
    journal = (tmp_path / "job" / "tracking.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in journal].count("end") == 1


def test_a_helper_killed_while_idle_fails_the_close_without_hanging_it(tmp_path):
    """The OOM killer (or anyone) kills the helper while it idles between polls: the job's
    end must say so, not hang. (Waking the helper through a multiprocessing Event hung
    here for good: its set() waits for a waiter that a kill left counted as asleep.) The
    records it never shipped stay in the journal, every one, for `gradline sync`."""
    import signal
    import threading

    from training.errors import TrackingError
    from training.mlops.tracking import pending_records

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow_client = client(uri)
    run_id = mlflow_client.create_run(mlflow_client.create_experiment("killed")).info.run_id
    tracker = MlflowTracker(uri, run_id, tmp_path / "job" / "tracking.jsonl")
    tracker.log_metrics({"train_loss": 1.0}, 1)
    deadline = time.monotonic() + 120
    while not mlflow_client.get_metric_history(run_id, "train_loss"):
        assert time.monotonic() < deadline, "the helper never shipped the first record"
        time.sleep(0.2)
    time.sleep(1.0)  # the helper is idle now, between polls of the journal
    os.kill(tracker._process.pid, signal.SIGKILL)
    tracker._process.join(30)
    for step in range(2, 6):
        tracker.log_metrics({"train_loss": 1.0 / step}, step)
    outcome: list[BaseException | None] = []

    def close() -> None:
        try:
            tracker.close(timeout_s=60)
            outcome.append(None)
        except TrackingError as exc:
            outcome.append(exc)

    closing = threading.Thread(target=close, daemon=True)
    closing.start()
    closing.join(timeout=90)
    assert not closing.is_alive(), "close() hangs on a killed helper"
    assert isinstance(outcome[0], TrackingError) and "exit code -9" in str(outcome[0])
    assert pending_records(tmp_path / "job" / "tracking.jsonl") == 5  # 4 values and the end


def test_a_copy_of_a_job_resumed_into_a_new_run_ships_it_the_whole_journal(tmp_path):
    """What a job's helper shipped to its run is not shipped to another: a copy of the job
    resumed into a new run gives that run every value the journal holds, each once, even
    where the first run received part of it before the copy was made."""
    from training.mlops.tracking import append_records, ensure_experiment, ship_pending

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = ensure_experiment(uri, "copies", (tmp_path / "artifacts").as_uri())
    first, second = (client(uri).create_run(experiment).info.run_id for _ in range(2))
    journal = tmp_path / "job" / "tracking.jsonl"
    journal.parent.mkdir()

    def losses(steps: range) -> list[dict]:
        return [{"kind": "metrics", "step": s, "time": 0, "values": {"loss": 1 / s}} for s in steps]

    append_records(journal, losses(range(1, 9)))
    assert ship_pending(uri, first, journal).records == 8  # the first run, steps 1..8
    append_records(journal, losses(range(9, 13)))  # its copy trains on into a new run
    assert ship_pending(uri, second, journal).records == 12
    assert ship_pending(uri, second, journal).records == 0  # nothing twice
    for run_id, last in ((first, 8), (second, 12)):
        steps = sorted(m.step for m in client(uri).get_metric_history(run_id, "loss"))
        assert steps == list(range(1, last + 1))


# --- The server still down when training ends: the train stage finishes, registration
# waits orchestrate.tracking_wait_s and fails naming what is kept; `gradline sync` ships.

END_SMALL = {
    "runtime.procs_per_node": 1,
    "data.max_rows": 900,
    "train.epochs": 30,
    "runtime.log_every_steps": 10,
    "runtime.checkpoint_every_steps": 50,
    "orchestrate.tracking_wait_s": 3,
}


def _cli(root: Path, env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _stop_when_shipping(server: Server, job_root: Path, proc: subprocess.Popen) -> None:
    """Stop the server once the helper has shipped something and training goes on."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        shipped = list(job_root.glob("*/tracking.jsonl.shipped"))
        if shipped:
            server.stop()
            return
        time.sleep(0.2)
    raise AssertionError("training ended before its helper shipped anything")


def _journal_steps(journal: Path) -> dict[str, list[int]]:
    """Every step of every training metric the journal holds (what MLflow must hold)."""
    import json

    steps: dict[str, set[int]] = {}
    for line in journal.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "metrics" and not record.get("replace"):
            for key in record["values"]:
                steps.setdefault(key, set()).add(record["step"])
        elif record["kind"] == "series":
            first = record["first"]
            steps.setdefault(record["key"], set()).update(
                range(first, first + len(record["values"]))
            )
    return {key: sorted(found) for key, found in steps.items()}


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_server_down_as_training_ends_then_sync_ships_and_registers(
    server, tmp_path, monkeypatch
) -> None:
    import json
    import os

    from training.config import write_overrides
    from training.errors import TrackingUnavailable
    from training.mlops.registration import register_trained
    from training.mlops.tracking import pending_records
    from training.project import Project

    from .conftest import copy_project

    root = copy_project(tmp_path / "project")
    write_overrides(root / "params.yaml", [f"{k}={v}" for k, v in END_SMALL.items()])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(MLFLOW_TRACKING_URI=server.uri, GRADLINE_PROGRESS="plain")
    env["GRADLINE_FAULT"] = "slow:rank=0:step=0:seconds=0.03"  # long enough to stop midway
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    # The data through DVC, as the flow brings it (dvc.lock records its version).
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "repro", "shard"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    train_args = ["--shards", "data/shards", "--model", "model"]
    train_args += ["--checkpoints", "checkpoints", "--result", "result.json"]
    command = [sys.executable, "-m", "flows.cli", "stage", "train", *train_args]
    log = (tmp_path / "train.log").open("w")
    train = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _stop_when_shipping(server, root / "checkpoints", train)
        stopped = time.monotonic()
        assert train.wait(timeout=300) == 0, (tmp_path / "train.log").read_text()[-4000:]
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    ended_after = time.monotonic() - stopped
    train_log = (tmp_path / "train.log").read_text()

    # The train stage finished without the server: model, result, checkpoints, journal.
    result = json.loads((root / "result.json").read_text())
    job = Project(root).job(result["job"])
    assert (root / "model").is_dir() and result["model_uri"] is None
    assert list(job.path.glob("step-*")), "no checkpoint"
    waiting = pending_records(job.journal)
    assert waiting > 0, train_log[-3000:]
    assert "does not answer" in train_log

    done = _cli(
        root,
        env,
        "stage",
        "evaluate",
        "--model",
        "model",
        "--shards",
        "data/shards",
        "--result",
        "result.json",
        "--metrics",
        "metrics.json",
        "--plots",
        "plots",
    )
    assert done.returncode == 0, done.stderr[-3000:]

    # Registration (the flow's register step) waits orchestrate.tracking_wait_s, then fails.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    said: list[str] = []
    began = time.monotonic()
    with pytest.raises(TrackingUnavailable) as failed:
        register_trained(root, Project(root).config(), 3.0, said.append)
    waited = time.monotonic() - began
    message = str(failed.value)
    assert 3.0 <= waited < 20, waited
    assert said and "waiting for the MLflow tracking server" in said[0]
    assert "within 3 s (orchestrate.tracking_wait_s)" in message
    assert f"job {job.path.name}" in message and "records not yet in MLflow" in message
    assert "run `gradline sync` to ship them and register the model" in message

    # The server is back (same port, same store): `gradline sync` ships and registers.
    server.start()
    synced = _cli(root, env, "sync")
    assert synced.returncode == 0, synced.stdout[-2000:] + synced.stderr[-3000:]
    assert "shipped " in synced.stdout and f"of job {job.path.name}" in synced.stdout
    # Whether this small model beat its baseline (the alias) is the gate's business.
    registered = re.search(r"registered: gradline-digits v1 -> alias '(\w+)'", synced.stdout)
    assert registered and registered[1] in ("champion", "challenger"), synced.stdout
    assert pending_records(job.journal) == 0

    counts = _count(server.uri, result["run_id"], job.journal)
    again = _cli(root, env, "sync")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to ship" in again.stdout
    assert f"already registered: gradline-digits v1 -> alias '{registered[1]}'" in again.stdout
    assert _count(server.uri, result["run_id"], job.journal) == counts
    print(
        f"train ended {ended_after:.1f} s after the server stopped; {waiting} records waited "
        f"(+ evaluation and the job's end); registration gave up after {waited:.1f} s; "
        f"sync said: {synced.stdout.strip()}"
    )


def _count(uri: str, run_id: str, journal: Path) -> dict:
    """Every value per metric and step once, no gaps; one run; one version, gated."""
    mlflow_client = client(uri)
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED"
    expected = _journal_steps(journal)
    assert "train_loss" in expected
    for key, steps in expected.items():
        held = sorted(m.step for m in mlflow_client.get_metric_history(run_id, key))
        assert held == steps, key  # each value once, none missing
    test_values = mlflow_client.get_metric_history(run_id, "test_accuracy")
    assert len(test_values) == 1
    runs = mlflow_client.search_runs([run.info.experiment_id])
    assert len(runs) == 1  # one run for the job
    versions = mlflow_client.search_model_versions("name='gradline-digits'")
    assert [v.run_id for v in versions] == [run_id]
    assert versions[0].tags.get("gradline.gate") in ("champion", "challenger")  # gated
    checkpoints = mlflow_client.list_artifacts(run_id, "checkpoints")
    evaluation = mlflow_client.list_artifacts(run_id, "evaluation")
    assert checkpoints and evaluation
    return {
        "steps": {key: len(steps) for key, steps in expected.items()},
        "checkpoints": sorted(a.path for a in checkpoints),
        "versions": len(versions),
    }


# --- Rank 0 killed while its helper lags behind the journal: the records the dead
# attempt journaled but had not shipped, and those the resumed attempt writes again up
# to the checkpoint, reach MLflow exactly once.


def _shipper(lock: Path):
    """The helper process shipping the journal whose lock file is `lock` (it holds it)."""
    import psutil

    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if any(f.path == str(lock) for f in process.open_files()):
                return process
    return None


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_rank_0_killed_while_shipping_lags_every_record_lands_once(
    server, tiny_shards, tmp_path, monkeypatch
) -> None:
    """The helper is frozen (SIGSTOP) as soon as it runs, so records pile up in the
    journal; rank 0 is killed at step 12; the frozen helper, orphaned, resumes (SIGCONT)
    only after that, while the job restarts from step 8 with a helper of its own: the two
    hand the journal over, and every value lands once."""
    import signal
    import threading

    from training.config import Config
    from training.engine.jobdir import JobDir
    from training.engine.launch import launch_workers
    from training.mlops.tracking import pending_records

    from .conftest import train_job
    from .resume_checks import Resumed, assert_resumed

    cfg = Config.model_validate(
        {
            "model": {"name": "mlp", "hidden": 16, "depth": 2},
            "train": {"epochs": 2, "batch_size": 32},
            "runtime": {"checkpoint_every_steps": 8, "log_every_steps": 2},
        }
    )
    mlflow_client = client(server.uri)
    run_id = mlflow_client.create_run(mlflow_client.create_experiment("lag")).info.run_id
    job = train_job(tiny_shards, tmp_path, cfg, (server.uri, run_id))
    job_dir = JobDir(Path(job.job_dir))
    monkeypatch.setenv(
        "GRADLINE_FAULT", "slow:rank=0:step=0:seconds=0.1;kill:rank=0:step=12:attempt=0"
    )
    lag: dict[str, int] = {}

    def freeze_the_helper_until_rank_0_is_dead() -> None:
        deadline = time.monotonic() + 200
        lock = job_dir.journal.with_name(job_dir.journal.name + ".lock")
        helper = None
        while helper is None and time.monotonic() < deadline:
            helper = _shipper(lock) if lock.exists() else None
            time.sleep(0.05)
        if helper is None:
            return
        helper.send_signal(signal.SIGSTOP)
        try:
            while not (job_dir.health / "killed.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # SIGKILL lands just after the record
            lag["pending"] = pending_records(job_dir.journal)  # journaled, not shipped
        finally:
            helper.send_signal(signal.SIGCONT)

    watcher = threading.Thread(target=freeze_the_helper_until_rank_0_is_dead, daemon=True)
    watcher.start()
    launch_workers(job, procs_per_node=2, max_restarts=1)
    watcher.join(timeout=60)
    assert lag.get("pending", 0) > 0, "the helper did not lag when rank 0 died"
    assert_resumed(job_dir.path, Resumed(8, written_by=2, resumed_by=2))
    assert pending_records(job_dir.journal) == 0
    expected = _journal_steps(job_dir.journal)
    assert "train_loss" in expected
    for key, steps in expected.items():
        held = sorted(m.step for m in mlflow_client.get_metric_history(run_id, key))
        assert held == steps, key  # every journaled value, none twice


def test_a_helper_kept_behind_by_a_busy_host_leaves_the_rest_to_the_jobs_end(tmp_path):
    """A helper that never gets the CPU (stopped here; at niceness 19, other work filling
    the CPUs does the same) does not fail a job whose training ended: close() stops it
    after its wait and leaves every unshipped record in the journal, and the job's end
    ships them at its own priority since the server answers."""
    import signal
    from types import SimpleNamespace

    from training.engine.jobdir import JobDir
    from training.mlops.jobs import _tracking_down
    from training.mlops.tracking import pending_records

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow_client = client(uri)
    run_id = mlflow_client.create_run(mlflow_client.create_experiment("behind")).info.run_id
    job_dir = JobDir(tmp_path / "job")
    job_dir.path.mkdir()
    job_dir.run_file.write_text(json.dumps({"run_id": run_id}))
    tracker = MlflowTracker(uri, run_id, job_dir.journal)
    os.kill(tracker._process.pid, signal.SIGSTOP)
    for step in range(1, 6):
        tracker.log_metrics({"train_loss": 1.0 / step}, step)
    tracker.close(timeout_s=2)  # returns: no TrackingError for a helper that is behind
    assert not tracker._process.is_alive()
    assert pending_records(job_dir.journal) == 6  # 5 values and the end

    job = SimpleNamespace(job_dir=job_dir, run_id=run_id)
    unreachable = SimpleNamespace(tracking_uri=f"http://127.0.0.1:{free_port()}")
    assert _tracking_down(unreachable, job)  # no server: they wait for it
    assert pending_records(job_dir.journal) == 6
    assert not _tracking_down(SimpleNamespace(tracking_uri=uri), job)  # shipped: not down
    assert pending_records(job_dir.journal) == 0
    history = mlflow_client.get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]


def test_a_store_that_refuses_the_records_at_the_jobs_end_leaves_them_waiting(tmp_path):
    """Training is done when the job's end ships what its helper left: a store that
    refuses them (here: it has no such run) leaves them in the journal, every one, for
    registration or `gradline sync`, instead of failing the finished job."""
    from types import SimpleNamespace

    from training.engine.jobdir import JobDir
    from training.mlops.jobs import _tracking_down
    from training.mlops.tracking import append_records, pending_records

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client(uri).search_experiments()  # the store exists and answers
    job_dir = JobDir(tmp_path / "job")
    job_dir.path.mkdir()
    job_dir.run_file.write_text(json.dumps({"run_id": "0" * 32}))  # a run it does not hold
    records = [{"kind": "metrics", "step": s, "time": 0, "values": {"loss": 1 / s}} for s in (1, 2)]
    append_records(job_dir.journal, records)
    job = SimpleNamespace(job_dir=job_dir, run_id="0" * 32)
    assert _tracking_down(SimpleNamespace(tracking_uri=uri), job)  # deferred, not raised
    assert pending_records(job_dir.journal) == 2
