"""Proof that a job resumed, for the tests that interrupt one.

Training is deterministic and tracking keeps one value per metric and step, so equal
weights and a clean loss curve would also come from a job that silently restarted at
step 0. What tells them apart is the job's own record of where each attempt began
(training.engine.resume_record): these helpers hold it to what a test expects.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from training.engine.jobdir import JobDir
from training.engine.resume_record import (
    RESUME_COUNT_TAG,
    RESUMED_FROM_TAG,
    read_attempts,
    read_resumes,
)


@dataclass(frozen=True)
class Resumed:
    """One expected resume: from the checkpoint of `step`; world sizes (and meshes) of the
    job that wrote it and of the one that resumed it, where the test knows them."""

    step: int
    written_by: int | None = None
    resumed_by: int | None = None
    written_mesh: dict[str, int] | None = None
    resumed_mesh: dict[str, int] | None = None


def assert_resumed(job_dir: Path, *expected: Resumed) -> list[dict]:
    """The job in `job_dir` resumed exactly as `expected`, oldest first; each resumed
    attempt's first step was its checkpoint's step (nothing before it ran again), and
    every other attempt started fresh at step 0. Returns the resume records."""
    health = JobDir(job_dir).health
    resumes, attempts = read_resumes(health), read_attempts(health)
    where = f"resume records in {health}: {resumes}"
    assert [r["checkpoint_step"] for r in resumes] == [e.step for e in expected], where
    for record, want in zip(resumes, expected, strict=True):
        assert want.step > 0, "a resume from step 0 proves nothing: expect a later checkpoint"
        assert record["checkpoint"] == f"step-{want.step:08d}", where
        assert record["first_step"] == want.step, f"steps before the checkpoint ran again: {where}"
        checks = [
            (want.written_by, record["written_by"]["world_size"]),
            (want.resumed_by, record["resumed_by"]["world_size"]),
            (want.written_mesh, _mesh(record["written_by"]["mesh"])),
            (want.resumed_mesh, _mesh(record["resumed_by"]["mesh"])),
        ]
        for wanted, got in checks:
            assert wanted is None or wanted == got, f"wanted {wanted}, got {got}: {where}"
    # Every attempt that ran a step, fresh or resumed, began where it should have.
    for attempt in attempts:
        origin = attempt["resumed_from"]
        begins = origin["checkpoint_step"] if origin else 0
        assert attempt["first_step"] == begins, f"attempt began off its checkpoint: {attempts}"
    assert sum(a["resumed_from"] is not None for a in attempts) == len(expected), attempts
    return resumes


def assert_resume_tags(mlflow_client, run_id: str, expected: list[Resumed]) -> None:
    """The job's MLflow run says how often it resumed, and from which step last."""
    tags = mlflow_client.get_run(run_id).data.tags
    assert tags.get(RESUME_COUNT_TAG) == str(len(expected)), tags
    assert tags.get(RESUMED_FROM_TAG) == str(expected[-1].step), tags


def resumes_of(job_dir: Path) -> list[Resumed]:
    """The job's recorded resumes, for a test that cannot know their steps beforehand (it
    still holds them to the rest of `assert_resumed`)."""
    return [
        Resumed(r["checkpoint_step"], r["written_by"]["world_size"], r["resumed_by"]["world_size"])
        for r in read_resumes(JobDir(job_dir).health)
    ]


def job_of_run(checkpoints: Path, run_id: str) -> Path:
    """The job folder under `checkpoints` that holds MLflow run `run_id`."""
    jobs = [
        job.parent
        for job in checkpoints.glob(f"*/{JobDir(Path()).run_file.name}")
        if json.loads(job.read_text())["run_id"] == run_id
    ]
    assert len(jobs) == 1, f"{len(jobs)} job folders in {checkpoints} hold run {run_id}"
    return jobs[0]


def stopped_steps(output: str) -> list[int]:
    """The steps where a launcher reported stopping on request, in order: the checkpoints
    the next runs must resume from."""
    return [int(step) for step in re.findall(r"stopped on request at step (\d+);", output)]


def _mesh(mesh: dict[str, int] | None) -> dict[str, int] | None:
    """Only the dimensions that are not 1, as a test writes a layout (`{"dp_shard": 4}`)."""
    return None if mesh is None else {k: v for k, v in mesh.items() if v != 1}
