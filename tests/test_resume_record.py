"""The record of where each attempt began, without processes: what rank 0 writes and
tags, that other ranks write nothing, and that the test helper catches a restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from training.engine.resume_record import AttemptRecord, Origin, read_attempts, read_resumes
from training.engine.topology import MeshShape, Topology

from .resume_checks import Resumed, assert_resumed


class Tags:
    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def set_tag(self, key: str, value: str) -> None:
        self.tags[key] = value


def _topology(rank: int, world_size: int, attempt: int = 0, **mesh: int) -> Topology:
    shape = MeshShape(**mesh) if mesh else None
    cpu = torch.device("cpu")
    return Topology(rank, world_size, rank, "gloo", cpu, attempt=attempt, shape=shape)


def _origin(job: Path, step: int, world_size: int = 2) -> Origin:
    state = {"step": step, "world_size": world_size, "mesh": {"dp_replicate": world_size}}
    return Origin.of(job / f"step-{step:08d}", state)


def test_a_fresh_start_and_two_resumes_are_recorded_with_their_layouts(tmp_path) -> None:
    health, tags = tmp_path / "health", Tags()
    AttemptRecord(health, _topology(0, 2), tags, None).first_step_done(0)
    AttemptRecord(health, _topology(0, 2, attempt=1), tags, _origin(tmp_path, 8)).first_step_done(8)
    four = _topology(0, 4, dp_shard=4)
    AttemptRecord(health, four, tags, _origin(tmp_path, 16)).first_step_done(16)

    attempts = read_attempts(health)
    assert [a["first_step"] for a in attempts] == [0, 8, 16]
    assert attempts[0]["resumed_from"] is None
    latest = json.loads((health / "resumed.json").read_text())
    assert latest["step"] == 17 and latest["time"] > 0  # what recovery benchmarks read
    assert latest["checkpoint"] == "step-00000016"
    assert latest["written_by"] == {"world_size": 2, "mesh": {"dp_replicate": 2}}
    assert latest["resumed_by"]["world_size"] == 4
    assert tags.tags == {"gradline.resumed_from": "16", "gradline.resumes": "2"}
    assert_resumed(
        tmp_path,
        Resumed(8, written_by=2, resumed_by=2),
        Resumed(16, written_by=2, resumed_by=4, resumed_mesh={"dp_shard": 4}),
    )


def test_ranks_other_than_0_record_nothing(tmp_path) -> None:
    tags = Tags()
    AttemptRecord(tmp_path, _topology(1, 2), tags, _origin(tmp_path, 8)).first_step_done(8)
    assert read_attempts(tmp_path) == read_resumes(tmp_path) == [] and tags.tags == {}


def test_a_job_that_restarted_at_step_0_fails_the_check(tmp_path) -> None:
    """Loaded the step-8 checkpoint, yet its first step was 0: steps ran twice."""
    health = tmp_path / "health"
    AttemptRecord(health, _topology(0, 2), Tags(), None).first_step_done(0)
    AttemptRecord(health, _topology(0, 2), Tags(), _origin(tmp_path, 8)).first_step_done(0)
    with pytest.raises(AssertionError, match="steps before the checkpoint ran again"):
        assert_resumed(tmp_path, Resumed(8))


def test_a_job_that_never_resumed_fails_the_check(tmp_path) -> None:
    health = tmp_path / "health"
    for _ in range(2):  # two fresh starts: a silent restart from scratch
        AttemptRecord(health, _topology(0, 2), Tags(), None).first_step_done(0)
    with pytest.raises(AssertionError):
        assert_resumed(tmp_path, Resumed(8))
