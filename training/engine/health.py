"""Per-rank health records, so a hung or failed job can say which rank brought it down.

- Heartbeats: each rank records (step, phase) in memory on every step; a daemon thread
  writes it to `<dir>/rank<R>.json` once a second. After a hang, ranks that wait in a
  collective ("sync") are victims; the rank that stopped elsewhere is the culprit.
- Failure records: a rank that raises writes `<dir>/failed-rank<R>.json` (time, attempt,
  exception). When one rank fails, its peers fail next with "connection closed by
  peer"; the earliest record is the root cause.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

SYNC = "sync"
# This process's running heartbeats by file, so a failure record can flush its rank's
# last state: a rank failing within its first second would otherwise leave "step 0".
_live: dict[Path, Heartbeat] = {}


class Heartbeat:
    def __init__(self, directory: Path, rank: int, interval_s: float = 1.0) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"rank{rank}.json"
        self.rank = rank
        self.step, self.phase, self.since = 0, "start", time.time()
        self._stop = threading.Event()
        # The beat thread, close() and a failure's final flush all write the same file.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._write()
        self._thread.start()
        _live[self.path] = self

    def beat(self, step: int, phase: str) -> None:
        # Plain attribute stores: cheap enough for every step.
        if phase != self.phase or step != self.step:
            self.step, self.phase, self.since = step, phase, time.time()

    def _write(self) -> None:
        payload = {"rank": self.rank, "step": self.step, "phase": self.phase, "since": self.since}
        tmp = self.path.with_suffix(".tmp")
        with self._lock:
            tmp.write_text(json.dumps(payload))
            os.replace(tmp, self.path)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._write()

    def close(self) -> None:
        _live.pop(self.path, None)
        self._stop.set()
        self._write()


def read_beats(directory: Path) -> list[dict]:
    beats = []
    for path in sorted(directory.glob("rank[0-9]*.json")):
        try:
            beats.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return beats


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


def record_failure(directory: Path, rank: int, exc: BaseException) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if beat := _live.get(directory / f"rank{rank}.json"):
        beat.close()  # its last step and phase, not the last once-a-second sample
    payload = {
        "rank": rank,
        "time": time.time(),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "error": f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500],
    }
    (directory / f"failed-rank{rank}.json").write_text(json.dumps(payload))


def read_failures(directory: Path) -> list[dict]:
    """Failure records of the latest attempt, earliest first."""
    records = []
    for path in directory.glob("failed-rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if not records:
        return []
    last = max(r["attempt"] for r in records)
    return sorted((r for r in records if r["attempt"] == last), key=lambda r: r["time"])


def clear(directory: Path) -> None:
    for path in directory.glob("*.json"):
        path.unlink(missing_ok=True)


def mark_resumed(directory: Path, step: int) -> None:
    """When the first step after a resume finished (for recovery-time measurements)."""
    payload = {"step": step, "time": time.time()}
    (directory / "resumed.json").write_text(json.dumps(payload))
