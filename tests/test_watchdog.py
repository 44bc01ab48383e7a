"""A run that dies without a word (SIGKILL of its whole tree, as when its machine is
lost): its device slots come back though the Prefect server restarted meanwhile, the
server marks its flow run Crashed, and the alert webhook hears of it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from datetime import datetime, timedelta

import pytest
from prefect.client.schemas.sorting import FlowRunSort

from tests.conftest import WebhookReceiver
from tests.servers import running_prefect_server, wait_for
from tests.test_orchestration import BIN, _env, _processes_marked, _project

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture
def prefect_server(tmp_path):
    yield from running_prefect_server(tmp_path)


def test_a_run_killed_without_a_word_frees_its_slots_is_crashed_and_alerts(
    tmp_path, prefect_server
) -> None:
    server = prefect_server
    limit, lease_s = "gradline-lease-devices", 60  # the server's shortest lease
    root = _project(
        tmp_path / "gradline",
        **{
            "data.max_rows": 600,
            "orchestrate.device_limit": limit,
            "orchestrate.device_slots": 1,
            "orchestrate.notify": "env:TEAM_WEBHOOK",
        },
    )
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    try:
        with WebhookReceiver() as hook:
            log_path = tmp_path / "run.log"
            with log_path.open("w") as log:
                run = subprocess.Popen(
                    [str(BIN / "gradline"), "run"],
                    cwd=root,
                    env=_env(
                        root,
                        server.api,
                        TEAM_WEBHOOK=hook.url,
                        GRADLINE_TEST_MARK=mark,
                        # Slow enough to be alive for two heartbeats (30 s apart).
                        GRADLINE_FAULT="slow:rank=0:step=0:seconds=0.5",
                    ),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            output = log_path.read_text

            def holding() -> bool:
                assert run.poll() is None, output()
                return "holding 1 slots" in output()

            wait_for("the run holds its slot", holding, 300, output)
            with server.client() as client:
                (flow_run,) = client.read_flow_runs(limit=10, sort=FlowRunSort.START_TIME_DESC)
                # Alive long enough for a heartbeat after the watchdogs were registered.
                wait_for("a heartbeat", lambda: _heartbeats(client, flow_run.id) >= 2, 120)
            for pid in _processes_marked(mark):  # the machine is lost: all of it at once
                os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            server.stop()  # and the server restarts meanwhile
            server.start()
            with server.client() as client:
                assert client.read_flow_run(flow_run.id).state.type.value == "RUNNING"
                wait_for(
                    "the leaked slot comes back",
                    lambda: client.read_global_concurrency_limit_by_name(limit).active_slots == 0,
                    lease_s + 60,
                    server.log,
                )
                freed = time.monotonic() - killed_at
                state = lambda: client.read_flow_run(flow_run.id).state  # noqa: E731
                wait_for("marked Crashed", lambda: state().type.value == "CRASHED", 240)
                crashed = time.monotonic() - killed_at
                assert "no heartbeat" in state().message
            alerts, _ = wait_for("the crash alert", lambda: list(hook.bodies), 60)
        print(f"after the kill: slot back in {freed:.0f} s, flow run Crashed in {crashed:.0f} s")
        (alert,) = alerts
        assert alert["text"].startswith(f":boom: gradline flow run `{flow_run.name}` crashed")
        assert "no heartbeat" in alert["text"]
        assert _processes_marked(mark) == []
    finally:
        for pid in _processes_marked(mark):
            os.kill(pid, signal.SIGKILL)


def _logged_at(output: str, text: str, after: datetime) -> datetime:
    """When Prefect's log (lines start "HH:MM:SS.fff |", local time) first says `text`,
    as a time after `after`."""
    line = next(line for line in output.splitlines() if text in line)
    stamp = re.search(r"(\d\d:\d\d:\d\d\.\d+) \|", line)
    assert stamp, line
    clock = datetime.strptime(stamp.group(1), "%H:%M:%S.%f").time()
    logged = datetime.combine(after.date(), clock)
    return logged + timedelta(days=1) if logged < after - timedelta(hours=12) else logged


def _heartbeats(client, flow_run_id) -> int:
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    events = client.read_events(
        filter=EventFilter(
            event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
        ),
        limit=50,
    )
    return len(events.events)


def test_a_run_killed_on_a_temporary_server_leaks_nothing_the_next_run_needs(tmp_path) -> None:
    # No PREFECT_API_URL: each run starts its own temporary Prefect server on one shared
    # database, and no server-side service reclaims a dead run's slots there.
    root = _project(
        tmp_path / "gradline",
        **{
            "data.max_rows": 600,
            "orchestrate.device_limit": "gradline-temporary-devices",
            "orchestrate.device_slots": 1,
        },
    )
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    env = _env(root, "", GRADLINE_TEST_MARK=mark)
    del env["PREFECT_API_URL"]
    log_path = tmp_path / "first.log"
    try:
        with log_path.open("w") as log:
            first = subprocess.Popen(
                [str(BIN / "gradline"), "run"],
                cwd=root,
                env={**env, "GRADLINE_FAULT": "slow:rank=0:step=0:seconds=0.3"},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        output = log_path.read_text

        def checkpointed() -> bool:
            assert first.poll() is None, output()
            return "holding 1 slots" in output() and any(root.glob("checkpoints/*/step-*[0-9]"))

        wait_for("the first run trains", checkpointed, 300, output)
        for pid in _processes_marked(mark):  # all of it at once, its Prefect server too
            os.kill(pid, signal.SIGKILL)
        killed_at, killed_clock = time.monotonic(), datetime.now()
        second = subprocess.run(
            [str(BIN / "gradline"), "run"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=500,
        )
        took = time.monotonic() - killed_at
        out = second.stdout + second.stderr
        assert second.returncode == 0, out[-6000:]
        print(f"the next run got the dead run's slot and finished {took:.0f} s after the kill")
        if "waiting for 1 of 1 slots of device quota 'gradline-temporary-devices'" not in out:
            # On a loaded host the next run can reach the quota after the dead run's lease
            # lapsed (60 s, renewed every 20 s: 40 to 60 s after the kill), and then finds
            # its slot free already. Before that, the leaked slot must have held it back.
            held = _logged_at(out, "holding 1 slots of device quota", killed_clock)
            assert held - killed_clock > timedelta(seconds=40), out[-6000:]
        assert "(resumed)" in out  # the dead run's job, continued from its checkpoint
        assert _processes_marked(mark) == []
    finally:
        for pid in _processes_marked(mark):
            os.kill(pid, signal.SIGKILL)


def test_a_schedule_with_no_successful_run_is_reported_stale(
    tmp_path, monkeypatch, prefect_server
) -> None:
    # What `gradline serve` registers for a scheduled deployment, with a window of 11 s
    # instead of two days; no run ever completes.
    from prefect.schedules import Cron
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deploy import _register_watchdogs
    from flows.pipeline import pipeline

    server = prefect_server
    root = _project(
        tmp_path / "gradline",
        **{"orchestrate.notify": "env:TEAM_WEBHOOK", "orchestrate.stale_after_h": 0.003},
    )
    with WebhookReceiver() as hook, temporary_settings({PREFECT_API_URL: server.api}):
        monkeypatch.setenv("TEAM_WEBHOOK", hook.url)
        nightly = pipeline.to_deployment(name="nightly", schedules=[Cron("0 2 * * *")])
        _register_watchdogs(root, [nightly])
        (alert,), took = wait_for("the stale alert", lambda: list(hook.bodies), 60)
    print(f"stale schedule reported {took:.0f} s after registering (window 11 s)")
    assert alert["text"].startswith(
        ":hourglass: gradline deployment `gradline/nightly` has had no successful run"
    )
