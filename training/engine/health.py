"""Per-rank health records, so a hung or failed job can say which rank brought it down.

Both go through the job's control store (training.engine.control), so a launcher on any
node reads every rank's records without a shared filesystem.
- Heartbeats: each rank records (step, phase) in memory on every step; a daemon thread
  publishes it once a second. After a hang, ranks that wait in a collective ("sync") are
  victims; the rank that stopped elsewhere is the culprit.
- Failure records: a rank that raises publishes (time, attempt, exception). When one
  rank fails, its peers fail next with "connection closed by peer"; the earliest record
  of the latest attempt is the root cause.
"""

from __future__ import annotations

import logging
import threading
import time

from training.engine.control import Control
from training.errors import as_user_error, is_retryable

log = logging.getLogger("gradline.health")

SYNC = "sync"
# This process's running heartbeats by rank, so a failure record can flush its rank's
# last state: a rank failing within its first second would otherwise leave "step 0".
_live: dict[int, Heartbeat] = {}


class Heartbeat:
    def __init__(self, control: Control, rank: int, interval_s: float = 1.0) -> None:
        self.control, self.rank = control, rank
        self.step, self.phase, self.since = 0, "start", time.time()
        self._stop = threading.Event()
        # The beat thread, close() and a failure's final flush all publish.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._publish()
        self._thread.start()
        _live[rank] = self

    def beat(self, step: int, phase: str) -> None:
        # Plain attribute stores: cheap enough for every step.
        if phase != self.phase or step != self.step:
            self.step, self.phase, self.since = step, phase, time.time()

    def _publish(self) -> None:
        payload = {"rank": self.rank, "step": self.step, "phase": self.phase, "since": self.since}
        with self._lock:
            try:
                self.control.put_beat(self.rank, payload)
            except (RuntimeError, OSError) as exc:  # the store's host went away
                log.warning("rank %d: heartbeat not published (%s)", self.rank, exc)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._publish()

    def close(self) -> None:
        _live.pop(self.rank, None)
        self._stop.set()
        self._publish()


def culprits(beats: list[dict]) -> list[dict]:
    """The ranks the others were waiting for: behind in steps, or stuck outside a
    collective while others sat in one."""
    if not beats:
        return []
    low = min(b["step"] for b in beats)
    behind = [b for b in beats if b["step"] == low]
    outside = [b for b in behind if b["phase"] != SYNC]
    if outside and len(outside) < len(beats):
        return outside
    if len(behind) < len(beats):
        return behind
    return outside


def describe(beats: list[dict], now: float | None = None) -> str:
    now = now or time.time()
    found = culprits(beats)
    if not found:
        return ""
    parts = [
        f"rank {b['rank']} stopped at step {b['step']} in {b['phase']} "
        f"({now - b['since']:.1f} s before the failure)"
        for b in found
    ]
    return "; ".join(parts) + "; the other ranks waited for it in a collective"


def record_failure(control: Control, rank: int, attempt: int, exc: BaseException) -> None:
    if beat := _live.get(rank):
        beat.close()  # its last step and phase, not the last once-a-second sample
    cause, where = _checkpoint_cause(exc)
    payload = {
        "rank": rank,
        "time": time.time(),
        "attempt": attempt,
        "error": _describe(cause, where),
        # A full disk or bad input fails every attempt alike: the launcher stops there.
        "retryable": is_retryable(cause),
    }
    try:
        control.put_failure(payload)
    except (RuntimeError, OSError) as store_error:
        log.warning("rank %d: failure record not published (%s)", rank, store_error)


def _describe(cause: BaseException, where: str) -> str:
    error = as_user_error(cause) or cause
    return f"{type(error).__name__}{where}: {error}".strip().splitlines()[0][:500]


def _checkpoint_cause(exc: BaseException) -> tuple[BaseException, str]:
    """The error under a distributed checkpoint's CheckpointException, whose own message
    names only the failed ranks: the lowest failed rank's error (a full disk, a timeout)
    is what the user reads and what decides a retry. Any other error is its own cause."""
    failures = getattr(exc, "failures", None)  # {rank: (exception, traceback)}
    if not isinstance(failures, dict) or not failures:
        return exc, ""
    rank = min(failures)
    wrapped = failures[rank]
    cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    if not isinstance(cause, BaseException):
        return exc, ""
    return cause, f" (in a checkpoint, on rank {rank})"


def latest_failures(records: list[dict]) -> list[dict]:
    """Failure records of the latest attempt, earliest first."""
    if not records:
        return []
    last = max(r["attempt"] for r in records)
    return sorted((r for r in records if r["attempt"] == last), key=lambda r: r["time"])
