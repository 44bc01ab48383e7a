"""Serve deployments until a signal, and stop the runs in flight the way a cancel does.

Prefect's own `serve` leaves a served run behind when it is told to stop: on SIGTERM its
runner calls its stop from inside its own event loop (the stop never runs) and exits,
and on Ctrl-C it only cancels its loops. The run's process has a session of its own, so
its stage goes on training with nobody to report to, and the flow run stays `Running`
until the watchdog declares it dead. Here a first SIGINT, SIGTERM or SIGHUP asks the
runner to cancel every run in flight (each run's tree gets SIGTERM: training
checkpoints, the run ends `Cancelled`, the next run resumes), then ends the runner;
a later signal only says the stop is under way.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from prefect.runner import Runner

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _CancellingRunner(Runner):
    """A runner whose stop signals cancel its runs before it ends."""

    _stop_asked = False
    _stopping: asyncio.Task | None = None  # kept: the loop holds tasks only weakly

    def handle_sigterm(self, *args: object, **kwargs: object) -> None:
        """Runs in the main thread between two steps of the runner's loop."""
        if self._stop_asked:
            print("gradline serve: already stopping the runs in flight", file=sys.stderr)
            return
        print(
            "gradline serve: stopping; runs in flight are cancelled (training checkpoints "
            "first) and their schedules paused",
            file=sys.stderr,
            flush=True,
        )
        self._stop_asked = True
        loop = asyncio.get_running_loop()
        # call_soon_threadsafe wakes the loop, which may be asleep waiting for work.
        loop.call_soon_threadsafe(self._start_stopping)

    def _start_stopping(self) -> None:
        self._stopping = asyncio.get_running_loop().create_task(self.astop())

    async def start(self, run_once: bool = False, webserver: bool | None = None) -> None:
        # Prefect's start takes SIGTERM; the other stop signals come here as well, in
        # place of asyncio's Ctrl-C handling, which would end the loops but not the runs.
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.handle_sigterm)
        await super().start(run_once=run_once, webserver=webserver)


def serve_until_stopped(*deployments, limit: int) -> None:
    """Run what the deployments schedule (at most `limit` runs at once) until a stop
    signal; schedules are paused on the way out, as Prefect's serve does."""
    runner = _CancellingRunner(pause_on_shutdown=True, limit=limit)
    for deployment in deployments:
        runner.add_deployment(deployment)
    names = ", ".join(f"{d.flow_name}/{d.name}" for d in deployments)
    print(f"gradline serve: serving {names}; Ctrl-C or SIGTERM stops", flush=True)
    asyncio.run(runner.start())
