"""Team servers, as a team sets them up: the pipeline against a real MLflow tracking server
with basic auth and an S3-compatible DVC remote (moto's server mode), both on 127.0.0.1.

The servers' credentials are generated here; none of them may turn up in what the
pipeline records or prints (params, tags, run names, artifacts, logs, summaries, files).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from .conftest import SMALL, _env, copy_project, http_status
from .test_e2e import _dvc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

BUCKET, PREFIX = "gradline-data", "store"
TRAINER = "trainer"


@dataclass
class Servers:
    mlflow_port: int
    s3_port: int
    admin_password: str
    trainer_password: str
    s3_key_id: str
    s3_secret: str
    backend: Path  # the tracking server's files: its store and the artifacts it keeps

    @property
    def tracking_uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def secrets(self) -> dict[str, str]:
        return {
            "admin password": self.admin_password,
            "trainer password": self.trainer_password,
            "S3 secret key": self.s3_secret,
        }


def _secret(nbytes: int) -> str:
    """A random secret that never starts with a dash: the CLIs these tests call (dvc
    remote modify ...) would read one that does as an option (1 run in 64 failed so)."""
    return "k" + secrets.token_urlsafe(nbytes)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(cmd: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """A server in its own process group (it forks workers), output to `log`."""
    with log.open("w") as out:
        return subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _wait_until_up(procs: dict[str, tuple[subprocess.Popen, int, Path]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = dict(procs)
    while waiting:
        for name, (proc, port, log) in list(waiting.items()):
            assert proc.poll() is None, f"{name} exited:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(OSError):
                if http_status(port, "/health" if name == "mlflow" else "/") == 200:
                    del waiting[name]
        assert time.monotonic() < deadline, f"not up after {timeout_s} s: {sorted(waiting)}"
        time.sleep(0.5)


def _auth_config(base: Path, admin_password: str) -> Path:
    """MLflow's basic_auth.ini: the admin is created with this password on first start."""
    ini = base / "basic_auth.ini"
    ini.write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{base / 'auth.db'}\n"
        "admin_username = admin\n"
        f"admin_password = {admin_password}\n"
        # Without it every request re-hashes the password (PBKDF2): the tracking helper's
        # many small requests would spend most of their time there.
        "auth_cache_ttl_seconds = 60\n"
    )
    return ini


@contextlib.contextmanager
def _as_user(servers: Servers, user: str, password: str):
    """MLflow clients made inside authenticate as `user`, the way a user's shell would."""
    env = {
        "MLFLOW_TRACKING_URI": servers.tracking_uri,
        "MLFLOW_TRACKING_USERNAME": user,
        "MLFLOW_TRACKING_PASSWORD": password,
    }
    with mock.patch.dict(os.environ, env):
        yield


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The MLflow basic-auth server (one worker, no job runner) and moto's S3 server, with
    a `trainer` user made by the admin and an empty bucket."""
    for module, extra in (("moto.server", "moto[server]"), ("dvc_s3", "dvc-s3")):
        pytest.importorskip(module, reason=f"the team-server tests need {extra}")
    pytest.importorskip("flask_wtf", reason="MLflow's basic-auth app needs mlflow[auth]")
    base = tmp_path_factory.mktemp("servers")
    team = Servers(
        mlflow_port=_free_port(),
        s3_port=_free_port(),
        admin_password=_secret(18),
        trainer_password=_secret(18),
        s3_key_id="AKIA" + secrets.token_hex(8).upper(),
        s3_secret=_secret(30),
        backend=base / "backend",
    )
    team.backend.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_"))}
    mlflow_env = {
        **env,
        "MLFLOW_AUTH_CONFIG_PATH": str(_auth_config(base, team.admin_password)),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),  # the auth app's CSRF key
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # no job-runner processes
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    mlflow_cmd = [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth"]
    mlflow_cmd += ["--host", "127.0.0.1", "--port", str(team.mlflow_port), "--workers", "1"]
    mlflow_cmd += ["--backend-store-uri", f"sqlite:///{team.backend / 'mlflow.db'}"]
    mlflow_cmd += ["--artifacts-destination", str(team.backend / "artifacts")]
    moto_cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(team.s3_port)]
    started = {
        "mlflow": (_start(mlflow_cmd, base / "mlflow.log", mlflow_env, base), team.mlflow_port),
        "s3": (_start(moto_cmd, base / "s3.log", env, base), team.s3_port),
    }
    try:
        try:
            _wait_until_up(
                {name: (p, port, base / f"{name}.log") for name, (p, port) in started.items()}, 150
            )
            _make_trainer(team)
            _s3(team).create_bucket(Bucket=BUCKET)
        except Exception:
            for name in started:  # shown with the error: why a server did not serve
                print(f"--- {name} server log ---\n{(base / f'{name}.log').read_text()[-3000:]}")
            raise
        yield team
    finally:
        for proc, _ in started.values():
            _stop(proc)


def _make_trainer(servers: Servers) -> None:
    """What the admin does for a teammate: a user of their own (default permission READ;
    the experiments and models it creates it may manage)."""
    from mlflow.server import get_app_client

    with _as_user(servers, "admin", servers.admin_password):
        auth = get_app_client("basic-auth", tracking_uri=servers.tracking_uri)
        auth.create_user(TRAINER, servers.trainer_password)


def _s3(servers: Servers):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=servers.s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id=servers.s3_key_id,
        aws_secret_access_key=servers.s3_secret,
    )


def _use_team_remote(root: Path, servers: Servers) -> None:
    """`dvc remote add` as the docs say: the endpoint in .dvc/config (committed), the keys
    in .dvc/config.local (git-ignored)."""
    _dvc(root, "remote", "add", "-d", "team", f"s3://{BUCKET}/{PREFIX}")
    _dvc(root, "remote", "modify", "team", "endpointurl", servers.s3_endpoint)
    _dvc(root, "remote", "modify", "--local", "team", "access_key_id", servers.s3_key_id)
    _dvc(root, "remote", "modify", "--local", "team", "secret_access_key", servers.s3_secret)


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    return subprocess.run([*git, *args], cwd=root, capture_output=True, text=True, check=True)


@pytest.fixture(scope="module")
def team_run(servers, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, str]:
    """A project that ran the pipeline once against the team servers, as `trainer`:
    (root, the CLI's output, run id)."""
    root = copy_project(tmp_path_factory.mktemp("team") / "gradline")
    _use_team_remote(root, servers)
    # Its own temporary Prefect server: the test reads that server's database for leaks.
    env = _env(root, shared_server=False) | {
        "MLFLOW_TRACKING_URI": servers.tracking_uri,
        "MLFLOW_TRACKING_USERNAME": TRAINER,
        "MLFLOW_TRACKING_PASSWORD": servers.trainer_password,
    }
    gradline = str(Path(sys.executable).parent / "gradline")
    proc = subprocess.run(
        [gradline, "run", *SMALL], cwd=root, env=env, capture_output=True, text=True, timeout=360
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = json.loads((root / "result.json").read_text())["run_id"]
    return root, proc, run_id


def test_server_refuses_foreign_hosts_and_anonymous_requests(servers) -> None:
    port, path = servers.mlflow_port, "/api/2.0/mlflow/experiments/search?max_results=1"
    admin = ("admin", servers.admin_password)
    assert http_status(port, path, admin) == 200
    assert http_status(port, path) == 401  # no credentials
    assert http_status(port, path, ("admin", "wrong-" + servers.admin_password)) == 401
    # DNS rebinding: a page on evil.example resolving to 127.0.0.1 is refused, even with
    # (browser-cached) credentials; loopback names are allowed by default.
    assert http_status(port, path, admin, host="evil.example") == 403
    assert http_status(port, path, host=f"evil.example:{port}") == 403
    assert http_status(port, path, admin, host=f"localhost:{port}") == 200


def test_pipeline_runs_against_the_team_servers(servers, team_run, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    root, proc, run_id = team_run
    assert "gradline run complete" in proc.stdout
    assert f"tracking store {servers.tracking_uri}" in proc.stdout
    with _as_user(servers, TRAINER, servers.trainer_password):
        client = MlflowClient(servers.tracking_uri, registry_uri=servers.tracking_uri)
        run = client.get_run(run_id)
        (found,) = client.search_model_versions(f"name='gradline-digits' and run_id='{run_id}'")
        version = client.get_model_version(found.name, found.version)  # with tags and aliases
        artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert run.info.status == "FINISHED"
    assert "gradline.gate" in version.tags and version.aliases
    assert {"checkpoints", "evaluation"} <= artifacts
    # The ingested data went to the S3 remote (not the default local one) ...
    listed = _s3(servers).list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/")
    assert listed.get("KeyCount", 0) > 0
    assert not (root / ".dvcstore").exists()
    # ... and a teammate's fresh clone gets it back with `dvc pull`, given their own keys.
    _git(root, "add", "dvc.lock", "params.yaml", ".dvc/config")
    _git(root, "commit", "-qm", "run on the team servers")
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", str(root), str(clone))
    assert not (clone / ".dvc" / "config.local").exists()
    _dvc(clone, "remote", "modify", "--local", "team", "access_key_id", servers.s3_key_id)
    _dvc(clone, "remote", "modify", "--local", "team", "secret_access_key", servers.s3_secret)
    _dvc(clone, "pull", "ingest")
    original = _contents(root / "data" / "raw")
    assert original and _contents(clone / "data" / "raw") == original


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _recorded_strings(servers: Servers) -> list[str]:
    """Every param, tag, run name and description on the tracking server, read as the admin."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    with _as_user(servers, "admin", servers.admin_password):
        client = MlflowClient(servers.tracking_uri, registry_uri=servers.tracking_uri)
        experiments = client.search_experiments()
        ids = [e.experiment_id for e in experiments]
        runs = client.search_runs(ids, run_view_type=ViewType.ALL, max_results=1000)
        models = client.search_logged_models(ids)
        versions = client.search_model_versions()
        registered = client.search_registered_models()
    found = [e.name for e in experiments] + [json.dumps(e.tags) for e in experiments]
    for run in runs:
        found += [run.info.run_name, json.dumps(run.data.params), json.dumps(run.data.tags)]
    for model in models:
        found += [model.name, json.dumps(model.params), json.dumps(model.tags)]
    for item in [*versions, *registered]:
        found += [item.name, item.description or "", json.dumps(item.tags)]
    assert runs and versions, "nothing recorded: the search reads the wrong server"
    return found


def test_credentials_never_leak(servers, team_run) -> None:
    root, proc, run_id = team_run
    recorded = "\n".join(_recorded_strings(servers))
    # Byte for byte: the project (results, params.yaml, dvc.lock, the model, checkpoints,
    # the tracking journal, Prefect's database with the task logs and the summary
    # artifact) but git's compressed objects, and the tracking server's store and artifacts.
    in_project = _search_files(root, skip_dirs=(root / ".git",))
    on_server = _search_files(servers.backend)
    # The searches see what they must: the run in Prefect's logs and in the server's store,
    # and the S3 key where the user put it, in the git-ignored .dvc/config.local alone.
    assert any(path.startswith(".prefect-home/") for path in in_project(run_id))
    assert on_server(run_id)
    assert in_project(servers.s3_secret) == [".dvc/config.local"]
    assert _git(root, "check-ignore", ".dvc/config.local").returncode == 0
    for name, secret in servers.secrets.items():
        assert secret not in recorded, f"the {name} is in a param, tag or name on the server"
        assert secret not in proc.stdout + proc.stderr, f"the {name} is in the pipeline's output"
        assert on_server(secret) == [], f"the {name} is in the server's files"
        if secret != servers.s3_secret:
            assert in_project(secret) == [], f"the {name} is in the project's files"


def _search_files(folder: Path, skip_dirs: tuple[Path, ...] = ()):
    """A search of every file under `folder` (but those under `skip_dirs`) for a string:
    it returns the paths, relative to `folder`, of the files that hold it."""
    files = [p for p in folder.rglob("*") if not any(d in p.parents for d in skip_dirs)]
    contents = {p: p.read_bytes() for p in files if p.is_file()}
    assert contents, f"nothing to search under {folder}"

    def holding(text: str) -> list[str]:
        needle = text.encode()
        return sorted(str(p.relative_to(folder)) for p, data in contents.items() if needle in data)

    return holding


def test_credentials_in_a_tracking_uri_move_to_mlflows_variables() -> None:
    """A URI that carries the credentials (which MLflow accepts) is cleaned before anything
    runs, so neither MLflow's own "View run at" links nor gradline's output show them."""
    from flows.environment import move_uri_credentials

    environ = {"MLFLOW_TRACKING_URI": "https://trainer:s3cr%40t@mlflow.team.example:8443/"}
    move_uri_credentials(environ)
    assert environ == {
        "MLFLOW_TRACKING_URI": "https://mlflow.team.example:8443/",
        "MLFLOW_TRACKING_USERNAME": "trainer",
        "MLFLOW_TRACKING_PASSWORD": "s3cr@t",
    }
    for plain in ("http://127.0.0.1:5000", "sqlite:////tmp/a@b/mlflow.db"):
        environ = {"MLFLOW_TRACKING_URI": plain}
        move_uri_credentials(environ)
        assert environ == {"MLFLOW_TRACKING_URI": plain}


def test_tracking_uri_credentials_are_redacted_where_shown() -> None:
    """Where a URI is shown (summaries, links, errors), its credentials are not."""
    from training.mlops.lineage import run_url, ui_base
    from training.mlops.tracking import redact_uri

    uri = "https://trainer:s3cr3t-pw@mlflow.team.example:8443/"
    assert redact_uri(uri) == "https://mlflow.team.example:8443/"
    assert "s3cr3t" not in run_url(ui_base(uri, "http://127.0.0.1:5000"), "1", "abc")
    for plain in ("http://127.0.0.1:5000", "sqlite:////tmp/x/mlflow.db", "databricks"):
        assert redact_uri(plain) == plain
