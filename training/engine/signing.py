"""Signed control-plane records: who may write to the job's store.

The rendezvous store answers anyone who can reach its port, and its protocol has no
authentication. So every record gradline writes there carries an HMAC-SHA256 over
(job id, key, body) with a secret every node of the job holds; a reader drops a record
whose MAC does not match. The job id and the key are inside the MAC, so a record copied
to another key or from another job fails the check. The body carries the time it was
signed, so a reader can refuse records older than the job itself (see `Signer.open`).

The secret comes from GRADLINE_JOB_SECRET. A one-node job makes its own and hands it to
its workers through the environment; a job of several nodes cannot (no node can tell the
others), so there the variable is required.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

from training.errors import ConfigError
from training.signing import sign

SECRET_ENV = "GRADLINE_JOB_SECRET"
# Records signed this long before a reader opened the store are refused as replays from
# an earlier run of the same job id. Generous: it must cover clock skew between nodes
# and a node that joins the rendezvous late.
REPLAY_WINDOW_S = 3600.0
_VERSION = b"g1"


class JobSecretMissing(ConfigError):
    """A job of several nodes needs a secret shared by every node."""


def job_secret(multi_node: bool) -> bytes:
    """The job's secret: GRADLINE_JOB_SECRET, or for a one-node job a fresh random one
    put into this process's environment, which the workers it starts inherit."""
    value = os.environ.get(SECRET_ENV, "")
    if value:
        return value.encode()
    if multi_node:
        raise JobSecretMissing(
            f"a job of several nodes signs its control records with a secret every node "
            f"must hold: set {SECRET_ENV} to the same random value on every node before "
            f"starting it, e.g. `export {SECRET_ENV}=$(openssl rand -hex 32)` on one and "
            "copy it (the Slurm and Kubernetes recipes in deploy/ do this for you)"
        )
    value = secrets.token_hex(32)
    os.environ[SECRET_ENV] = value
    return value.encode()


def secret_from_environment() -> bytes:
    """For a worker: the secret its launcher put in the environment."""
    value = os.environ.get(SECRET_ENV, "")
    if not value:
        raise JobSecretMissing(
            f"{SECRET_ENV} is not set in this worker's environment: workers are started "
            "by gradline's launcher, which sets it; start the job with `gradline stage "
            "train` or `gradline run`"
        )
    return value.encode()


@dataclass(frozen=True)
class Verdict:
    """What a reader learned from one stored record: its value, or why it was refused."""

    value: Any = None
    refused: str = ""  # "forged" (MAC mismatch or malformed) or "stale" (too old)
    signed_at: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.refused


@dataclass(frozen=True)
class Signer:
    secret: bytes
    job_id: str
    not_before: float  # records signed earlier than this are refused as replays

    @classmethod
    def open(cls, secret: bytes, job_id: str) -> Signer:
        return cls(secret, job_id, time.time() - REPLAY_WINDOW_S)

    def _mac(self, key: str, body: bytes) -> bytes:
        # Length prefixes: no (job id, key, body) can be re-split into another triple.
        message = b"".join(
            len(part).to_bytes(8, "big") + part
            for part in (self.job_id.encode(), key.encode(), body)
        )
        return sign(self.secret, message).encode()

    def sign(self, key: str, value: Any) -> bytes:
        body = json.dumps({"t": time.time(), "v": value}, separators=(",", ":")).encode()
        return b".".join((_VERSION, self._mac(key, body), body))

    def verify(self, key: str, record: bytes) -> Verdict:
        version, _, rest = record.partition(b".")
        mac, _, body = rest.partition(b".")
        if version != _VERSION or not hmac.compare_digest(mac, self._mac(key, body)):
            return Verdict(refused="forged")
        try:
            signed = json.loads(body)
        except ValueError:  # a valid MAC over a bad body: only a bug of ours writes that
            return Verdict(refused="forged")
        if signed["t"] < self.not_before:
            return Verdict(refused="stale")
        return Verdict(signed["v"], signed_at=signed["t"])
