"""The job's control plane: a key-value store that every node and every worker reaches.

Stop requests, heartbeats, failure records and the job's MLflow run id travel through a
TCPStore served on the rendezvous endpoint, the store torch.distributed.elastic's c10d
rendezvous uses there: the launcher on the endpoint's host serves it (the agent in the
same process shares it, as TCPStore is multi-tenant), the other nodes' launchers and
every worker connect to it. No file has to be shared between nodes for a job to stop
together or to explain a failure. Keys live under `gradline/<rdzv_id>/`.

The store lives as long as the first node's launcher: losing that node ends the job (as
it ends torchrun's rendezvous); losing any other node does not.

Anyone who reaches the store's port can write to it (its protocol has no
authentication), so every record written here is signed with the job's secret
(training.engine.signing) and a record that fails the check is ignored and counted. The
store listens only on the endpoint's address (training.engine.listen).
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from training.engine.listen import serve_store, wait_until_listening
from training.engine.signing import Signer, Verdict
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
    """One job's keys in the shared store, with typed helpers for what travels there.
    Every value is signed on the way in and checked on the way out; `refused` counts
    the records that failed the check, by key."""

    def __init__(
        self, store: dist.Store, endpoint: str, job_id: str, hosting: bool, secret: bytes
    ) -> None:
        self.store = dist.PrefixStore(f"gradline/{job_id}", store)
        self.endpoint, self.job_id, self.hosting = endpoint, job_id, hosting
        self.signer = Signer.open(secret, job_id)
        self.refused: Counter[str] = Counter()
        self._last_refused: dict[str, bytes] = {}
        self._latest_beat: dict[int, tuple[float, dict[str, Any]]] = {}
        self._raw = store  # keeps the server alive while this object lives

    @classmethod
    def open(cls, endpoint: str, job_id: str, timeout_s: float, secret: bytes) -> Control:
        """For a launcher: serve the store when the endpoint is on this machine and its
        port is free, else connect to the one another launcher serves."""
        host, port = split_endpoint(endpoint)
        if is_local_address(host):
            try:
                store = serve_store(host, port, timedelta(seconds=timeout_s))
                return cls(store, endpoint, job_id, hosting=True, secret=secret)
            except (RuntimeError, OSError) as exc:  # the port is taken: another node's
                log.info("rendezvous store on %s is served elsewhere (%s)", endpoint, exc)
        return cls.connect(endpoint, job_id, timeout_s, secret)

    @classmethod
    def connect(cls, endpoint: str, job_id: str, timeout_s: float, secret: bytes) -> Control:
        host, port = split_endpoint(endpoint)
        try:
            # A node started together with the first one waits for it to listen.
            if not wait_until_listening(host, port, timeout_s):
                raise ConnectionRefusedError(f"nothing listens on port {port}")
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as exc:
            raise ControlUnreachable(
                f"cannot reach the rendezvous store at {endpoint} within {timeout_s:.0f} s "
                f"({exc}). Start the first node (the endpoint's host) too, check that "
                "runtime.rdzv_endpoint names it and that its port is open between nodes"
            ) from exc
        return cls(store, endpoint, job_id, hosting=False, secret=secret)

    # Signed records. A refused record is counted once however often it is read again:
    # the stop flag is polled all through training.
    def _verify(self, key: str, record: bytes) -> Verdict:
        verdict = self.signer.verify(key, record)
        if not verdict.ok and self._last_refused.get(key) != record:
            self._last_refused[key] = record
            self.refused[key] += 1
            log.warning(
                "ignored a %s control record under %r in the store at %s (%d refused there "
                "so far): it is not signed with this job's secret. Something that does not "
                "hold GRADLINE_JOB_SECRET writes to the job's store; see docs/security.md",
                verdict.refused, key, self.endpoint, self.refused[key],
            )  # fmt: skip
        return verdict

    def _read(self, key: str) -> Verdict:
        return self._verify(key, self.store.get(key)) if self.store.check([key]) else Verdict()

    def put_json(self, key: str, value: Any) -> None:
        self.store.set(key, self.signer.sign(key, value))

    def get_json(self, key: str, poll_s: float = 0.2) -> Any:
        """Blocks until some node sets `key` to a record signed for this job (up to the
        store's timeout); records that fail the check are skipped, not returned."""
        deadline = time.monotonic() + self.store.timeout.total_seconds()
        while True:
            verdict = self._verify(key, self.store.get(key))  # blocks until it exists
            if verdict.ok:
                return verdict.value
            if time.monotonic() > deadline:
                raise ControlUnreachable(
                    f"no record under {key!r} signed with this job's secret reached the "
                    f"store at {self.endpoint} in time ({self.refused[key]} refused): does "
                    "every node have the same GRADLINE_JOB_SECRET?"
                )
            time.sleep(poll_s)

    def peek_json(self, key: str) -> Any:
        return self._read(key).value

    # The job's run: the first launcher to claim it opens the MLflow run. The claim is a
    # signed token: a forged one in the way is swapped out, not taken as another node's.
    def claim(self, key: str) -> bool:
        mine = self.signer.sign(key, uuid.uuid4().hex)
        expected = b""
        for _ in range(100):
            current = self.store.compare_set(key, expected, mine)
            if current == mine:
                return True
            if self._verify(key, current).ok:
                return False
            expected = current
        raise ControlUnreachable(
            f"the run claim {key!r} in the store at {self.endpoint} is overwritten with "
            "unsigned records faster than it can be taken: something without the job's "
            "secret writes to the store; keep its port private (docs/security.md)"
        )

    # Stop requests (preemption): any launcher sets, every rank checks.
    def request_stop(self) -> None:
        self.put_json(STOP, {"by": socket.gethostname()})

    def stop_requested(self) -> bool:
        return self._read(STOP).value is not None

    # Health: each rank's latest (step, phase); failure records in the order they came.
    def put_beat(self, rank: int, beat: dict[str, Any]) -> None:
        self.put_json(f"beat/{rank}", beat)

    def beats(self, ranks: int) -> list[dict[str, Any]]:
        """Each rank's latest heartbeat. One signed before a beat this reader already
        saw is a replay of an older one: the newer stays."""
        for rank in range(ranks):
            verdict = self._read(f"beat/{rank}")
            seen_at, _ = self._latest_beat.get(rank, (0.0, None))
            if verdict.value is not None and verdict.signed_at >= seen_at:
                self._latest_beat[rank] = (verdict.signed_at, verdict.value)
        return [self._latest_beat[r][1] for r in sorted(self._latest_beat) if r < ranks]

    def put_failure(self, record: dict[str, Any]) -> None:
        # The counter itself cannot be signed (the store adds to it): a forged increment
        # only leaves a number without a signed record, which readers skip.
        number = self.store.add(f"{FAILURES}/count", 1)
        self.put_json(f"{FAILURES}/{number}", record)

    def failures(self) -> list[dict[str, Any]]:
        count = self.store.add(f"{FAILURES}/count", 0)
        found = (self.peek_json(f"{FAILURES}/{n}") for n in range(1, count + 1))
        return [record for record in found if record is not None]

    def audit(self, ranks: int) -> Counter[str]:
        """Read every record this job keeps (stop, heartbeats, failures, the run) once,
        and return the refused counts: a launcher reports them when the job ends."""
        self.stop_requested()
        self.beats(ranks)
        self.failures()
        self.peek_json("run")
        return self.refused
