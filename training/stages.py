"""The DVC stages: `gradline stage NAME` runs one of these with dvc.yaml's paths.

Each stage validates the whole config before it writes anything, and writes its outputs
aside and swaps them in, so a failed stage leaves the previous outputs as they were.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from training.atomic import write_json
from training.data.manifest import read_manifest, split_digest
from training.mlops.versioning import data_version
from training.project import Project, read_train_result

# Each stage imports what it needs when it runs: `gradline stage ingest` has no use for
# the training engine (torch.distributed alone takes most of a second), nor evaluate
# for the launcher. A stage process pays only for its own work.

log = logging.getLogger("gradline")


def ingest_stage(
    root: Path, out: Path, quarantine: Path, report: Path, profile: Path | None = None
) -> dict[str, Any]:
    """Ingest, then profile the new snapshot into `profile` and compare it with the
    champion's data: the report gets a `drift` section (training.mlops.drift)."""
    from training.data.ingest import ingest
    from training.mlops.drift import check_new_data

    project = Project(root)
    cfg = project.config()
    if cfg.task.card.learns_series:
        return _ingest_series(cfg, root, out, quarantine, report, profile or project.profile)
    labels = cfg.task.card.labels
    result = ingest(cfg.data, root, out, quarantine, report, labels=labels).to_dict()
    log.info("ingest: %s from %s into %s", result, cfg.data.source, out)
    drift = check_new_data(project, cfg, out, profile or project.profile)
    write_json(report, {**result, "drift": drift})
    log.info("ingest: %s", drift["message"])
    return {**result, "drift": drift}


def _ingest_series(
    cfg: Any, root: Path, out: Path, quarantine: Path, report: Path, profile: Path
) -> dict[str, Any]:
    """A time series snapshot (training.data.series). Drift is checked on tables and
    text only for now: the report says so, and the profile names the kind."""
    from training.data.series import ingest_series
    from training.mlops.drift import INCOMPARABLE

    result = ingest_series(cfg.data, root, out, quarantine, report)
    drift = {"status": INCOMPARABLE, "message": "time series: no drift check yet"}
    write_json(profile, {"kind": "series"})
    write_json(report, {**result, "drift": drift})
    log.info("ingest: %s from %s into %s", result, cfg.data.source, out)
    return {**result, "drift": drift}


def shard_stage(root: Path, raw: Path, out: Path) -> dict[str, Any]:
    from training.data.series import write_window_shards
    from training.data.shards import write_shards

    cfg = Project(root).config()
    if cfg.task.card.learns_series:  # windows split by time, not rows split by key
        task = cfg.task
        manifest = write_window_shards(
            cfg.data, cfg.shard, task.context, task.horizon, task.season, raw, out,
            data_version(root),
        )  # fmt: skip
    else:
        manifest = write_shards(cfg.shard, raw, out, data_version(root))
    counts = {name: split["rows"] for name, split in manifest["splits"].items()}
    log.info("shard: %s rows per split into %s", counts, out)
    return counts


def train_stage(
    root: Path,
    shards: Path,
    model_dir: Path,
    checkpoints: Path,
    result: Path,
    overrides: list[str] | tuple[str, ...] = (),
) -> dict[str, Any] | None:
    """Train on this node; on the node that ran rank 0, record the model and the result.
    `overrides` are the launch flags (nodes, rendezvous), never written to params.yaml."""
    from training.engine.worker_start import start_worker_server

    project = Project(root)
    cfg = project.config(overrides)
    # Now, not at the launch: a new interpreter as the server (CUDA builds) imports the
    # engine beside this process's own set-up; a fork of this one is ready at once.
    start_worker_server()
    from training.mlops.jobs import JobRequest, run_job

    request = JobRequest(
        cfg, shards, checkpoints, model_dir, root=root, tracking_uri=project.tracking_uri
    )
    outcome = run_job(request)
    if outcome.final is None:
        log.info("train: done here; rank 0's node records the model of run %s", outcome.run_id)
        return None
    summary = {
        "run_id": outcome.run_id,
        "model_uri": outcome.model_uri,  # None: it waits in the job's journal (sync.py)
        "job": outcome.job.job_dir.path.name,  # its folder under checkpoints/
        "data_version": read_manifest(shards)["data_version"],
        "final": outcome.final,
    }
    write_json(result, summary)
    return summary


def evaluate_stage(
    root: Path, model_dir: Path, shards: Path, result: Path, metrics_out: Path, plots: Path
) -> dict[str, float]:
    """Score the trained model and its baseline on the test split; plots; log to MLflow."""
    from training.evaluation import evaluate
    from training.mlops.runs import evaluation_records, record_evaluation
    from training.mlops.sync import defer_evaluation, ship_if_answering
    from training.mlops.tracking import journal_history, metric_history
    from training.models.folder import load_model_dir
    from training.plots import plot_loss_curves

    project = Project(root)
    cfg = project.config()
    trained = read_train_result(result)
    model, _ = load_model_dir(model_dir)
    evaluation = evaluate(cfg, model, shards, plots)
    curves = plots / "loss_curves.png"
    keys = ("train_loss", "val_loss", evaluation.objective.curve_metric)
    job = project.job(trained["job"]) if trained.get("job") else None
    if job is not None and job.journal.is_file():  # on disk whether or not MLflow answers
        history = journal_history(job.journal, keys)
    else:
        history = metric_history(project.tracking_uri, trained["run_id"], keys)
    plot_loss_curves(history, curves, evaluation.objective.curve_metric)
    write_json(metrics_out, evaluation.metrics)
    step = int(trained["final"]["step"])
    test_digest = split_digest(read_manifest(shards), "test")
    records = evaluation_records(cfg, step, evaluation.metrics, test_digest, evaluation.details)
    figures = [*evaluation.figures, curves]
    if job is not None and job.run_file.is_file():
        # Journaled like training's records: shipped now if the server answers, else
        # by registration or `gradline sync` once it is back.
        defer_evaluation(job, records, figures)
        ship_if_answering(project.tracking_uri, job)
    else:
        record_evaluation(project.tracking_uri, trained["run_id"], records, figures)
    log.info("evaluate: %s", evaluation.metrics)
    return evaluation.metrics


def register_stage(root: Path, summary: Path) -> dict[str, Any]:
    """The flow's register step (training.mlops.registration) with params.yaml as the
    flow left it; the run summary goes to `summary` (JSON), for the flow to publish."""
    from dataclasses import asdict

    from training.mlops.registration import register_trained

    cfg = Project(root).config()
    registered = asdict(register_trained(root, cfg, cfg.orchestrate.tracking_wait_s, log.info))
    write_json(summary, registered)
    return registered
