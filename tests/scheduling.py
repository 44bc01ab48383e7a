"""How `make test` shares the suite out among its test processes (pytest-xdist).

A file's tests stay in one process, so its module set-up runs once (xdist's loadfile).
The tests that mostly sleep on timers (Prefect's 30 s heartbeats and 60 s leases, a
server kept down through an outage, a rendezvous waiting out its last call for a lost
node) are gathered into a few units of work instead. Each unit takes a test process of
its own from the start while the other processes keep the cores busy with tests that
compute; spread over every process, the sleeps would leave cores idle for minutes at a
time, and in one unit they would outlast the rest of the suite.

Tests of several files that read one costly session fixture (a whole `gradline run`) form
a unit too, so that the fixture is built once for the test run rather than once in every
test process that meets one of them.
"""

from __future__ import annotations

from pathlib import PurePosixPath

# Unit of work -> what belongs to it: whole test files, or single tests as
# "file::test" (the test's parameters, if any, left out). About 7 minutes of sleep each.
WAITS_UNITS = {
    "tests that wait out Prefect outages": ("test_prefect_outage.py",),
    "tests that wait for leases, heartbeats and lost nodes": (
        "test_watchdog.py",
        "test_slot_lease.py",
        "test_multinode.py::test_losing_a_node_the_job_goes_on_with_the_other",
    ),
}


# Unit -> its members, as above: the tests that read conftest's session fixture
# `first_run` (a project after one `gradline run`, about 30 s of a test process).
SHARED_SET_UP_UNITS = {
    "tests of the first run's project": (
        "test_e2e.py",
        "test_model_card.py::test_registered_version_has_a_card_with_the_run_s_numbers",
        "test_ui.py::test_review_pages_open_in_the_model_training_view",
    ),
}


def _unit_in(units: dict[str, tuple[str, ...]], nodeid: str) -> str | None:
    file, _, name = nodeid.partition("::")
    file = PurePosixPath(file).name
    test = f"{file}::{name.split('[')[0]}"
    for unit, members in units.items():
        if file in members or test in members:
            return unit
    return None


def waits_unit(nodeid: str) -> str | None:
    """The waits unit a test (a node id, or a file's path) belongs to; None for the rest."""
    return _unit_in(WAITS_UNITS, nodeid)


def unit_of_work(nodeid: str) -> str:
    """Which unit of work a test belongs to: its waits unit, else the unit that shares
    its set-up, else its file."""
    return waits_unit(nodeid) or _unit_in(SHARED_SET_UP_UNITS, nodeid) or nodeid.partition("::")[0]


def files_and_units_of_waits(config, log):
    """xdist's loadfile scheduling, with each waits unit as one unit of work."""
    from xdist.scheduler import LoadFileScheduling

    class FilesAndWaits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    return FilesAndWaits(config, log)
