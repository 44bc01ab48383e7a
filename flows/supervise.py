"""Signals reach the whole tree: `gradline run`, `compare-updates` and `sweep` run under
a thin supervisor.

The supervisor starts the real command in a session of its own, so a terminal's Ctrl-C
(SIGINT to the whole foreground process group) reaches only the supervisor, not the
embedded Prefect server, dvc or the training agent, which would each die their own way
(the server first, leaving the flow run `Running`; the agent killing its workers before
they checkpoint). On SIGINT, SIGTERM or SIGHUP the supervisor asks the command to stop
(SIGTERM: Prefect turns it into a cancellation, the stage running under dvc gets
SIGTERM, and training takes its exit-75 path: checkpoint, then exit), waits up to the
grace period, then kills whatever of the command's session is left. A second signal
kills at once. The command's session is also cleared after a normal end, so nothing it
started outlives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

# Set in the supervised command: it runs the work itself instead of supervising.
SUPERVISED_ENV = "GRADLINE_SUPERVISED"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def supervise(argv: list[str], grace_s: float, signal_code: bool = True) -> int:
    """Run `gradline argv` in its own session; pass a stop on; the command's exit code,
    or 128 + the signal's number when a signal stopped it (with `signal_code`; without,
    as for a server whose normal end is a stop, the command's own code)."""
    env = {**os.environ, SUPERVISED_ENV: "1"}
    command = [sys.executable, "-m", "flows.cli", *argv]
    child = subprocess.Popen(command, env=env, start_new_session=True)
    stops: list[int] = []

    def on_stop(signum: int, _frame) -> None:
        stops.append(signum)
        if len(stops) == 1:
            print(
                f"gradline: {signal.Signals(signum).name}: stopping (up to {grace_s:g} s; "
                "training checkpoints first; signal again to kill now)",
                file=sys.stderr,
                flush=True,
            )
            _signal_quietly(child.pid, signal.SIGTERM)
        else:
            _kill_session(child.pid)

    previous = {signum: signal.signal(signum, on_stop) for signum in STOP_SIGNALS}
    try:
        code = _wait(child, stops, grace_s)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _kill_session(child.pid)  # whatever the command left behind
    return 128 + stops[0] if stops and signal_code else code


def _wait(child: subprocess.Popen, stops: list[int], grace_s: float) -> int:
    stopping_since = None
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return child.wait(timeout=0.2)
        if stops and stopping_since is None:
            stopping_since = time.monotonic()
        if stopping_since is not None and time.monotonic() - stopping_since > grace_s:
            print(f"gradline: not stopped after {grace_s:g} s: killing it", file=sys.stderr)
            _kill_session(child.pid)


def _kill_session(leader: int) -> None:
    """SIGKILL every process of the session `leader` started (its process group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGKILL)


def _signal_quietly(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
