"""DVC remote failures: a push that does not reach the remote registers nothing and says
why; a rerun pushes what is missing; `dvc pull` in a fresh clone gets every output back
byte for byte.

The causes are classified from real `dvc push` runs: a path under a regular file, a
closed port and a tiny HTTP server on 127.0.0.1 (403, dropped connections), a small
tmpfs (full) and a read-only one, both mounted in a mount namespace of the test's own
(`unshare -m` as root, else `unshare -rm`), so nothing outside the test is touched.
The flow tests run the real `gradline run` against a local remote whose folder cannot
be made, then against a 256 KiB tmpfs that holds the data but not the model.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tasks.dvc_stages import default_remote
from training.errors import USER_ERROR_EXIT_CODE, RemotePushFailed, is_retryable
from training.mlops.remote import classify, failed_files, push_failed

from .conftest import copy_project
from .servers import SharedPrefect
from .test_lasting_failures import _namespace
from .test_orchestration import _processes_marked

BIN = Path(sys.executable).parent
DVC = [sys.executable, "-m", "dvc"]
# Small and quick, as the other e2e tests: ~56 s a run here, most of it start-up.
SMALL = ["--set", "data.max_rows=500", "--set", "train.epochs=4"]
SMALL += ["--set", "runtime.procs_per_node=1"]
MODEL = "gradline-digits"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env["PATH"] = str(BIN) + os.pathsep + env["PATH"]
    env["DVC_NO_ANALYTICS"] = "1"
    env.update(extra)
    return env


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*DVC, *args], cwd=root, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


# --- the cause, from real `dvc push` runs ------------------------------------------------


@pytest.fixture(scope="module")
def dvc_repo(tmp_path_factory) -> Path:
    """A DVC repo with a 300 KB file and a folder of five 50 KB files in its cache."""
    repo = tmp_path_factory.mktemp("dvc-repo")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    _dvc(repo, "init", "-q")
    (repo / "big.bin").write_bytes(os.urandom(300_000))
    (repo / "parts").mkdir()
    for i in range(5):
        (repo / "parts" / f"p{i}").write_bytes(os.urandom(50_000))
    _dvc(repo, "add", "-q", "big.bin", "parts")
    return repo


def _push_to(repo: Path, url: str) -> tuple[str, int]:
    """`dvc push` to `url` as the default remote: (stdout and stderr, exit code)."""
    _dvc(repo, "remote", "add", "-f", "-d", "store", url)
    proc = subprocess.run(
        [*DVC, "push"], cwd=repo, env=_env(), capture_output=True, text=True, timeout=120
    )
    return proc.stdout + proc.stderr, proc.returncode


def _error(repo: Path, output: str, code: int) -> RemotePushFailed:
    """The error the flow raises, built as tasks.dvc_stages.push_to_remote builds it."""
    return push_failed(*default_remote(repo), output, code, failed_files(output))


def test_a_remote_path_under_a_file_does_not_exist_and_no_retry_helps(dvc_repo, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    output, code = _push_to(dvc_repo, str(blocker / "store"))
    assert code != 0
    error = _error(dvc_repo, output, code)
    assert error.cause == "the remote's path does not exist" and not is_retryable(error)
    assert f"remote 'store' ({blocker}/store)" in str(error)
    assert "dvc remote modify store url" in str(error) and "Nothing was registered" in str(error)
    assert error.exit_code == USER_ERROR_EXIT_CODE


def test_a_closed_port_is_unreachable_and_worth_a_retry(dvc_repo):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    output, code = _push_to(dvc_repo, f"http://127.0.0.1:{port}/store")
    error = _error(dvc_repo, output, code)
    assert error.cause == "the remote is unreachable" and is_retryable(error), output
    assert error.missing == 7 and "7 file(s) did not reach it" in str(error)


class _Remote:
    """An HTTP remote on 127.0.0.1 that refuses uploads (403) or drops the connection."""

    def __init__(self, mode: str) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self) -> None:
                if mode == "drop" and self.command == "POST":
                    self.connection.shutdown(socket.SHUT_RDWR)  # mid-upload, as a reset
                    self.close_connection = True
                    return
                # Read the upload before refusing it, as a real server does: answering
                # first and closing races the client's write (a broken pipe, not a 403).
                self.drain_body()
                self.send_response(403 if mode == "forbid" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def drain_body(self) -> None:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        self.rfile.read(size + 2)  # the chunk and its CRLF
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers, up to the blank line
                    return
                self.rfile.read(int(self.headers.get("Content-Length") or 0))

            do_GET = do_HEAD = do_POST = do_PUT = answer

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _Remote:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def test_a_refused_upload_is_permission_denied_and_credentials_never_show(dvc_repo):
    with _Remote("forbid") as remote:
        url = f"http://alice:s3cret@127.0.0.1:{remote.port}/store"
        output, code = _push_to(dvc_repo, url)
    error = _error(dvc_repo, output, code)
    assert error.cause == "permission denied on the remote" and not is_retryable(error), output
    assert f"(http://127.0.0.1:{remote.port}/store)" in str(error)
    assert "s3cret" not in str(error) and "alice" not in str(error)
    assert "403" in str(error)  # DVC's own words follow


def test_a_dropped_connection_is_an_interrupted_push_worth_a_retry(dvc_repo):
    with _Remote("drop") as remote:
        output, code = _push_to(dvc_repo, f"http://127.0.0.1:{remote.port}/store")
    error = _error(dvc_repo, output, code)
    assert error.cause == "the push was interrupted" and is_retryable(error), output
    assert error.exit_code == 75  # EX_TEMPFAIL: a scheduler may try again


def test_a_push_killed_by_a_signal_was_interrupted():
    for code in (-15, -9, 130, 143):
        assert classify("ERROR: No space left on device", code).name == "the push was interrupted"


# One namespace, both mounts: the tmpfs lives as long as the namespace.
_FULL_AND_READ_ONLY = """
set -u
mount -t tmpfs -o size=200k gradline-remote "$MNT"
$DVC remote add -f -d store "$MNT/store"
$DVC push > "$OUT/full.log" 2>&1; echo $? > "$OUT/full.code"
mount -o remount,ro "$MNT"
$DVC push > "$OUT/ro.log" 2>&1; echo $? > "$OUT/ro.code"
"""


def test_a_full_or_read_only_remote_is_the_users_to_fix(dvc_repo, tmp_path):
    out, mnt = tmp_path / "out", tmp_path / "mnt"
    out.mkdir()
    mnt.mkdir()
    env = _env(MNT=str(mnt), OUT=str(out), DVC=shlex.join(DVC))
    script = ["bash", "-c", _FULL_AND_READ_ONLY]
    done = subprocess.run([*_namespace(), *script], cwd=dvc_repo, env=env, timeout=120)
    assert done.returncode == 0
    full = (out / "full.log").read_text()
    error = _error(dvc_repo, full, int((out / "full.code").read_text()))
    assert error.cause == "no space left on the remote" and not is_retryable(error), full
    assert error.missing and error.missing > 0 and "free space on the remote" in str(error)
    read_only = (out / "ro.log").read_text()
    error = _error(dvc_repo, read_only, int((out / "ro.code").read_text()))
    assert error.cause == "permission denied on the remote", read_only


# --- the flow: nothing registered, a rerun pushes the rest, `dvc pull` gets it all -------


def _gradline_run(root: Path, mark: str) -> subprocess.CompletedProcess:
    """A run against the test run's shared Prefect server (its temporary one is not what
    these tests are about), followed by its mark: its stage host is its own."""
    env = _env(
        PREFECT_HOME=str(root / ".prefect-home"),
        PREFECT_API_URL=SharedPrefect.api(),
        GRADLINE_TEST_MARK=mark,
    )
    return subprocess.run(
        [str(BIN / "gradline"), "run", *SMALL],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )


def _versions(root: Path, db: Path | None = None) -> list:
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{db or root / 'mlflow' / 'mlflow.db'}"
    return MlflowClient(tracking_uri=store, registry_uri=store).search_model_versions(
        f"name='{MODEL}'"
    )


def _cached_outputs(root: Path) -> list[str]:
    """Every output dvc.yaml declares that DVC caches (and so pushes); metrics and plots
    are `cache: false` there."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    declared = [out for stage in stages.values() for out in stage.get("outs", [])]
    entries = [out if isinstance(out, dict) else {out: {}} for out in declared]
    return [path for e in entries for path, opts in e.items() if (opts or {}).get("cache", True)]


def _digests(root: Path, outputs: list[str]) -> dict[str, str]:
    files = [p for out in outputs for p in sorted((root / out).rglob("*")) if p.is_file()]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _pull_into_fresh_clone(project: Path, remote: Path, fresh: Path) -> None:
    """A clone as a teammate makes it (the committed dvc.lock and params, the remote's
    URL), `dvc pull`, then every pulled file equal by hash to the project's."""
    copy_project(fresh)
    for name in ("dvc.lock", "params.yaml"):
        (fresh / name).write_bytes((project / name).read_bytes())
    _dvc(fresh, "remote", "modify", "--local", "local", "url", str(remote))
    _dvc(fresh, "pull")
    outputs = _cached_outputs(project)
    assert {"data/raw", "data/shards", "model"} <= set(outputs)
    original = _digests(project, outputs)
    assert any(path.startswith("model/") for path in original)
    assert _digests(fresh, outputs) == original


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_remote_that_cannot_be_made_fails_the_push_and_a_fixed_rerun_pulls_back(tmp_path):
    project = copy_project(tmp_path / "gradline")
    blocker = tmp_path / "not-a-folder"  # a typo'd path: a file where a folder should be
    blocker.write_text("")
    _dvc(project, "remote", "modify", "--local", "local", "url", str(blocker / "store"))
    mark = f"{os.getpid()}-{time.monotonic_ns()}"

    first = _gradline_run(project, mark)
    said = first.stdout + first.stderr
    assert first.returncode == USER_ERROR_EXIT_CODE, said[-4000:]
    assert "RemotePushFailed" in said and "dvc-push-data" in said
    assert f"gradline: error: `dvc push` to remote 'local' ({blocker}/store) failed" in first.stderr
    assert "the remote's path does not exist" in first.stderr
    assert "Retry 1/2" not in said  # no retry can create the folder: none was spent
    assert _versions(project) == []

    remote = tmp_path / "remote"
    _dvc(project, "remote", "modify", "--local", "local", "url", str(remote))
    second = _gradline_run(project, mark)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert f"model version  {MODEL} v1" in second.stdout
    assert len(_versions(project)) == 1
    assert _processes_marked(mark) == []  # nothing either run started is left
    _pull_into_fresh_clone(project, remote, tmp_path / "fresh")


# Both runs inside one mount namespace: the tmpfs lives as long as the namespace; what
# it holds at the end is copied out for the fresh clone to pull from.
_FULL_THEN_GROWN = """
set -u
mount -t tmpfs -o size=256k gradline-remote "$REMOTE"
$RUN > "$OUT/first.log" 2>&1; echo $? > "$OUT/first.code"
df -B1 --output=size,used "$REMOTE" > "$OUT/first.df"
cp mlflow/mlflow.db "$OUT/after-first.db"
mount -o remount,size=16m "$REMOTE"
$RUN > "$OUT/second.log" 2>&1; echo $? > "$OUT/second.code"
cp -a "$REMOTE/store" "$OUT/store"
"""


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_full_remote_registers_nothing_and_a_grown_one_gets_just_what_is_missing(tmp_path):
    project = copy_project(tmp_path / "gradline")
    remote, out = tmp_path / "remote", tmp_path / "out"
    remote.mkdir()
    out.mkdir()
    _dvc(project, "remote", "modify", "--local", "local", "url", str(remote / "store"))
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    env = _env(
        REMOTE=str(remote),
        OUT=str(out),
        RUN=shlex.join([str(BIN / "gradline"), "run", *SMALL]),
        PREFECT_HOME=str(project / ".prefect-home"),
        PREFECT_API_URL=SharedPrefect.api(),  # a mount namespace: the same loopback
        GRADLINE_TEST_MARK=mark,
    )
    script = ["bash", "-c", _FULL_THEN_GROWN]
    done = subprocess.run([*_namespace(), *script], cwd=project, env=env, timeout=840)
    assert done.returncode == 0

    first = (out / "first.log").read_text()
    assert (out / "first.code").read_text().strip() == str(USER_ERROR_EXIT_CODE), first[-4000:]
    # The data went up at push-data; the model did not fit at the final push.
    assert "Task run 'push' - Finished in state Failed" in first, first[-4000:]
    error = next(line for line in first.splitlines() if line.startswith("gradline: error:"))
    assert f"remote 'local' ({remote}/store)" in error and "no space left on the remote" in error
    assert "Retry 1/2" not in first  # a full disk stays full: no retry spent
    missing = int(error.split(" file(s) did not reach it")[0].rsplit(" ", 1)[1])
    assert missing > 0
    assert _versions(project, out / "after-first.db") == []  # the run is there, no version

    second = (out / "second.log").read_text()
    assert (out / "second.code").read_text().strip() == "0", second[-4000:]
    assert "Running stage" not in second  # every stage up to date: only the push is new
    # Exactly what was missing went up (DVC says "1 file pushed", "3 files pushed").
    assert re.search(rf"Task run 'push' - {missing} files? pushed", second), second[-4000:]
    assert len(_versions(project)) == 1
    assert _processes_marked(mark) == []
    _pull_into_fresh_clone(project, out / "store", tmp_path / "fresh")
