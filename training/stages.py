"""The DVC stages: `gradline stage NAME` runs one of these with dvc.yaml's paths.

Each stage validates the whole config before it writes anything, and writes its outputs
aside and swaps them in, so a failed stage leaves the previous outputs as they were.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.atomic import write_json
from training.data.ingest import ingest
from training.data.shards import read_manifest, split_digest, write_shards
from training.data.spec import DataSpec
from training.errors import ProjectError
from training.project import Project
from training.tracking import TAG_TEST_DIGEST
from training.versioning import data_version

log = logging.getLogger("gradline")


def ingest_stage(root: Path, out: Path, quarantine: Path, report: Path) -> dict[str, Any]:
    cfg = Project(root).config()
    result = ingest(cfg.data, root, out, quarantine, report, task=cfg.task.type).to_dict()
    log.info("ingest: %s from %s into %s", result, cfg.data.source, out)
    return result


def shard_stage(root: Path, raw: Path, out: Path) -> dict[str, Any]:
    cfg = Project(root).config()
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
    from training.engine.launch import Preempted, launch_workers, open_control
    from training.engine.loop import TrainJob
    from training.models import check_buildable
    from training.runs import (
        check_checkpoint_location,
        mark_complete,
        open_job_run,
        open_shared_job_run,
        set_status,
    )
    from training.serving import log_pyfunc_model

    project = Project(root)
    cfg = project.config(overrides)
    check_checkpoint_location(checkpoints)
    manifest = read_manifest(shards)
    # A model that cannot be built for this data fails here, as bad input (exit 2),
    # before a run is created or a worker starts.
    check_buildable(cfg.model, cfg.task.type, DataSpec.from_manifest(manifest), cfg.layout())
    tracking_uri = project.tracking_uri
    control = open_control(cfg.runtime)
    job = open_shared_job_run(
        control,
        checkpoints,
        tracking_uri,
        lambda: open_job_run(root, cfg, tracking_uri, manifest["data_version"], checkpoints),
    )
    log.info(
        "train: MLflow run %s (%s), %d workers",
        job.run_id,
        "resumed" if job.resumed else "new",
        cfg.runtime.world_size,
    )
    train_job = TrainJob(
        config=cfg.model_dump(),
        shard_dir=str(shards),
        job_dir=str(job.job_dir.path),
        model_dir=str(model_dir),
        tracking_uri=tracking_uri,
        run_id=job.run_id,
    )
    try:
        final = launch_workers(train_job, cfg.runtime.world_size, cfg.runtime.max_restarts, control)
    except Preempted:
        set_status(tracking_uri, job.run_id, "KILLED")  # resumable: the next run continues it
        raise
    except BaseException:
        set_status(tracking_uri, job.run_id, "FAILED")
        raise
    if final is None:
        log.info("train: done here; rank 0's node records the model of run %s", job.run_id)
        return None
    model_uri = log_pyfunc_model(
        tracking_uri, job.run_id, model_dir, generation_defaults(cfg), prompts=cfg.task.prompts
    )
    set_status(tracking_uri, job.run_id, "FINISHED")
    mark_complete(job)
    summary = {
        "run_id": job.run_id,
        "model_uri": model_uri,
        "data_version": manifest["data_version"],
        "final": final,
    }
    write_json(result, summary)
    return summary


def generation_defaults(cfg) -> dict[str, Any]:
    """Language models: how the registered model samples text unless the caller says."""
    task = cfg.task
    return {
        "max_new_tokens": task.max_new_tokens,
        "temperature": task.temperature,
        "top_k": task.top_k,
    }


def read_train_result(result: Path) -> dict[str, Any]:
    if not result.is_file():
        raise ProjectError(f"{result} not found; run the train stage first (dvc repro train)")
    return json.loads(result.read_text())


@dataclass(frozen=True)
class TestData:
    """The test split and what scores a model on it: the objective and the readers."""

    manifest: dict[str, Any]
    data: DataSpec
    objective: Any
    test: Any
    context: int | None

    @classmethod
    def open(cls, cfg, shards: Path, context: int | None) -> TestData:
        from training.data.loader import open_reader
        from training.objectives import objective_for

        manifest = read_manifest(shards)
        data = DataSpec.from_manifest(manifest)
        token_bytes = None
        if data.kind == "tokens":
            from training.data.tokenizer import shard_tokenizer

            token_bytes = shard_tokenizer(shards, manifest).token_bytes()
        objective = objective_for(cfg.task.type, data, token_bytes)
        test = open_reader(shards, manifest, "test", context=context)
        return cls(manifest, data, objective, test, context)

    def score(self, model, batch_size: int, keep_predictions: bool = False):
        """The one evaluation routine (the loop's validation calls the same objective)."""
        rows = np.arange(self.test.num_rows)
        return self.objective.score_with_predictions(
            model, self.test, rows, batch_size, "cpu", keep_predictions=keep_predictions
        )


def evaluate_stage(
    root: Path, model_dir: Path, shards: Path, result: Path, metrics_out: Path, plots: Path
) -> dict[str, float]:
    """Score the trained model and its baseline on the test split; plots; log to MLflow."""
    from training.data.loader import open_reader
    from training.models import context_length, load_model_dir

    project = Project(root)
    cfg = project.config()
    trained = read_train_result(result)
    model, _ = load_model_dir(model_dir)
    context = context_length(cfg.model, cfg.task.type)
    test = TestData.open(cfg, shards, context)
    scored = test.score(model, cfg.evaluate.batch_size, keep_predictions=True)
    train_reader = open_reader(shards, test.manifest, "train", context=context)
    baseline = test.objective.baseline(train_reader, test.test, cfg.task.baseline_max_rows)
    metrics = {**scored.metrics, **baseline}
    figures = _task_artifacts(cfg, test, model, scored, model_dir, plots)
    figures.append(_loss_curves(project, trained["run_id"], test.objective, plots))
    write_json(metrics_out, metrics)
    _log_evaluation(project, trained, test, metrics, figures)
    log.info("evaluate: %s", metrics)
    return metrics


def _task_artifacts(cfg, test: TestData, model, scored, model_dir: Path, plots: Path) -> list[Path]:
    """What the task shows: a confusion matrix or a predicted-vs-actual plot with the
    predictions behind it; sampled continuations of fixed prompts for language models."""
    from training.evaluate import sample_text, write_prediction_artifacts

    if plots.exists():
        shutil.rmtree(plots)  # another task's plots must not linger beside these
    plots.mkdir(parents=True)
    if scored.predictions is not None:
        return write_prediction_artifacts(
            cfg.task.type, scored.predictions, test.data.num_classes, plots
        )
    from training.data.tokenizer import load_tokenizer

    task = cfg.task
    text = sample_text(
        model,
        load_tokenizer(model_dir / "tokenizer.json"),
        task.prompts,
        task.max_new_tokens,
        task.temperature,
        task.top_k,
        test.context,
        seed=cfg.train.seed,
    )
    samples = plots / "samples.txt"
    samples.write_text(text)
    return [samples]


def _loss_curves(project: Project, run_id: str, objective, plots: Path) -> Path:
    from training.evaluate import plot_loss_curves
    from training.tracking import client

    mlflow_client = client(project.tracking_uri)
    keys = ("train_loss", "val_loss", objective.curve_metric)
    history = {
        key: sorted((m.step, m.value) for m in mlflow_client.get_metric_history(run_id, key))
        for key in keys
    }
    curves = plots / "loss_curves.png"
    plot_loss_curves(history, curves, objective.curve_metric)
    return curves


def _log_evaluation(project: Project, trained, test: TestData, metrics, figures) -> None:
    from mlflow.entities import Metric, RunTag

    from training.tracking import client

    mlflow_client = client(project.tracking_uri)
    step = int(trained["final"]["step"])
    stamp = int(time.time() * 1000)
    mlflow_client.log_batch(
        trained["run_id"],
        metrics=[Metric(k, v, stamp, step) for k, v in metrics.items()],
        tags=[RunTag(TAG_TEST_DIGEST, split_digest(test.manifest, "test"))],
    )
    for figure in figures:
        mlflow_client.log_artifact(trained["run_id"], str(figure), "evaluation")


def gate_score(cfg, manifest: dict[str, Any], metrics: dict[str, float]):
    """The gate's view of metrics.json: the task's metric, its direction, its baseline."""
    from training.objectives import objective_for
    from training.registry import Score

    objective = objective_for(cfg.task.type, DataSpec.from_manifest(manifest))
    metric = objective.gate_metric
    return Score(metric, objective.higher_is_better, metrics[metric], metrics[f"baseline_{metric}"])


def rescore_champion(cfg, shards: Path, model_uri: str, metric: str) -> float:
    """The champion's gate metric on the current test split, by the same routine as the
    evaluate stage; ChampionIncompatible when it cannot take the current data."""
    from training.data.spec import incompatibility
    from training.models import context_length, load_registered_model
    from training.registry import ChampionIncompatible

    model, spec = load_registered_model(model_uri)
    test = TestData.open(cfg, shards, context_length(cfg.model, cfg.task.type))
    trained_on = DataSpec.from_dict(spec.data)
    if problem := incompatibility(trained_on, spec.task, test.data, cfg.task.type):
        raise ChampionIncompatible(problem)
    return test.score(model, cfg.evaluate.batch_size).metrics[metric]
