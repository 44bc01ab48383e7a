"""The DVC stages: `gradline stage NAME` runs one of these with dvc.yaml's paths.

Each stage validates the whole config before it writes anything, and writes its outputs
aside and swaps them in, so a failed stage leaves the previous outputs as they were.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from training.atomic import write_json
from training.config import load_config
from training.data.ingest import ingest
from training.data.shards import read_manifest, split_digest, write_shards
from training.errors import ProjectError
from training.paths import ProjectPaths
from training.tracking import TAG_TEST_DIGEST, client, default_tracking_uri
from training.versioning import data_version

log = logging.getLogger("gradline")


def ingest_stage(root: Path, out: Path, quarantine: Path, report: Path) -> dict[str, Any]:
    cfg = load_config(ProjectPaths(root).params)
    result = ingest(cfg.data, root, out, quarantine, report).to_dict()
    log.info("ingest: %s from %s into %s", result, cfg.data.source, out)
    return result


def shard_stage(root: Path, raw: Path, out: Path) -> dict[str, Any]:
    cfg = load_config(ProjectPaths(root).params)
    manifest = write_shards(cfg.shard, raw, out, data_version(root))
    counts = {name: split["rows"] for name, split in manifest["splits"].items()}
    log.info("shard: %s rows per split into %s", counts, out)
    return counts


def train_stage(
    root: Path, shards: Path, model_dir: Path, checkpoints: Path, result: Path
) -> dict[str, Any]:
    from training.launch import Preempted, launch_workers
    from training.loop import TrainJob, load_model
    from training.runs import log_final_model, mark_complete, open_job_run, set_status

    cfg = load_config(ProjectPaths(root).params)
    manifest = read_manifest(shards)
    tracking_uri = default_tracking_uri(root)
    job = open_job_run(root, cfg, tracking_uri, manifest["data_version"], checkpoints)
    log.info(
        "train: MLflow run %s (%s), %d workers",
        job.run_id,
        "resumed" if job.resumed else "new",
        cfg.train.world_size,
    )
    train_job = TrainJob(
        config=cfg.model_dump(),
        shard_dir=str(shards),
        checkpoint_dir=str(job.checkpoint_dir),
        model_dir=str(model_dir),
        tracking_uri=tracking_uri,
        run_id=job.run_id,
    )
    try:
        final = launch_workers(train_job, cfg.train.world_size, cfg.train.max_restarts)
    except Preempted:
        set_status(tracking_uri, job.run_id, "KILLED")  # resumable: the next run continues it
        raise
    except BaseException:
        set_status(tracking_uri, job.run_id, "FAILED")
        raise
    model, spec = load_model(model_dir)
    example = np.zeros((2, spec.in_features), dtype=np.float32)
    model_uri = log_final_model(tracking_uri, job.run_id, model, example)
    mark_complete(job)
    summary = {
        "run_id": job.run_id,
        "model_uri": model_uri,
        "data_version": manifest["data_version"],
        "final": final,
    }
    write_json(result, summary)
    return summary


def read_train_result(result: Path) -> dict[str, Any]:
    if not result.is_file():
        raise ProjectError(f"{result} not found; run the train stage first (dvc repro train)")
    return json.loads(result.read_text())


def evaluate_stage(
    root: Path, model_dir: Path, shards: Path, result: Path, metrics_out: Path, plots: Path
) -> dict[str, float]:
    from training.evaluate import (
        classification_metrics,
        plot_confusion_matrix,
        plot_loss_curves,
        predict_split,
    )
    from training.loop import load_model

    cfg = load_config(ProjectPaths(root).params)
    trained = read_train_result(result)
    manifest = read_manifest(shards)
    model, spec = load_model(model_dir)
    pred = predict_split(model, shards, manifest, "test", cfg.evaluate.batch_size)
    metrics = classification_metrics(pred)
    image = plots / "confusion_matrix.png"
    plot_confusion_matrix(pred, spec.num_classes, image)
    pairs = zip(pred.y_true.tolist(), pred.y_pred.tolist(), strict=True)
    rows = [{"actual": actual, "predicted": predicted} for actual, predicted in pairs]
    write_json(plots / "predictions.json", rows)
    write_json(metrics_out, metrics)

    mlflow_client = client(default_tracking_uri(root))
    from mlflow.entities import Metric, RunTag

    curves = plots / "loss_curves.png"
    history = {
        key: sorted(
            (m.step, m.value) for m in mlflow_client.get_metric_history(trained["run_id"], key)
        )
        for key in ("train_loss", "val_loss", "val_accuracy")
    }
    plot_loss_curves(history, curves)

    step = int(trained["final"]["step"])
    mlflow_client.log_batch(
        trained["run_id"],
        metrics=[Metric(k, v, int(time.time() * 1000), step) for k, v in metrics.items()],
        tags=[RunTag(TAG_TEST_DIGEST, split_digest(manifest, "test"))],
    )
    for figure in (image, curves):
        mlflow_client.log_artifact(trained["run_id"], str(figure), "evaluation")
    log.info("evaluate: %s", metrics)
    return metrics
