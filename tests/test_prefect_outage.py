"""A served or terminal run meets its Prefect server: an outage while it trains (a short
one is waited out, a long one ends the run with what to do, and the next run skips what
finished), and a cancel from Prefect of a served deployment's run (the whole tree stops,
training checkpoints first, and the next run resumes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.servers import running_prefect_server, wait_for
from tests.test_orchestration import BIN, _env, _processes_marked, _project

from .resume_checks import Resumed, assert_resumed, job_of_run, resumes_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
SLOW = "slow:rank=0:step=0:seconds=0.3"  # training outlasts the outage, or the cancel


@pytest.fixture
def prefect_server(tmp_path):
    yield from running_prefect_server(tmp_path)


def _describe(pids: list[int]) -> str:
    return "\n".join(f"{pid}: {b' '.join(argv)!r}" for pid in pids if (argv := _argv(pid)))


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

    wait_for("training is under way", training, 300, log_path.read_text)
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
        # Training had finished (DVC recorded it: the stage or the whole run is skipped)
        # or it resumes: never from step 0 again.
        finished = "Stage 'train' didn't change, skipping" in out or '"status": "skipped"' in out
        assert finished or "(resumed)" in out, out[-6000:]
        resumes = resumes_of(_job(root))
        assert len(resumes) == ("(resumed)" in out), resumes
        assert all(r.written_by == r.resumed_by == 1 for r in resumes), resumes
        assert_resumed(_job(root), *resumes)  # from a checkpoint past step 0, never before it
    finally:
        for pid in _processes_marked(mark):
            os.kill(pid, signal.SIGKILL)


def test_a_served_run_stopped_by_a_cancel_or_by_ctrl_c_to_serve_resumes(
    tmp_path, prefect_server
) -> None:
    """A cancel from Prefect stops a served run; the next served run resumes it; Ctrl-C
    to `gradline serve` (SIGINT to its process group, as a terminal sends it; SIGTERM
    takes the same path) cancels that one too, and `gradline run` resumes it."""
    server = prefect_server
    root = _project(tmp_path / "served", **{"data.max_rows": 600})
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    serve_log = tmp_path / "serve.log"
    with serve_log.open("w") as log:
        serve = subprocess.Popen(
            [str(BIN / "gradline"), "serve"],
            cwd=root,
            env=_env(root, server.api, GRADLINE_TEST_MARK=mark, GRADLINE_FAULT=SLOW),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with server.client() as client:
            served = _Served(serve, serve_log, client, root)
            first = served.start_run(after_step=0)
            cancel = subprocess.run(
                [str(BIN / "prefect"), "flow-run", "cancel", str(first)],
                env=_env(root, server.api),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert cancel.returncode == 0, cancel.stdout + cancel.stderr
            took = served.wait_cancelled(first)
            print(f"a cancel from Prefect stopped the served run in {took:.1f} s")
            first_stop = served.stopped_step(0)
            served.wait_only_serve_left(mark)

            second = served.start_run(after_step=first_stop)
            assert _resumed_at(served.output(), first_stop), served.output()[-6000:]
            os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C in serve's terminal
            assert serve.wait(timeout=200) == 0, served.output()[-6000:]
            assert client.read_flow_run(second).state.type.value == "CANCELLED"
            second_stop = served.stopped_step(1)
            assert second_stop > first_stop
        assert _processes_marked(mark) == []  # nothing of serve or its runs goes on
        out = _run_again(root, server)
        assert _resumed_at(out, second_stop), out[-6000:]  # where it stopped
        stops = [Resumed(step, written_by=1, resumed_by=1) for step in (first_stop, second_stop)]
        assert_resumed(_job(root), *stops)
    finally:
        for pid in _processes_marked(mark):
            os.kill(pid, signal.SIGKILL)


def _job(root: Path) -> Path:
    """The folder of the job whose run the project's last result names."""
    run_id = json.loads((root / "result.json").read_text())["run_id"]
    return job_of_run(root / "checkpoints", run_id)


def _resumed_at(output: str, step: int) -> bool:
    return re.search(rf"resumed from \S+ at step {step}\b", output) is not None


class _Served:
    """`gradline serve` under test: runs of its `nightly` deployment, and its output."""

    def __init__(self, serve: subprocess.Popen, log: Path, client, root: Path) -> None:
        self.serve, self.log, self.client, self.root = serve, log, client, root

    def output(self) -> str:
        return self.log.read_text()

    def start_run(self, after_step: int):
        """A run of the deployment, once it has checkpointed beyond `after_step`."""
        from prefect.exceptions import ObjectNotFound

        def deployment():
            assert self.serve.poll() is None, self.output()[-6000:]
            try:
                return self.client.read_deployment_by_name("gradline/nightly")
            except ObjectNotFound:
                return None

        nightly, _ = wait_for("the deployment is served", deployment, 120)
        flow_run = self.client.create_flow_run_from_deployment(nightly.id)

        def trained_beyond() -> bool:
            assert self.serve.poll() is None, self.output()[-6000:]
            steps = [int(p.name.split("-")[1]) for p in self.root.glob("checkpoints/*/step-*[0-9]")]
            return max(steps, default=-1) > after_step

        wait_for("the served run trains", trained_beyond, 300, self.output)
        return flow_run.id

    def wait_cancelled(self, flow_run_id) -> float:
        state = lambda: self.client.read_flow_run(flow_run_id).state  # noqa: E731
        _, took = wait_for(
            "the run is Cancelled", lambda: state().type.value == "CANCELLED", 240, self.output
        )
        return took

    def stopped_step(self, which: int) -> int:
        """The step the `which`-th stopped run checkpointed at before it ended."""
        stops = self.output().split("stopped on request at step ")[1:]
        assert len(stops) > which, self.output()[-6000:]
        return int(stops[which].split(";")[0])

    def wait_only_serve_left(self, mark: str) -> None:
        """Nothing of the run is left: only `gradline serve` (its supervisor and the
        command under it) carries the mark."""

        def serve_only() -> bool:
            return all(_argv(pid)[-1:] in ([b"serve"], []) for pid in _processes_marked(mark))

        wait_for(
            "the run's processes end",
            serve_only,
            90,
            lambda: _describe(_processes_marked(mark)),
        )


def _argv(pid: int) -> list[bytes]:
    """The process's arguments; empty once it has ended."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(bytes(1))[:-1]
    except OSError:
        return []
