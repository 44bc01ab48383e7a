"""What a job leaves for the tracking server when it is down as training ends, and how
it ships later: by registration (waiting up to orchestrate.tracking_wait_s) or by
`gradline sync`.

A job's records wait in its journal (training.mlops.tracking); the end of a job whose
server does not answer adds what it would have done itself (log the model, mark the run
FINISHED) as journal records too, so one shipper, the helper's, ships everything in
order and each value once. Nothing here waits longer than it is told.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from training.atomic import atomic_dir
from training.engine.jobdir import JobDir
from training.errors import TrackingUnavailable
from training.mlops.filters import equals
from training.mlops.tracking import (
    Shipped,
    append_records,
    checkpoint_copies,
    client,
    pending_records,
    read_journal,
    redact_uri,
    ship_pending,
    shipped_offset,
    tracking_reachable,
)
from training.objectives import Generation

log = logging.getLogger("gradline")

# How often a wait for the tracking server says what it waits for.
SAY_EVERY_S = 10.0


@dataclass(frozen=True)
class JobShipment:
    job: JobDir
    run_id: str
    shipped: Shipped


PENDING_MODEL = ".mlflow-model"


def defer_job_end(job: JobDir, model_dir: Path | None, generation: Generation) -> None:
    """Leave the end of a tracked job in its journal: its model (when it logs one) and
    the run's FINISHED status ship with the records before them."""
    records: list[dict] = []
    if model_dir is not None:
        # A copy: model/ belongs to whichever job trains next, and this run must get the
        # model it trained even when `gradline sync` comes after another training.
        kept = job.path / PENDING_MODEL
        with atomic_dir(kept) as staging:
            shutil.copytree(model_dir, staging, dirs_exist_ok=True)
        gen = asdict(generation)
        records.append({"kind": "model", "model_dir": str(kept), "generation": gen})
    records.append({"kind": "status", "status": "FINISHED"})
    append_records(job.journal, records)


def defer_evaluation(job: JobDir, records: list[dict], figures: list[Path]) -> None:
    """The evaluate stage's records in the job's journal, its figures copied beside it
    (plots/ is replaced by the next evaluation; the copy ships as it was)."""
    pending = job.path / f".mlflow-evaluation-{time.time_ns()}"
    pending.mkdir()
    for figure in figures:
        shutil.copy2(figure, pending / figure.name)
    artifacts = {"kind": "artifacts", "path": str(pending), "artifact_path": "evaluation"}
    append_records(job.journal, [*records, artifacts])


def pending_jobs(checkpoints: Path) -> list[JobDir]:
    """The tracked jobs under `checkpoints` whose journal holds records not yet shipped."""
    if not checkpoints.is_dir():
        return []
    jobs = (JobDir(path) for path in sorted(checkpoints.iterdir()) if path.is_dir())
    return [job for job in jobs if job.run_file.is_file() and pending_records(job.journal)]


def ship_job(tracking_uri: str, job: JobDir, deadline: float | None = None) -> JobShipment:
    """Ship one job's pending records (its deferred model included), each once."""
    run_id = json.loads(job.run_file.read_text())["run_id"]
    actions = {"model": _model_logger(tracking_uri, run_id)}
    shipped = ship_pending(tracking_uri, run_id, job.journal, deadline=deadline, actions=actions)
    return JobShipment(job, run_id, shipped)


def ship_if_answering(tracking_uri: str, job: JobDir) -> bool:
    """Ship the job's pending records if the server answers now, without waiting for it;
    whether they are all in."""
    if tracking_reachable(tracking_uri):
        try:
            ship_job(tracking_uri, job, deadline=time.monotonic())
            return True
        except TrackingUnavailable:
            pass
    log.warning(
        "the MLflow tracking server at %s does not answer: %d records of job %s wait in its "
        "journal; registration ships them when it is back (or run `gradline sync`)",
        redact_uri(tracking_uri),
        pending_records(job.journal),
        job.path.name,
    )
    return False


def _model_logger(tracking_uri: str, run_id: str) -> Callable[[dict], None]:
    def log_model(record: dict) -> None:
        # Deferred: torch and the serving code load only when a model ships.
        from training.mlops.serving import log_pyfunc_model

        kept = Path(record["model_dir"])
        if run_model_uri(tracking_uri, run_id) is None:  # else a shipper cut short logged it
            gen = {**record["generation"], "prompts": tuple(record["generation"]["prompts"])}
            log_pyfunc_model(tracking_uri, run_id, kept, Generation(**gen))
        if kept.name == PENDING_MODEL:  # the job's own copy, not needed once logged
            shutil.rmtree(kept, ignore_errors=True)

    return log_model


def run_model_uri(tracking_uri: str, run_id: str) -> str | None:
    """The model logged with run `run_id` (models:/<id>), or None when it has none yet."""
    mlflow_client = client(tracking_uri)
    experiment = mlflow_client.get_run(run_id).info.experiment_id
    found = mlflow_client.search_logged_models(
        experiment_ids=[experiment], filter_string=equals(source_run_id=run_id)
    )
    return f"models:/{found[0].model_id}" if found else None


def ship_when_back(
    tracking_uri: str,
    checkpoints: Path,
    wait_s: float,
    say: Callable[[str], None],
    then: str,
) -> list[JobShipment]:
    """Ship every pending job under `checkpoints`, waiting up to `wait_s` for the
    tracking server to answer and saying every so often what waits for it; then
    TrackingUnavailable, naming what is kept and that `gradline sync` ships it. `then`:
    what the caller does once everything is in (for the message)."""
    deadline = time.monotonic() + wait_s
    said = time.monotonic() - SAY_EVERY_S
    while True:
        if tracking_reachable(tracking_uri):
            try:
                return [ship_job(tracking_uri, job, deadline) for job in pending_jobs(checkpoints)]
            except TrackingUnavailable:
                pass  # it went away again while shipping: wait on, what shipped stays shipped
        left = deadline - time.monotonic()
        if left <= 0:
            raise TrackingUnavailable(_kept(tracking_uri, checkpoints, wait_s, then))
        if time.monotonic() - said >= SAY_EVERY_S:
            said = time.monotonic()
            say(
                f"waiting for the MLflow tracking server at {redact_uri(tracking_uri)} "
                f"({_pending_text(checkpoints)}) before it can {then}; giving up in {left:.0f} s"
            )
        time.sleep(min(2.0, max(left, 0.0)))


def _pending_text(checkpoints: Path) -> str:
    jobs = pending_jobs(checkpoints)
    if not jobs:
        return "no records waiting"
    counts = ", ".join(f"{pending_records(job.journal)} of job {job.path.name}" for job in jobs)
    return f"journal records waiting to ship: {counts}"


def _kept(tracking_uri: str, checkpoints: Path, wait_s: float, then: str) -> str:
    """What is kept on disk while the server is down, and what to do."""
    jobs = pending_jobs(checkpoints)
    journals = "; ".join(_job_text(job) for job in jobs) or "no journal records waiting"
    waited = f" within {wait_s:g} s (orchestrate.tracking_wait_s)" if wait_s > 0 else ""
    return (
        f"the MLflow tracking server at {redact_uri(tracking_uri)} did not answer{waited}, "
        f"so gradline could not {then}. Nothing is lost; kept on disk: the trained model "
        f"in model/ and result.json, and in {checkpoints}: {journals}. When the server is "
        "back, run `gradline sync` to ship them and register the model"
    )


def _job_text(job: JobDir) -> str:
    waiting, _ = read_journal(job.journal, shipped_offset(job.journal))
    copies = checkpoint_copies(waiting)
    return (
        f"job {job.path.name} (its checkpoints, and a journal of {len(waiting)} records not yet in "
        f"MLflow, {copies} of them checkpoint copies)"
    )
