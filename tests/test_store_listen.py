"""A rank reaches its store on the first try: it waits, polling, until the store listens,
instead of paying torch's back-off after a refused connection (training/engine/listen.py)."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from training.engine import control as control_module
from training.engine import listen
from training.engine.control import Control, ControlUnreachable
from training.engine.launch import free_port
from training.engine.listen import listen_on, serve_store, wait_until_listening
from training.engine.topology import _reach_the_workers_store
from training.errors import StoreUnreachable, is_retryable

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pauses(monkeypatch) -> list[float]:
    """Every pause `wait_until_listening` takes between its tries."""
    taken: list[float] = []

    def sleep(seconds: float) -> None:
        taken.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(listen, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    return taken


def test_a_store_that_starts_late_is_polled_for_then_reached(pauses) -> None:
    port = free_port()
    listening_at: list[float] = []

    def serve_late() -> None:
        time.sleep(0.3)
        listening_at.append(time.monotonic())
        serve_store("127.0.0.1", port, timedelta(seconds=30))

    server = threading.Thread(target=serve_late)
    server.start()
    assert wait_until_listening("127.0.0.1", port, timeout_s=30)
    returned_at = time.monotonic()
    server.join()
    assert returned_at >= listening_at[0]  # not before the store listened
    # Polled every 5 ms, never torch's back-off of 0.3 s and more (the first second).
    assert pauses and set(pauses) == {0.005}
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    client.set("reached", "yes")  # the probes' connections left the server working
    assert client.get("reached") == b"yes"


def test_a_port_that_never_listens_is_given_up_after_the_timeout() -> None:
    started = time.monotonic()
    assert not wait_until_listening("127.0.0.1", free_port(), timeout_s=0.3)
    assert time.monotonic() - started >= 0.3


def test_a_store_that_never_answers_is_not_taken_for_one_that_listens() -> None:
    """Dropped packets (a firewall, a machine still starting): each try times out. Such a
    store is given up after the timeout, not reported as listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(0)  # one queued connection fills it: the kernel drops the next ones
    filler = socket.create_connection(sock.getsockname())
    try:
        assert not wait_until_listening("127.0.0.1", sock.getsockname()[1], timeout_s=1.5)
    finally:
        filler.close()
        sock.close()


def test_a_listening_socket_counts_before_its_server_accepts() -> None:
    sock = listen_on("127.0.0.1", free_port())  # listen() queues connections already
    try:
        assert wait_until_listening("127.0.0.1", sock.getsockname()[1], timeout_s=5)
    finally:
        sock.close()


def test_a_rank_whose_store_never_listens_fails_naming_it(monkeypatch) -> None:
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(
        StoreUnreachable, match=f"rank 1: the workers' store at 127.0.0.1:{port}"
    ) as e:
        _reach_the_workers_store(SimpleNamespace(rank=1), timedelta(seconds=0.3))
    assert is_retryable(e.value)  # rank 0 may have failed: a restart may get past it


def test_a_control_store_that_never_listens_is_unreachable_without_torchs_wait(
    monkeypatch,
) -> None:
    """Nothing listens: the node is told so after its timeout, without a TCPStore client
    waiting out the same timeout again."""
    clients: list[tuple] = []
    monkeypatch.setattr(
        control_module.dist, "TCPStore", lambda *args, **kwargs: clients.append(args)
    )
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(ControlUnreachable, match="nothing listens on port"):
        Control.connect(endpoint, "job", timeout_s=0.5, secret=b"k" * 32)
    assert clients == []
