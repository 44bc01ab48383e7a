"""Shared fixtures: tiny real data (digits) written through the real ingest and shard code."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks.common import copy_project  # the tests' fresh clones
from flows.stage_host import STAGE_HOST_ENV
from tests.scheduling import files_and_units_of_waits, unit_of_work, waits_unit
from tests.servers import RUN_DIR_ENV, SharedPrefect, SharedStageHost
from training.config import DataConfig, ShardConfig
from training.data.ingest import ingest
from training.data.shards import write_shards
from training.database_template import CACHE_DIR_ENV
from training.mlops.tracking import fluent_state_restored

REPO = Path(__file__).resolve().parents[1]

# Set by .ci/run: there a skipped test fails the run. A test that cannot run in CI proves
# nothing, and a silent skip reads like a pass; CI makes every tool a test needs available.
CI_ENV = "GRADLINE_CI"
pytest_plugins = ["pytester"]

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
# The tracking helper at the tests' own priority: at its default (19) it yields to the
# other test processes too, and on a loaded host waited minutes for the CPU to start.
# test_tracking_outage checks the default.
os.environ.setdefault("GRADLINE_TRACKER_NICE", "0")
# Checkpoints are signed (training.signing). Most tests keep theirs in a temp folder
# outside any project, where only this variable gives a key; one random key per session,
# inherited by every worker process. tests/test_untrusted_loads.py covers the key file.
os.environ.setdefault("GRADLINE_SIGNING_KEY", secrets.token_hex(32))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get(CI_ENV) and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under CI ({CI_ENV}=1), where every test must run: {reason}"


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which `make test` uses
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the tests that wait on timers in processes of their own."""
    if config.getvalue("dist") == "loadfile":
        return files_and_units_of_waits(config, log)
    return None


# The order units of work start in (`make test` hands whole files, or units of tests that
# wait on timers, to its test processes in collection order): the waits units first (a
# process each, tests/scheduling.py), then the longest, so that the suite does not end
# waiting on one.
_START_ORDER = ("waits", "e2e", "multiprocess")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if waits_unit(item.nodeid):
            item.add_marker(pytest.mark.waits)

    def rank(item: pytest.Item) -> int:
        marks = {mark.name for mark in item.iter_markers()}
        return next((i for i, name in enumerate(_START_ORDER) if name in marks), len(_START_ORDER))

    first_rank: dict[str, int] = {}
    for item in items:
        unit = unit_of_work(item.nodeid)
        first_rank[unit] = min(first_rank.get(unit, len(_START_ORDER)), rank(item))
    # Stable: a unit's tests keep their order, and units of one rank theirs.
    items.sort(key=lambda item: first_rank[unit_of_work(item.nodeid)])


@pytest.fixture(scope="session", autouse=True)
def _one_cache_for_the_test_run() -> None:
    """gradline's cache (the new Prefect homes' database template) in the test run's
    folder, shared by its test processes: not the user's own."""
    os.environ[CACHE_DIR_ENV] = str(Path(os.environ[RUN_DIR_ENV]) / "gradline-cache")


_RUN_DIR_OWNER = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """The test run's own folder, made by its first process (under xdist, the controller,
    before it starts the test processes, which inherit its environment): where the run's
    shared Prefect server is found (tests/servers.py)."""
    inherited = os.environ.get(RUN_DIR_ENV, "")
    # An inherited folder is an outer run's (a test process's, or a run around this one);
    # one that is gone belonged to a run that ended: this run makes its own.
    if not (inherited and os.path.isdir(inherited)):
        os.environ[RUN_DIR_ENV] = tempfile.mkdtemp(prefix="gradline-tests-run-")
        config.stash[_RUN_DIR_OWNER] = Path(os.environ[RUN_DIR_ENV])


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's end (under xdist, once its test processes have ended): its shared Prefect
    server stops and its folder goes, so no process or file of the tests outlives it."""
    folder = config.stash.get(_RUN_DIR_OWNER, None)
    if folder is not None:
        SharedPrefect.stop(folder)
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[RUN_DIR_ENV]


@pytest.fixture(scope="session", autouse=True)
def _shared_stage_host():
    """A test process's shared stage host (started by the first test that needs it) ends
    with the process's tests."""
    yield
    SharedStageHost.stop()


@pytest.fixture(autouse=True)
def _same_random_state_in_any_order() -> None:
    """Each test starts from the same random state, whichever tests its process ran
    before: a model built without a seed got the weights the earlier tests' draws left,
    and one order of the suite failed a test that every other order passed. (numpy is
    imported with this file; torch, when not imported yet, starts from its fixed default
    seed when it is.)"""
    import random

    random.seed(0)
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed(0)
    if (torch := sys.modules.get("torch")) is not None:
        torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _mlflow_process_state():
    """No test hands MLflow's process-wide store to the next: a test that points it at a
    server it then stops would fail every later in-process `models:/` load."""
    with fluent_state_restored():
        yield


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Path:
    """600 digits rows through the real ingest and shard code."""
    base = tmp_path_factory.mktemp("tiny")
    ingest(DataConfig(max_rows=600), base, base / "raw", base / "quarantine", base / "report.json")
    # ~25 KB shards: several shards per split, so reads cross shard boundaries.
    write_shards(ShardConfig(target_shard_mb=0.025), base / "raw", base / "shards", "test-md5")
    return base / "shards"


@pytest.fixture(scope="session")
def tiny_token_shards(tmp_path_factory) -> Path:
    """~120 KB of the standard library's source as bytes tokens, in several shards."""
    base = tmp_path_factory.mktemp("tiny-text")
    data = DataConfig(source="stdlib", max_bytes=120_000, split_by="document")
    raw, quarantine, report = base / "raw", base / "quarantine", base / "report.json"
    ingest(data, base, raw, quarantine, report, labels=None)
    write_shards(ShardConfig(target_shard_mb=0.05), base / "raw", base / "shards", "test-md5")
    return base / "shards"


@pytest.fixture(scope="session")
def tiny_series_shards(tmp_path_factory) -> Path:
    """Weekly CO2 cut into forecasting windows (26 weeks -> 4), in several shards, as the
    `tcn` workload of tests/test_distributed.py reads them."""
    from training.data.series import ingest_series, write_window_shards

    base = tmp_path_factory.mktemp("tiny-series")
    data = DataConfig(source="co2")
    raw = base / "raw"
    ingest_series(data, base, raw, base / "quarantine", base / "report.json")
    shard = ShardConfig(target_shard_mb=0.05)
    write_window_shards(data, shard, 26, 4, 13, raw, base / "shards", "test-md5")
    return base / "shards"


def train_job(shards: Path, work: Path, cfg, tracking: tuple[str, str] | None = None):
    """The launcher's job for `cfg` on `shards`, its files in `work` (checkpoints under
    ckpt/, the model under model/), tracked into (uri, run id) when given."""
    from training.engine.job import TrainJob
    from training.mlops.tracking import MlflowSink

    return TrainJob(
        config=cfg.model_dump(),
        shard_dir=str(shards),
        job_dir=str(work / "ckpt"),
        model_dir=str(work / "model"),
        tracking=MlflowSink(*tracking) if tracking else None,
    )


def http_status(port: int, path: str, auth: tuple[str, str] | None = None, host: str = "") -> int:
    """The HTTP status of GET `path` on 127.0.0.1:`port`, with basic-auth credentials and
    another Host header when given (servers must refuse foreign Host headers)."""
    import base64
    import http.client

    headers = {"Host": host} if host else {}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(":".join(auth).encode()).decode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


class WebhookReceiver:
    """A webhook on 127.0.0.1 that keeps the JSON bodies POSTed to it, answering
    `status` (200 unless a test wants a failing webhook)."""

    def __init__(self, status: int = 200) -> None:
        import http.server
        import threading

        bodies = self.bodies = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                bodies.append(json.loads(self.rfile.read(length)))
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def assert_drawn(png: Path, min_colors: int = 16) -> None:
    """`png` is a real picture: a readable PNG of a plot-like size with more than a few
    colours (a blank or single-colour canvas fails), not merely a file with bytes in it."""
    import matplotlib.image as mpimg
    import numpy as np

    pixels = mpimg.imread(png)
    assert pixels.ndim == 3 and min(pixels.shape[:2]) >= 200, (png, pixels.shape)
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
    assert len(colours) >= min_colors, f"{png}: only {len(colours)} colours: nothing drawn?"


# --- the end-to-end project: one `gradline run`, shared by the e2e test modules ------------

SMALL = ["--set", "data.max_rows=500", "--set", "train.epochs=8"]


@pytest.fixture(scope="session")
def first_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, str]:
    """One project that has run the pipeline once: (root, the CLI's output, run id).
    Tests that use it stand alone: none needs another test to have run first."""
    project = copy_project(tmp_path_factory.mktemp("clone") / "gradline")
    with WebhookReceiver() as hook:  # the team's alert channel hears of the first champion
        notify = ["--set", "orchestrate.notify=env:TEAM_WEBHOOK"]
        # The embedded default: no server configured, a temporary one for the run.
        proc = _gradline(
            project, "run", *SMALL, *notify, env={"TEAM_WEBHOOK": hook.url}, shared_server=False
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = json.loads((project / "result.json").read_text())["run_id"]
    _assert_alerted_iff_champion(hook, "-> alias 'champion'" in proc.stdout, 1, run_id)
    return project, proc, run_id


def _assert_alerted_iff_champion(hook, champion: bool, version: int, run_id: str) -> None:
    """One alert exactly when the run's version was crowned; none for a challenger."""
    assert len(hook.bodies) == int(champion), hook.bodies
    if champion:
        (alert,) = hook.bodies
        assert alert["text"].startswith(f":trophy: new champion: gradline-digits v{version}")
        assert run_id in alert["blocks"][1]["text"]["text"] and "test_accuracy=" in str(alert)


def _env(root: Path, shared_server: bool = True) -> dict[str, str]:
    """A user's environment for gradline in `root`: none of this machine's MLflow or
    Prefect settings, no drill faults, the project's own PREFECT_HOME, and the test run's
    shared Prefect server and stage host (tests/servers.py) unless the embedded default,
    a temporary server and a stage host per run, is what the test is about
    (`shared_server=False`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env.pop("GRADLINE_FAULT", None)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    env["PREFECT_HOME"] = str(root / ".prefect-home")
    if shared_server:
        env["PREFECT_API_URL"] = SharedPrefect.api()
        env[STAGE_HOST_ENV] = SharedStageHost.socket()
    return env


def _run(
    root: Path,
    *cmd: str,
    timeout: int = 400,
    env: dict[str, str] | None = None,
    shared_server: bool = True,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd,
        cwd=root,
        env={**_env(root, shared_server), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _gradline(
    root: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: int = 400,
    shared_server: bool = True,
) -> subprocess.CompletedProcess:
    gradline = str(Path(sys.executable).parent / "gradline")
    return _run(root, gradline, *args, timeout=timeout, env=env, shared_server=shared_server)


def _client(root: Path):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{root / 'mlflow' / 'mlflow.db'}"
    return MlflowClient(tracking_uri=store, registry_uri=store)


def assert_card_reports(root: Path, run_id: str, task: str, gate: str, higher: bool) -> None:
    """The run's model card names the task and its gate metric, and shows that metric's
    test value beside the baseline's as the run recorded them."""
    import re

    from training.mlops.model_card import read_card

    card = read_card(f"sqlite:///{root / 'mlflow' / 'mlflow.db'}", run_id)
    assert card is not None, "no model card was logged with the run"
    assert re.search(rf"^\| task \| {re.escape(task)}\b", card, re.M), card[:1500]
    direction = "higher" if higher else "lower"
    assert f"| gate metric | {gate} ({direction} is better) |" in card, card[:1500]
    metrics = _client(root).get_run(run_id).data.metrics
    row = next(line for line in card.splitlines() if line.startswith(f"| {gate} |"))
    assert f"{metrics[gate]:.4f}" in row and f"{metrics['baseline_' + gate]:.4f}" in row, row


def assert_same_training(got, want, steps: int, loss_rtol: float, weight_atol: float) -> None:
    """Two jobs trained alike: `steps` losses each, equal within `loss_rtol`, and the same
    consolidated weights within `weight_atol` (got/want: (losses, name -> tensor))."""
    import torch

    (losses, weights), (want_losses, want_weights) = got, want
    assert len(losses) == len(want_losses) == steps
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(want_losses), rtol=loss_rtol, atol=0
    )
    assert weights.keys() == want_weights.keys()
    for name, value in want_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=weight_atol, msg=name)
