"""benchmarks/pipeline.py splits a run's wall from the records GRADLINE_TIMINGS writes:
the parts it prints add up to what they split."""

from __future__ import annotations

import pytest

from benchmarks.pipeline import split_run


def _records() -> list[dict]:
    """A run that started at t=100 s: the flow began at 103, train's `dvc repro` took
    112-130, rank 0's loop 115-127, the whole command ended at 140."""

    def stage(name: str, start: float, end: float) -> list[dict]:
        return [
            {"what": "stage_wall", "stage": name, "seconds": end - start, "at": end},
            {"what": "stage_work", "stage": name, "seconds": end - start - 1, "at": end - 0.5},
        ]

    return [
        {"what": "flow_began", "at": 103.0},
        *stage("ingest", 104, 107),
        *stage("shard", 108, 110),
        *stage("train", 112, 130),
        {"what": "train_loop", "seconds": 12.0, "at": 127.0},
        *stage("evaluate", 131, 135),
        {"what": "flow_step", "step": "train", "seconds": 19.0, "at": 130.5},
    ]


def test_train_overhead_parts_add_up_to_it() -> None:
    out = split_run(_records(), started=100.0, wall=40.0, loop_s=10.0)
    assert out["train.overhead_s"] == pytest.approx(18 - 10)
    assert out["train.before_loop_s"] == pytest.approx(115 - 112)
    assert out["train.in_loop_not_steps_s"] == pytest.approx(12 - 10)  # validation etc.
    assert out["train.after_loop_s"] == pytest.approx(130 - 127)
    parts = ("before_loop", "in_loop_not_steps", "after_loop")
    assert sum(out[f"train.{p}_s"] for p in parts) == pytest.approx(out["train.overhead_s"])
    assert out["startup_s"] == pytest.approx(3.0)
    assert out["flow.train_s"] == pytest.approx(19.0 - 18.0)  # the step less its stage


def test_a_run_without_the_loops_record_still_splits_the_rest() -> None:
    records = [r for r in _records() if r["what"] != "train_loop"]
    out = split_run(records, started=100.0, wall=40.0, loop_s=10.0)
    assert "train.before_loop_s" not in out
    assert out["train.overhead_s"] == pytest.approx(8.0)
