"""`gradline ui`: both servers answer, their UIs work on any port and show the pages a
review opens (a run, a compare view, a model version and its card) in MLflow's Model
training view (checked in a real browser), `--auth` refuses strangers, and Ctrl-C,
SIGTERM or SIGHUP stops every process."""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from flows.ui import UiOptions, _wait_for_group, auth_environment, prefect_server, serve_uis
from training.errors import TrackingError

from .conftest import _client, _gradline, copy_project, http_status
from .test_compare import TINY

BIN = Path(sys.executable).parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class RunningUi:
    proc: subprocess.Popen
    mlflow_port: int
    prefect_port: int
    log: Path
    family: list[psutil.Process]  # every server process, taken once both answered

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def mlflow_processes(self) -> list[psutil.Process]:
        server = next(p for p in self.family if "mlflow" in " ".join(p.cmdline()))
        return [server, *server.children(recursive=True)]


@contextlib.contextmanager
def _gradline_ui(
    tmp_path: Path, *args: str, env: dict | None = None, root: Path | None = None
) -> Iterator[RunningUi]:
    """`gradline ui` on free (non-default) ports, once both servers answer: in `root`, or
    a fresh copy of the project."""
    root = root or copy_project(tmp_path / "gradline")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    clean.update(PREFECT_HOME=str(tmp_path / "prefect-home"), **(env or {}))
    mlflow_port, prefect_port = _free_port(), _free_port()
    ports = ["--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port)]
    log = tmp_path / "ui.log"
    with log.open("w") as out:  # a file, not a pipe: chatty servers never block on it
        proc = subprocess.Popen(
            [str(BIN / "gradline"), "ui", *ports, *args],
            cwd=root,
            env=clean,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's own process group
            # SIGINT at its default, as in a terminal: a new session keeps an inherited
            # ignore, which Python then keeps too (two suite runs here saw Ctrl-C do
            # nothing: something earlier in the test process had left SIGINT ignored).
            preexec_fn=_sigint_as_in_a_terminal,
        )
    ui = RunningUi(proc, mlflow_port, prefect_port, log, [])
    try:
        _wait_until_up(ui)
        ui.family = _children(proc.pid)
        yield ui
    finally:
        _stop_for_good(ui)


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_until_up(ui: RunningUi) -> None:
    urls = [
        f"http://127.0.0.1:{ui.mlflow_port}/health",
        f"http://127.0.0.1:{ui.prefect_port}/api/health",
    ]
    deadline = time.monotonic() + 300  # two servers' start: minutes on a loaded 2-core host
    while not all(_answers(u) for u in urls):
        assert ui.proc.poll() is None, ui.output()
        assert time.monotonic() < deadline, f"the UIs did not come up:\n{ui.output()}"
        time.sleep(1)


def _stop_for_good(ui: RunningUi) -> None:
    """Teardown after a failed test too: nothing of this test may outlive it."""
    family = ui.family or _children(ui.proc.pid)
    if ui.proc.poll() is None:
        os.kill(ui.proc.pid, signal.SIGTERM)
        try:
            ui.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            ui.proc.kill()
            ui.proc.wait()
    for proc in family:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop_and_check(ui: RunningUi, sig: signal.Signals, *, group: bool = False) -> None:
    """Send `sig` (to the terminal's process group for Ctrl-C); then `gradline ui` exits 0,
    no server process is left and both ports are free."""
    assert ui.family, "no server processes were seen"
    (os.killpg if group else os.kill)(ui.proc.pid, sig)
    # A hang guard: the servers get 15 s, then SIGKILL (flows/ui.stop_servers).
    try:
        code = ui.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        states = [f"{p.pid} {p.status()} {p.cmdline()[:3]}" for p in ui.family if _alive(p)]
        pytest.fail(f"not stopped 120 s after {sig.name}; left: {states}\n{ui.output()}")
    assert code == 0, ui.output()
    left = [p for p in ui.family if _alive(p)]
    assert not left, f"still running after {sig.name}: {[p.cmdline() for p in left]}"
    deadline = time.monotonic() + 15
    while _listening(ui.mlflow_port) or _listening(ui.prefect_port):
        assert time.monotonic() < deadline, f"a UI server still listens after {sig.name}"
        time.sleep(0.5)


@pytest.mark.e2e
@pytest.mark.timeout(480)
def test_ui_auth_refuses_strangers_and_sigterm_stops_all(tmp_path: Path) -> None:
    user, password = "ada", secrets.token_urlsafe(16)
    creds = {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}
    team_credential = ("team", secrets.token_urlsafe(16))  # Prefect's one shared credential
    creds["PREFECT_SERVER_API_AUTH_STRING"] = ":".join(team_credential)
    with _gradline_ui(tmp_path, "--auth", env=creds) as ui:
        path = "/api/2.0/mlflow/experiments/search?max_results=1"
        assert http_status(ui.mlflow_port, path) == 401
        assert http_status(ui.mlflow_port, path, auth=(user, "wrong")) == 401
        assert http_status(ui.mlflow_port, path, auth=(user, password)) == 200
        assert http_status(ui.mlflow_port, path, auth=(user, password), host="evil.example") == 403
        assert http_status(ui.prefect_port, "/api/admin/version") == 401
        assert http_status(ui.prefect_port, "/api/admin/version", auth=(user, password)) == 401
        client = _prefect_client_writes(ui.prefect_port, ":".join(team_credential))
        assert client.returncode == 0, client.stderr[-2000:]
        stranger = _prefect_client_writes(ui.prefect_port, None)
        assert stranger.returncode != 0 and "401" in stranger.stderr, stranger.stderr[-2000:]
        _stop_and_check(ui, signal.SIGTERM)  # what systemd and `timeout` send
    assert password not in ui.output() and team_credential[1] not in ui.output()
    assert password not in (tmp_path / "gradline" / "mlflow" / "basic_auth.ini").read_text()
    assert f"MLFLOW_TRACKING_URI=http://127.0.0.1:{ui.mlflow_port}" in ui.output()


@pytest.mark.timeout(30)
def test_a_server_that_ended_is_not_waited_for() -> None:
    """An ended server is a zombie, still in its process group, until it is reaped: the
    wait for its group reaps it instead of waiting out its timeout."""
    server = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    while psutil.Process(server.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    started = time.monotonic()
    _wait_for_group(server, timeout=10)
    assert time.monotonic() - started < 5  # the timeout was 10 s
    assert server.returncode == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_stop_signals_end_servers_and_workers_in_their_own_sessions(tmp_path, sig) -> None:
    """The real servers start in ~25 s; stand-ins whose workers left the server's session
    (and hold its port) show in ~2 s that every process is stopped, for each signal."""
    ports = [_free_port(), _free_port()]
    log = tmp_path / "ui.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", STAND_IN_UI, *map(str, ports)],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    ui = RunningUi(proc, *ports, log=log, family=[])
    try:
        deadline = time.monotonic() + 30
        while len(ui.family) < 4 or not all(map(_listening, ports)):
            assert proc.poll() is None and time.monotonic() < deadline, ui.output()
            time.sleep(0.2)
            ui.family = _children(proc.pid)
        _stop_and_check(ui, sig)
    finally:
        _stop_for_good(ui)


# Each stand-in server binds its port, then starts a worker in a session of its own that
# holds the socket, as uvicorn's workers hold the port after their parent is gone.
STAND_IN_SERVER = """
import socket, subprocess, sys, time
sock = socket.socket()
sock.bind(("127.0.0.1", int(sys.argv[1])))
sock.listen()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                 pass_fds=[sock.fileno()], start_new_session=True)
time.sleep(120)
"""
STAND_IN_UI = f"""
import sys
from pathlib import Path
import flows.ui as ui
server = [sys.executable, "-c", {STAND_IN_SERVER!r}]
ui.mlflow_server = lambda root, options: ([*server, sys.argv[1]], None)
ui.prefect_server = lambda options: ([*server, sys.argv[2]], None)
sys.exit(ui.serve_uis(Path("."), ui.UiOptions()))
"""


@pytest.mark.e2e
@pytest.mark.timeout(480)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_ui_on_other_ports_works_in_a_browser_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """One launch (each starts both servers: ~12 CPU-s), checked from start to stop."""
    with _gradline_ui(tmp_path) as ui:
        settings = _ui_settings(ui.prefect_port)
        assert settings["api_url"] == f"http://127.0.0.1:{ui.prefect_port}/api"
        # `mlflow server` and one uvicorn worker; MLflow's defaults started ~15 processes.
        assert len(ui.mlflow_processes()) <= 3, [p.cmdline() for p in ui.mlflow_processes()]
        flow_run_id = _run_a_flow_with_two_tasks(ui.prefect_port, tmp_path)
        v2_base = settings.get("v2_base_url") or ""
        page = f"http://127.0.0.1:{ui.prefect_port}{v2_base}/runs/flow-run/{flow_run_id}"
        dom = _render(f"{page}?tab=TaskRuns", tmp_path)
        assert "Can't connect to Server API" not in dom
        assert re.search(r">add_one-\w+<", dom) and re.search(r">double-\w+<", dom), dom[-3000:]
        dom = _render(f"http://127.0.0.1:{ui.mlflow_port}/#/experiments", tmp_path)
        assert ">Default<" in dom, dom[-3000:]  # the experiments list, rendered by its JS
        _stop_and_check(ui, signal.SIGINT, group=True)  # what Ctrl-C in a terminal sends
    assert f"MLflow UI:  http://127.0.0.1:{ui.mlflow_port}" in ui.output()
    assert f"Prefect UI: http://127.0.0.1:{ui.prefect_port}" in ui.output()


def _prefect_client_writes(port: int, credential: str | None) -> subprocess.CompletedProcess:
    """Whether Prefect's own client, as `gradline run` makes it from the environment
    (PREFECT_API_URL, PREFECT_API_AUTH_STRING), gets an answer from the server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    if credential:
        env["PREFECT_API_AUTH_STRING"] = credential
    code = (
        "from prefect.client.orchestration import get_client\n"
        'get_client(sync_client=True).create_flow_from_name("auth-check")'
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_ui_auth_needs_prefect_s_shared_credential(tmp_path, monkeypatch) -> None:
    for name in ("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(TrackingError, match="PREFECT_SERVER_API_AUTH_STRING"):
        serve_uis(tmp_path, UiOptions(auth=True))
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "team:pw")  # a client's value serves too
    _, env = prefect_server(UiOptions(auth=True))
    assert env["PREFECT_SERVER_API_AUTH_STRING"] == env["PREFECT_API_AUTH_STRING"] == "team:pw"
    _, env = prefect_server(UiOptions())
    assert "PREFECT_SERVER_API_AUTH_STRING" not in env


def test_ui_refuses_a_network_address_without_auth(tmp_path: Path) -> None:
    with pytest.raises(TrackingError, match="--auth"):
        serve_uis(tmp_path, UiOptions(host="0.0.0.0"))


def test_ui_auth_needs_an_admin_password_on_first_start(tmp_path, monkeypatch) -> None:
    for name in ("MLFLOW_AUTH_CONFIG_PATH", "MLFLOW_AUTH_ADMIN_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    with pytest.raises(TrackingError, match="MLFLOW_TRACKING_PASSWORD"):
        auth_environment(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw-from-env")
    env = auth_environment(tmp_path)
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] == "pw-from-env"
    assert "pw-from-env" not in Path(env["MLFLOW_AUTH_CONFIG_PATH"]).read_text()


def _ui_settings(prefect_port: int) -> dict:
    """What the Prefect UI's JavaScript fetches first to learn where its API is."""
    with urllib.request.urlopen(f"http://127.0.0.1:{prefect_port}/ui-settings", timeout=10) as r:
        return json.load(r)


FLOW = """
from prefect import flow, task

@task
def add_one(x):
    return x + 1

@task
def double(x):
    return x * 2

@flow(name="ui-check")
def ui_check():
    return double(add_one(1))

print("FLOW_RUN", ui_check(return_state=True).state_details.flow_run_id)
"""


def _run_a_flow_with_two_tasks(prefect_port: int, tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_API_URL=f"http://127.0.0.1:{prefect_port}/api",
        PREFECT_HOME=str(tmp_path / "client-home"),
    )
    done = subprocess.run(
        [sys.executable, "-c", FLOW], env=env, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return re.search(r"FLOW_RUN (\S+)", done.stdout).group(1)


def _render(url: str, tmp_path: Path) -> str:
    """The DOM a real headless Chromium builds for `url` after its scripts ran."""
    profile = tmp_path / f"chromium-{secrets.token_hex(4)}"
    cmd = [
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=15000",
        "--dump-dom",
        url,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _text(dom: str) -> str:
    """What the page shows: its DOM without scripts, styles and tags."""
    shown = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", shown)))


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_review_pages_open_in_the_model_training_view(first_run, tmp_path: Path) -> None:
    """Through the links gradline prints, MLflow's UI opens on model training (runs,
    metrics, the model registry), not on its GenAI view: a run page, the compare view of
    a parent beside its children (`compare-updates`, which adds three runs to the shared
    project and nothing else), the model version page linking its card, and the card."""
    from training.mlops.lineage import artifact_url
    from training.mlops.model_card import card_link

    project, first, run_id = first_run
    printed = re.findall(r"http://127\.0\.0\.1:5000/[^\s\"',]+", first.stdout)  # `gradline run`'s
    run_link = next(link for link in printed if f"/runs/{run_id}" in link)
    version_link = next(link for link in printed if "/#/models/gradline-digits/" in link)
    # (Another test may have left a sharded layout in the shared project's params.yaml:
    # local SGD needs whole replicas.)
    sets = [f"--set={o}" for o in (*TINY, "parallel.dp_shard=1")]
    proc = _gradline(project, "compare-updates", "--rules", "sync,local_sgd", *sets)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    compare_link = re.search(r"side by side\s+(\S+)", proc.stdout).group(1)
    client = _client(project)
    experiment = client.get_experiment_by_name("gradline")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    (version,) = client.search_model_versions(f"name='gradline-digits' and run_id='{run_id}'")
    run = client.get_run(run_id)
    exp = experiment.experiment_id
    parent = next(r for r in client.search_runs([exp]) if r.info.run_name == "compare-updates")
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 2

    with _gradline_ui(tmp_path, root=project) as ui:
        base = f"http://127.0.0.1:{ui.mlflow_port}"
        training_view = f'href="#/experiments/{exp}/runs?workflowType=machine_learning"'

        dom = _render(run_link.replace("http://127.0.0.1:5000", base), tmp_path)
        shown = _text(dom)
        assert run.info.run_name in shown and "test_accuracy" in shown, shown[-3000:]
        assert training_view in dom and "/evaluation-runs" not in dom, shown[:2000]

        compare = compare_link.replace("http://127.0.0.1:5000", base)
        assert compare.startswith(base), compare_link  # printed for the default UI port
        shown = _text(_render(compare, tmp_path))
        assert "Comparing 3 Runs" in shown, shown[-3000:]
        for child in children:
            assert child.info.run_name in shown
        # (Its metrics table renders the first ~17 names, alphabetically, into the DOM.)
        assert re.search(r"update\.rule (sync local_sgd|local_sgd sync)", shown), shown[-3000:]
        assert "samples_per_s" in shown
        assert "Something went wrong" not in shown, shown[-3000:]

        dom = _render(version_link.replace("http://127.0.0.1:5000", base), tmp_path)
        assert version_link.endswith(f"/versions/{version.version}?workflowType=machine_learning")
        link = card_link(exp, run_id)
        assert f'href="{link}"' in dom, _text(dom)[-3000:]  # the description's link
        assert f"Trained in MLflow run {run_id}" in _text(dom)

        dom = _render(artifact_url(base, exp, run_id, "model_card.md"), tmp_path)
        shown = _text(dom)
        # The markdown rendered: headings and tables, not the raw text.
        assert re.search(r"<h1[^>]*>Model card: gradline-digits v1<", dom), shown[-3000:]
        assert "Results on the test split" in shown and "| test_accuracy |" not in shown
        assert re.search(r'role="cell"[^>]*>(<[^>]+>)*test_accuracy<', dom), shown[-3000:]


def test_experiments_are_marked_as_model_training(tmp_path: Path) -> None:
    """One helper creates or fetches every experiment a run goes into; it marks it as
    model training, marks one made before it did, and keeps a kind the user chose."""
    from training.mlops.tracking import client, ensure_experiment

    uri, artifacts = f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "artifacts").as_uri()
    mlflow_client = client(uri)

    def kind(experiment_id: str) -> str | None:
        return mlflow_client.get_experiment(experiment_id).tags.get("mlflow.experimentKind")

    assert kind(ensure_experiment(uri, "new", artifacts)) == "custom_model_development"
    older = mlflow_client.create_experiment("older", artifact_location=artifacts)
    assert kind(older) is None
    assert ensure_experiment(uri, "older", artifacts) == older
    assert kind(older) == "custom_model_development"
    mlflow_client.set_experiment_tag(older, "mlflow.experimentKind", "genai_development")
    ensure_experiment(uri, "older", artifacts)
    assert kind(older) == "genai_development"


def test_printed_links_ask_for_the_model_training_view() -> None:
    from urllib.parse import parse_qs, urlsplit

    from training.mlops.lineage import artifact_url, compare_url, model_version_url, run_url

    base = "http://127.0.0.1:5000"
    for link in (
        run_url(base, "3", "abc"),
        model_version_url(base, "m", 2),
        artifact_url(base, "3", "abc", "model_card.md"),
        compare_url(base, "3", ["p", "c1", "c2"]),
    ):
        route = urlsplit(link).fragment  # the UI routes after '#'
        query = parse_qs(urlsplit(route).query)
        assert link.startswith(f"{base}/#/") and query["workflowType"] == ["machine_learning"]
    query = parse_qs(urlsplit(urlsplit(compare_url(base, "3", ["p", "c1"])).fragment).query)
    assert json.loads(query["runs"][0]) == ["p", "c1"]
    assert json.loads(query["experiments"][0]) == ["3"]
    assert artifact_url("", "3", "abc", "card.md").startswith("#/experiments/3/runs/abc/")
