"""A TCPStore server that listens only on the address it was given.

torch's TCPStore server ignores its host argument when it listens: it binds every
interface (`::`, which takes IPv4 too), so a store meant for `127.0.0.1:P` answers on
the host's external addresses as well. TCPStore accepts an already listening socket
(`master_listen_fd`), so we bind that socket ourselves, to the given address only.

A TCPStore in the same process asked to serve the same port with `multi_tenant=True`
(torch.distributed.elastic's c10d rendezvous, `init_process_group`'s env:// store)
reuses the server made here instead of binding a second one, so serving the store here
first decides where the whole process listens.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch.distributed as dist

# The servers of this process and their sockets, by port, kept for the process's life:
# torch shares a multi-tenant server only while a TCPStore that made it lives, and a
# socket object that is garbage collected closes its descriptor under the server.
_serving: dict[int, tuple[dist.TCPStore, socket.socket]] = {}


def listen_on(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`'s address (not every interface) at `port`."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As torch's own server does: a restarted job may reuse its port at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """Serve a multi-tenant TCPStore on `host:port` only; OSError if the port is taken."""
    sock = listen_on(host, port)
    try:
        store = dist.TCPStore(
            host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
            timeout=timeout, master_listen_fd=sock.fileno(),
        )  # fmt: skip
    except (RuntimeError, OSError):
        sock.close()
        raise
    _serving[port] = (store, sock)
    return store


# How often a rank asks whether the store it is about to join listens yet: every 5 ms
# for the first second (ranks of one machine, started together), then every 0.1 s (a
# node waiting for another machine).
_LISTEN_POLL_S = (0.005, 0.1)
_FAST_POLLING_S = 1.0
# A connection attempt that gets no answer (dropped packets) is given up after this.
_ATTEMPT_S = 1.0


def wait_until_listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether `host:port` accepts connections within `timeout_s`. A name that does not
    resolve gives True at once: the caller's own connection attempt then reports it.

    torch's TCPStore client, refused because its server does not listen yet, tries again
    only after a jittered back-off (0.3 to 0.6 s measured, torch 2.13). Ranks forked
    together reach their store within milliseconds of the rank that serves it, so about
    every other job's start lost that back-off; a probe every 5 ms does not. A refusal,
    no answer, or an unreachable host (a node still starting) are tried again until
    the timeout."""
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(min(left, _ATTEMPT_S), 0.01)):
                return True
        except socket.gaierror:
            return True
        except OSError:  # refused, timed out, unreachable: not there yet
            pass
        if time.monotonic() >= deadline:
            return False
        fast = time.monotonic() - started < _FAST_POLLING_S
        time.sleep(_LISTEN_POLL_S[0] if fast else _LISTEN_POLL_S[1])
