"""The units of tests that wait on timers name tests that exist: a renamed file or test
would silently fall back into the processes that compute, and sleep there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.scheduling import WAITS_UNITS, unit_of_work, waits_unit

TESTS = Path(__file__).parent


@pytest.mark.parametrize("member", [m for members in WAITS_UNITS.values() for m in members])
def test_every_member_of_a_waits_unit_exists(member: str) -> None:
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
