"""`gradline ui`: the MLflow UI and a Prefect server, until Ctrl-C, SIGTERM or SIGHUP.

Both servers run in their own sessions, so a terminal's Ctrl-C or a service manager's
SIGTERM reaches only `gradline ui`; it then stops each server's whole process tree.
`--auth` turns the MLflow server into a team server with MLflow's basic-auth app, and
puts the Prefect server behind its one shared credential (PREFECT_SERVER_API_AUTH_STRING).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from flows.prefect_database import default_database, seed_database
from training.errors import TrackingError
from training.project import default_tracking_uri

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
AUTH_CONFIG = "basic_auth.ini"
AUTH_DB = "basic_auth.db"
# Prefect's server checks every request against one shared credential; its clients
# (`gradline run`, `gradline serve`, the flow's workers) send theirs from the second.
PREFECT_SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"
PREFECT_CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"


@dataclass(frozen=True)
class UiOptions:
    mlflow_port: int = 5000
    prefect_port: int = 4200
    host: str = "127.0.0.1"  # where MLflow listens; Prefect stays on loopback
    auth: bool = False
    allowed_hosts: str | None = None  # Host headers MLflow accepts besides its defaults
    workers: int = 1  # one uvicorn worker serves a team's UI; MLflow's default 4 cost ~1 GB


class _StopRequested(Exception):
    """SIGTERM or SIGHUP arrived: stop the servers as on Ctrl-C."""


def serve_uis(root: Path, options: UiOptions) -> int:
    """Run both servers until a stop signal (exit 0) or until one exits on its own (exit 1)."""
    _check_host(options)
    prefect_cmd, prefect_env = prefect_server(options)  # first: its credential may be missing
    mlflow_cmd, mlflow_env = mlflow_server(root, options)
    procs: list[subprocess.Popen] = []
    crashed: subprocess.Popen | None = None
    with _stop_signals():
        try:
            procs.append(subprocess.Popen(mlflow_cmd, env=mlflow_env, start_new_session=True))
            procs.append(subprocess.Popen(prefect_cmd, env=prefect_env, start_new_session=True))
            _print_usage(options)
            crashed = _wait_for_first_exit(procs)
        except (KeyboardInterrupt, _StopRequested):
            pass
        finally:
            _ignore_stop_signals()  # a second Ctrl-C must not cut the clean-up short
            stop_servers(procs)
    if crashed is not None:
        name = Path(crashed.args[0]).name
        print(
            f"gradline ui: the {name} server exited with code {crashed.returncode} "
            "(its output is above); the other server was stopped.",
            file=sys.stderr,
        )
        return 1
    return 0


def mlflow_server(root: Path, options: UiOptions) -> tuple[list[str], dict[str, str]]:
    """The `mlflow server` command line and environment for these options."""
    store_dir = root / "mlflow"
    store_dir.mkdir(exist_ok=True)
    cmd = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--backend-store-uri",
        _backend_store_uri(root),
        "--host",
        options.host,
        "--port",
        str(options.mlflow_port),
        "--workers",
        str(options.workers),
    ]
    env = dict(os.environ)
    # The job runner (GenAI judges, trace roll-ups) adds ~8 processes gradline never uses.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    if allowed := _allowed_hosts(options):
        cmd += ["--allowed-hosts", allowed]
    if options.auth:
        # Remote users cannot write to this machine's folders: proxy their artifacts.
        cmd += ["--app-name", "basic-auth", "--artifacts-destination", _artifact_dir(root)]
        env.update(auth_environment(store_dir))
    else:
        cmd += ["--default-artifact-root", _artifact_dir(root)]
    return cmd, env


def prefect_server(options: UiOptions) -> tuple[list[str], dict[str, str]]:
    """`prefect server start` on loopback, its UI told where its API is.

    The UI's API address defaults to PREFECT_API_URL or to PREFECT_SERVER_API_PORT, not to
    `--port`, so without this a UI on any other port calls an API on 4200.
    """
    api_url = f"http://127.0.0.1:{options.prefect_port}/api"
    env = dict(os.environ)
    env.update(
        PREFECT_SERVER_API_HOST="127.0.0.1",
        PREFECT_SERVER_API_PORT=str(options.prefect_port),
        PREFECT_SERVER_UI_API_URL=api_url,
        PREFECT_API_URL=api_url,
    )
    if options.auth:
        env.update(prefect_auth_environment())
    seed_database(default_database())  # a new PREFECT_HOME: no migrations to wait for
    cmd = [str(Path(sys.executable).parent / "prefect"), "server", "start"]
    cmd += ["--host", "127.0.0.1", "--port", str(options.prefect_port)]
    return cmd, env


def prefect_auth_environment() -> dict[str, str]:
    """The Prefect server's credential, from PREFECT_SERVER_API_AUTH_STRING or else the
    client's PREFECT_API_AUTH_STRING (one value, both sides). The server's own services
    call its API too, so they get the client setting as well."""
    credential = os.environ.get(PREFECT_SERVER_AUTH_ENV) or os.environ.get(PREFECT_CLIENT_AUTH_ENV)
    if not credential:
        raise TrackingError(
            "gradline ui --auth protects the Prefect server with one shared credential: "
            f"set {PREFECT_SERVER_AUTH_ENV}=<user>:<password> (e.g. "
            f"`export {PREFECT_SERVER_AUTH_ENV}=team:$(openssl rand -hex 16)`), and give "
            f"clients (gradline run, gradline serve) the same value as {PREFECT_CLIENT_AUTH_ENV}"
        )
    return {PREFECT_SERVER_AUTH_ENV: credential, PREFECT_CLIENT_AUTH_ENV: credential}


def auth_environment(store_dir: Path) -> dict[str, str]:
    """Environment for MLflow's basic-auth app: its user database beside mlflow.db, the
    admin account MLflow creates on first start, and the key for its CSRF tokens."""
    env: dict[str, str] = {}
    own_config = "MLFLOW_AUTH_CONFIG_PATH" not in os.environ  # else the user's, users and all
    if own_config:
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(_write_auth_config(store_dir))
    if not os.environ.get("MLFLOW_FLASK_SERVER_SECRET_KEY"):
        # A key per start is enough: every worker inherits it; sign-ins end on restart.
        env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = secrets.token_hex(32)
    if "MLFLOW_AUTH_ADMIN_PASSWORD" in os.environ:
        return env  # MLflow reads it (and MLFLOW_AUTH_ADMIN_USERNAME) itself
    # The person starting the server becomes its first admin, with the credentials their
    # own MLflow clients send; MLflow ignores them once the admin exists.
    if password := os.environ.get("MLFLOW_TRACKING_PASSWORD"):
        env["MLFLOW_AUTH_ADMIN_PASSWORD"] = password
        env["MLFLOW_AUTH_ADMIN_USERNAME"] = os.environ.get("MLFLOW_TRACKING_USERNAME", "admin")
    elif own_config and not (store_dir / AUTH_DB).exists():
        raise TrackingError(
            "gradline ui --auth creates the MLflow admin account on its first start and "
            "needs its password (12 characters or more): set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD (or MLFLOW_AUTH_ADMIN_USERNAME and "
            "MLFLOW_AUTH_ADMIN_PASSWORD)."
        )
    return env


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each server's process group and every descendant (some may have left the
    group), wait for all of them to exit, SIGKILL what is left after 15 s."""
    family = _descendants(procs)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for child in family:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    deadline = time.monotonic() + 15
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    _, alive = psutil.wait_procs(family, timeout=max(0.1, deadline - time.monotonic()))
    for leftover in alive:
        with contextlib.suppress(psutil.Error):
            leftover.kill()
    for proc in procs:
        _wait_for_group(proc)
        proc.wait()


def _check_host(options: UiOptions) -> None:
    if not options.auth and not _is_loopback(options.host):
        raise TrackingError(
            f"gradline ui --host {options.host} would open the MLflow server to the network "
            "without authentication: add --auth (users then sign in with "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD)."
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _allowed_hosts(options: UiOptions) -> str | None:
    """Host headers MLflow accepts: its defaults (loopback, private addresses), plus this
    machine's names when it listens beyond loopback, plus --allowed-hosts. MLflow's
    --allowed-hosts replaces its defaults, so they are listed again; None keeps them as is.
    Any other Host header (DNS rebinding) gets 403."""
    extra = [name.strip() for name in (options.allowed_hosts or "").split(",") if name.strip()]
    if not _is_loopback(options.host):
        extra.append(socket.gethostname())
        if options.host not in ("0.0.0.0", "::"):
            extra.append(options.host)
    if not extra:
        return None
    # Deferred: mlflow's server package takes seconds to import; only this option needs it.
    from mlflow.server.security_utils import get_default_allowed_hosts

    names = [*get_default_allowed_hosts(), *extra, *(f"{n}:*" for n in extra if ":" not in n)]
    return ",".join(dict.fromkeys(names))


def _backend_store_uri(root: Path) -> str:
    """MLFLOW_TRACKING_URI when it names a store; a client's http(s) URI (set to reach this
    very server) cannot be a server's store, so the project's SQLite store then."""
    uri = default_tracking_uri(root)
    if uri.startswith(("http://", "https://")):
        return f"sqlite:///{(root / 'mlflow' / 'mlflow.db').resolve()}"
    return uri


def _artifact_dir(root: Path) -> str:
    return (root / "mlflow" / "artifacts").resolve().as_uri()


def _write_auth_config(store_dir: Path) -> Path:
    """MLflow's auth settings with the user database in the project; no password in it."""
    path = store_dir / AUTH_CONFIG
    path.write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{(store_dir / AUTH_DB).resolve()}\n"
        "admin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # Check each password hash once a minute, not on every request: a training job
        # makes many small requests, each paying for a PBKDF2 hash otherwise.
        "auth_cache_ttl_seconds = 60\n"
    )
    return path


def _print_usage(options: UiOptions) -> None:
    mlflow_url = f"http://{_display_host(options.host)}:{options.mlflow_port}"
    prefect_url = f"http://127.0.0.1:{options.prefect_port}"
    print(f"MLflow UI:  {mlflow_url}")
    # MLflow 3 opens in its GenAI view unless the address or the browser asks otherwise
    # (training.mlops.lineage.MODEL_TRAINING_VIEW): say where runs and models are.
    print(
        "            gradline's runs and models: the sidebar's Model training switch (the "
        "browser keeps it); links gradline prints open there"
    )
    print(f"Prefect UI: {prefect_url}")
    print(
        "Runs show up in this Prefect UI when started with "
        f"PREFECT_API_URL={prefect_url}/api (gradline run, gradline serve)."
    )
    if options.auth:
        print(
            "MLflow asks for a user name and password. Point clients at it with\n"
            f"  MLFLOW_TRACKING_URI={mlflow_url}\n"
            "  MLFLOW_TRACKING_USERNAME=<user> MLFLOW_TRACKING_PASSWORD=<password>\n"
            f"The admin adds users at {mlflow_url}/signup or with mlflow.server.get_app_client.\n"
            f"Prefect asks for its shared credential: clients set {PREFECT_CLIENT_AUTH_ENV} "
            f"to the value of {PREFECT_SERVER_AUTH_ENV} here."
        )
    print("Ctrl-C (or SIGTERM) stops both.", flush=True)


def _display_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return socket.gethostname()  # no DNS look-up: this machine may be offline
    return f"[{host}]" if ":" in host else host


def _wait_for_first_exit(procs: list[subprocess.Popen]) -> subprocess.Popen:
    while True:
        for proc in procs:
            if proc.poll() is not None:
                return proc
        time.sleep(0.5)


def _descendants(procs: list[subprocess.Popen]) -> list[psutil.Process]:
    family: list[psutil.Process] = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            family += psutil.Process(proc.pid).children(recursive=True)
    return family


@contextlib.contextmanager
def _stop_signals():
    """Turn SIGTERM and SIGHUP into an exception, so they stop the servers as Ctrl-C does."""

    def request_stop(signum: int, _frame) -> None:
        raise _StopRequested(signal.Signals(signum).name)

    previous = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGINT)}
    for sig in STOP_SIGNALS:
        signal.signal(sig, request_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore_stop_signals() -> None:
    for sig in (*STOP_SIGNALS, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _wait_for_group(leader: subprocess.Popen, timeout: float = 10.0) -> None:
    """Return once every process of the leader's group is gone (server workers outlive
    their parent by a moment, holding the port); kill what is left after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Reap the leader as soon as it ends: until then it is a zombie, still in its
        # group, and the group would look alive for the whole timeout.
        leader.poll()
        try:
            os.killpg(leader.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader.pid, signal.SIGKILL)
