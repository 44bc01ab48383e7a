"""Under CI a skipped test fails the run; elsewhere a skip stays a skip."""

from __future__ import annotations

import pytest

from tests.conftest import CI_ENV

SKIPPING = """
import pytest

def test_needs_a_tool():
    pytest.skip("the tool is not installed")

@pytest.mark.skipif(True, reason="never here")
def test_marked():
    pass

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    assert False
"""


@pytest.mark.parametrize("ci", [True, False])
def test_a_skip_fails_only_under_ci(pytester, monkeypatch, ci: bool) -> None:
    pytester.makeconftest("from tests.conftest import pytest_runtest_makereport  # noqa: F401")
    pytester.makepyfile(SKIPPING)
    if ci:
        monkeypatch.setenv(CI_ENV, "1")
    else:
        monkeypatch.delenv(CI_ENV, raising=False)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    if ci:
        # A skip in setup (skipif) turns into an error, one in the test into a failure.
        result.assert_outcomes(failed=1, errors=1, xfailed=1)
        result.stdout.fnmatch_lines(["*skipped under CI*the tool is not installed*"])
    else:
        result.assert_outcomes(skipped=2, xfailed=1)
