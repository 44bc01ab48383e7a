"""The job's control plane: a key-value store that every node and every worker reaches.

Stop requests, heartbeats, failure records and the job's MLflow run id travel through a
TCPStore served on the rendezvous endpoint, the store torch.distributed.elastic's c10d
rendezvous uses there: the launcher on the endpoint's host serves it (the agent in the
same process shares it, as TCPStore is multi-tenant), the other nodes' launchers and
every worker connect to it. No file has to be shared between nodes for a job to stop
together or to explain a failure. Keys live under `gradline/<rdzv_id>/`.

The store lives as long as the first node's launcher: losing that node ends the job (as
it ends torchrun's rendezvous); losing any other node does not.
"""

from __future__ import annotations

import json
import logging
import socket
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from training.errors import GradlineError

log = logging.getLogger("gradline.control")

STOP = "stop"
FAILURES = "failures"


class ControlUnreachable(GradlineError):
    """The rendezvous endpoint did not answer; the message says what to check."""

    exit_code = 2


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def is_local_address(host: str) -> bool:
    """True when `host` names an address of this machine (it can be bound here)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except OSError:
        return False
    return True


class Control:
    """One job's keys in the shared store, with typed helpers for what travels there."""

    def __init__(self, store: dist.Store, endpoint: str, job_id: str, hosting: bool) -> None:
        self.store = dist.PrefixStore(f"gradline/{job_id}", store)
        self.endpoint, self.job_id, self.hosting = endpoint, job_id, hosting
        self._raw = store  # keeps the server alive while this object lives

    @classmethod
    def open(cls, endpoint: str, job_id: str, timeout_s: float) -> Control:
        """For a launcher: serve the store when the endpoint is on this machine and its
        port is free, else connect to the one another launcher serves."""
        host, port = split_endpoint(endpoint)
        timeout = timedelta(seconds=timeout_s)
        if is_local_address(host):
            try:
                store = dist.TCPStore(
                    host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                    timeout=timeout,
                )  # fmt: skip
                return cls(store, endpoint, job_id, hosting=True)
            except (RuntimeError, OSError) as exc:  # the port is taken: another node's
                log.info("rendezvous store on %s is served elsewhere (%s)", endpoint, exc)
        return cls.connect(endpoint, job_id, timeout_s)

    @classmethod
    def connect(cls, endpoint: str, job_id: str, timeout_s: float) -> Control:
        host, port = split_endpoint(endpoint)
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as exc:
            raise ControlUnreachable(
                f"cannot reach the rendezvous store at {endpoint} within {timeout_s:.0f} s "
                f"({exc}). Start the first node (the endpoint's host) too, check that "
                "runtime.rdzv_endpoint names it and that its port is open between nodes"
            ) from exc
        return cls(store, endpoint, job_id, hosting=False)

    # The job's run: the first launcher to claim it opens the MLflow run.
    def claim(self, key: str) -> bool:
        token = uuid.uuid4().hex
        return self.store.compare_set(key, "", token) == token.encode()

    def put_json(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def get_json(self, key: str) -> Any:
        """Blocks until some node sets `key` (up to the store's timeout)."""
        return json.loads(self.store.get(key))

    def peek_json(self, key: str) -> Any:
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    # Stop requests (preemption): any launcher sets, every rank checks.
    def request_stop(self) -> None:
        self.store.set(STOP, "1")

    def stop_requested(self) -> bool:
        return self.store.check([STOP])

    # Health: each rank's latest (step, phase); failure records in the order they came.
    def put_beat(self, rank: int, beat: dict[str, Any]) -> None:
        self.put_json(f"beat/{rank}", beat)

    def beats(self, ranks: int) -> list[dict[str, Any]]:
        found = (self.peek_json(f"beat/{rank}") for rank in range(ranks))
        return [beat for beat in found if beat is not None]

    def put_failure(self, record: dict[str, Any]) -> None:
        number = self.store.add(f"{FAILURES}/count", 1)
        self.put_json(f"{FAILURES}/{number}", record)

    def failures(self) -> list[dict[str, Any]]:
        count = self.store.add(f"{FAILURES}/count", 0)
        return [self.get_json(f"{FAILURES}/{n}") for n in range(1, count + 1)]
