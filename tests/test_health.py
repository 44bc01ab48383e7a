"""Health records name where a rank stopped, even when it failed within its first second."""

from __future__ import annotations

from pathlib import Path

from training.engine.health import Heartbeat, describe, read_beats, read_failures, record_failure


def test_a_failure_record_carries_the_rank_s_last_step(tmp_path: Path) -> None:
    fast, slow = Heartbeat(tmp_path, rank=0), Heartbeat(tmp_path, rank=1, interval_s=3600)
    fast.beat(25, "sync")
    slow.beat(25, "compute")  # the periodic writer has not run yet
    record_failure(tmp_path, 0, RuntimeError("connection closed by peer"))
    record_failure(tmp_path, 1, RuntimeError("injected failure at step 25"))
    beats = {b["rank"]: (b["step"], b["phase"]) for b in read_beats(tmp_path)}
    assert beats == {0: (25, "sync"), 1: (25, "compute")}
    assert describe(read_beats(tmp_path)).startswith("rank 1 stopped at step 25 in compute")
    assert [r["rank"] for r in read_failures(tmp_path)] == [0, 1]
