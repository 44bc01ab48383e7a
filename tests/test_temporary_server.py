"""The temporary Prefect server `gradline run` starts first thing when no server is
configured (flows/temporary_server.py): it answers once ready, says it is temporary,
survives a port taken meanwhile, and is gone once stopped."""

from __future__ import annotations

import socket

import pytest

from flows import temporary_server
from flows.temporary_server import TemporaryServer, prefect_api_answers
from tasks.prefect_api import TEMPORARY_SERVER_ENV, lasting_api_url

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


@pytest.fixture
def own_home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    # Set, then removed: monkeypatch then restores them after the test, also over what
    # `point_here` writes (a dead server's address would reach every later test here).
    for name in ("PREFECT_API_URL", TEMPORARY_SERVER_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_it_answers_says_it_is_temporary_and_is_gone_when_stopped(own_home, monkeypatch):
    with socket.socket() as taken:  # the first port it picks goes to someone else
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        real = temporary_server._free_port
        monkeypatch.setattr(temporary_server, "_free_port", lambda: next(ports, None) or real())
        server = TemporaryServer()
        server.start()
        server.point_here()
        try:
            server.wait_until_ready()
            assert server.port != taken.getsockname()[1]
            assert prefect_api_answers(server.api_url)
            assert lasting_api_url() == ""  # no links into a UI that will be gone
        finally:
            server.stop()
    assert not prefect_api_answers(server.api_url)
