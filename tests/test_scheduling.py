"""The units of tests that wait on timers, or share a costly fixture, name tests that
exist: a renamed file or test would silently fall back into the processes that compute
(and sleep there, or build the fixture again)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.scheduling import SHARED_SET_UP_UNITS, WAITS_UNITS, unit_of_work, waits_unit

TESTS = Path(__file__).parent


UNITS = {**WAITS_UNITS, **SHARED_SET_UP_UNITS}


@pytest.mark.parametrize("member", [m for members in UNITS.values() for m in members])
def test_every_member_of_a_unit_exists(member: str) -> None:
    file, _, test = member.partition("::")
    source = (TESTS / file).read_text()
    if test:
        assert re.search(rf"^def {re.escape(test)}\(", source, re.MULTILINE), member


def test_a_test_belongs_to_its_waits_unit_or_else_to_its_file() -> None:
    lost_node = "tests/test_multinode.py::test_losing_a_node_the_job_goes_on_with_the_other"
    other = "tests/test_multinode.py::test_two_nodes_of_one_rank_equal_one_node_of_two"
    assert waits_unit(lost_node) == waits_unit("tests/test_watchdog.py::test_x[a]") is not None
    assert waits_unit("tests/test_prefect_outage.py::test_y") not in (None, waits_unit(lost_node))
    assert unit_of_work(other) == "tests/test_multinode.py" and waits_unit(other) is None
    assert unit_of_work(f"{lost_node}[param]") == waits_unit(lost_node)


def test_every_test_of_the_first_run_is_in_its_unit() -> None:
    """A test that reads `first_run` outside the unit would build it again elsewhere."""
    (unit,) = SHARED_SET_UP_UNITS
    for path in sorted(TESTS.glob("test_*.py")):
        source = path.read_text()
        for test in re.findall(r"^def (test_\w+)\([^)]*\bfirst_run\b", source, re.MULTILINE):
            assert unit_of_work(f"tests/{path.name}::{test}") == unit, f"{path.name}::{test}"
    browser = "tests/test_ui.py::test_ui_on_other_ports_works_in_a_browser_and_stops_on_ctrl_c"
    assert unit_of_work(browser) == "tests/test_ui.py"
