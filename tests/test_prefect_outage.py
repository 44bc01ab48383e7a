"""A served or terminal run meets its Prefect server: an outage while it trains (a short
one is waited out, a long one ends the run with what to do, and the next run skips what
finished), and a cancel from Prefect of a served deployment's run (the whole tree stops,
training checkpoints first, and the next run resumes)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.test_orchestration import BIN, _env, _processes_marked, _project
from tests.test_watchdog import _wait_for, running_prefect_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
SLOW = "slow:rank=0:step=0:seconds=0.3"  # training outlasts the outage, or the cancel


@pytest.fixture
def prefect_server(tmp_path):
    yield from running_prefect_server(tmp_path)


def _describe(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        try:
            lines.append(
                f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ')!r}"
            )
        except OSError:
            continue
    return "\n".join(lines)


def _run_again(root, server) -> str:
    """`gradline run` to its end, which must be a success; its output."""
    again = subprocess.run(
        [str(BIN / "gradline"), "run"],
        cwd=root,
        env=_env(root, server.api),
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-6000:]
    return out


def _start_run(root, server, tmp_path, mark: str, **extra: str):
    log_path = tmp_path / f"{root.name}.log"
    with log_path.open("w") as log:
        run = subprocess.Popen(
            [str(BIN / "gradline"), "run"],
            cwd=root,
            env=_env(root, server.api, GRADLINE_TEST_MARK=mark, **extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def training() -> bool:
        assert run.poll() is None, log_path.read_text()
        return any(root.glob("checkpoints/*/step-*[0-9]"))

    _wait_for("training is under way", training, 300, log_path.read_text)
    return run, log_path


def test_prefect_server_outages_during_training(tmp_path, prefect_server) -> None:
    server = prefect_server
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    try:
        # A restart (20 s down) while the stage trains: the run waits it out.
        root = _project(tmp_path / "short", **{"data.max_rows": 600})
        run, log = _start_run(root, server, tmp_path, mark, GRADLINE_FAULT=SLOW)
        server.stop()
        time.sleep(20)
        server.start()
        assert run.wait(timeout=400) == 0, log.read_text()[-6000:]
        assert "model version  gradline-digits v1" in log.read_text()

        # Down for longer than the client waits: the run ends saying so, exit 75.
        root = _project(tmp_path / "long", **{"data.max_rows": 600})
        run, log = _start_run(
            root, server, tmp_path, mark, GRADLINE_FAULT=SLOW, PREFECT_CLIENT_MAX_RETRIES="1"
        )
        server.stop()
        code = run.wait(timeout=400)
        output = log.read_text()
        assert code == 75, output[-6000:]
        assert "the Prefect API at" in output and "stopped answering" in output
        assert "run `gradline run` again" in output
        assert _processes_marked(mark) == []  # nothing of the run goes on
        server.start()
        out = _run_again(root, server)
        # Training had finished (DVC recorded it) or resumes: never from step 0 again.
        assert "Stage 'train' didn't change, skipping" in out or "(resumed)" in out, out[-6000:]
    finally:
        for pid in _processes_marked(mark):
            os.kill(pid, signal.SIGKILL)


def test_a_cancel_from_prefect_stops_a_served_run_and_the_next_run_resumes(
    tmp_path, prefect_server
) -> None:
    from prefect.exceptions import ObjectNotFound

    server = prefect_server
    root = _project(tmp_path / "served", **{"data.max_rows": 600})
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    serve_log = tmp_path / "serve.log"
    with serve_log.open("w") as log:
        serve = subprocess.Popen(
            [str(BIN / "gradline"), "serve"],
            cwd=root,
            env=_env(
                root,
                server.api,
                GRADLINE_TEST_MARK=mark,
                GRADLINE_FAULT="slow:rank=0:step=0:seconds=0.3",
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with server.client() as client:

            def deployment():
                assert serve.poll() is None, serve_log.read_text()
                try:
                    return client.read_deployment_by_name("gradline/nightly")
                except ObjectNotFound:
                    return None

            nightly, _ = _wait_for("the deployment is served", deployment, 120)
            flow_run = client.create_flow_run_from_deployment(nightly.id)

            def training() -> bool:
                assert serve.poll() is None, serve_log.read_text()
                return any(root.glob("checkpoints/*/step-*[0-9]"))

            _wait_for("the served run trains", training, 300, serve_log.read_text)
            cancel = subprocess.run(
                [str(BIN / "prefect"), "flow-run", "cancel", str(flow_run.id)],
                env=_env(root, server.api),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert cancel.returncode == 0, cancel.stdout + cancel.stderr
            state = lambda: client.read_flow_run(flow_run.id).state  # noqa: E731
            _, took = _wait_for(
                "the run is Cancelled",
                lambda: state().type.value == "CANCELLED",
                180,
                serve_log.read_text,
            )
        print(f"a cancel from Prefect stopped the served run in {took:.1f} s")
        output = serve_log.read_text()
        assert "stopped on request at step" in output, output[-6000:]  # checkpointed first
        stopped_step = int(output.split("stopped on request at step ")[1].split(";")[0])
        # Nothing of the run is left, soon: only `gradline serve` itself carries the mark.
        _wait_for(
            "the run's processes end",
            lambda: _processes_marked(mark) == [serve.pid],
            30,
            lambda: _describe(_processes_marked(mark)),
        )
        serve.send_signal(signal.SIGINT)  # Ctrl-C to serve: it ends, and nothing of it stays
        serve.wait(timeout=60)
        assert _processes_marked(mark) == []
        out = _run_again(root, server)
        assert f"at step {stopped_step}" in out, out[-6000:]  # resumed where it stopped
    finally:
        for pid in _processes_marked(mark):
            os.kill(pid, signal.SIGKILL)
