"""How `make test` shares the suite out among its test processes (pytest-xdist).

A file's tests stay in one process, so its module set-up runs once (xdist's loadfile).
The files whose tests mostly sleep on Prefect's timers (30 s heartbeats, 60 s leases, a
server kept down through an outage) are one unit of work instead: one process works
through them alone while the others keep the cores busy with tests that compute. Spread
over every process, their sleeps would leave cores idle for minutes at a time.
"""

from __future__ import annotations

from pathlib import PurePosixPath

WAITS_FILES = frozenset({"test_prefect_outage.py", "test_slot_lease.py", "test_watchdog.py"})
WAITS_UNIT = "tests that wait on Prefect's timers"


def waits_on_timers(path: str) -> bool:
    """Whether the test file at `path` (a node id's file part will do) is a waits file."""
    return PurePosixPath(path).name in WAITS_FILES


def files_and_one_unit_of_waits(config, log):
    """xdist's loadfile scheduling, with the waits files as one unit of work."""
    from xdist.scheduler import LoadFileScheduling

    class FilesAndWaits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return WAITS_UNIT if waits_on_timers(file) else file

    return FilesAndWaits(config, log)
