"""The pipeline's register step, without Prefect: ship what the project's jobs kept in
their journals, register the trained run's model once, gate it, write its card.

The flow runs it as `gradline stage register` in a fork of its stage host, which has
MLflow (and torch, for re-scoring a champion) imported already; `gradline sync` and a
flow without a host run it in their own process.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from training.config import Config
from training.data.manifest import MANIFEST, read_manifest, split_digest
from training.mlops.drift import record_drift
from training.mlops.lineage import version_tags
from training.mlops.model_card import TAG_MODEL_CARD, CardSources, card_link, card_uri, write_card
from training.mlops.registry import gate_score, register_and_gate
from training.mlops.summary import RunSummary, summarize
from training.mlops.sync import run_model_uri, ship_when_back
from training.mlops.tracking import client
from training.project import Project


def register_trained(
    root: Path, cfg: Config, wait_s: float, say: Callable[[str], None]
) -> RunSummary:
    """Ship every pending journal of the project (waiting up to `wait_s` for a tracking
    server that is down, saying so through `say`), then register the trained run's model
    once and gate it on the task's metric against its baseline and the champion, both on
    the current test split."""
    project = Project(root)
    trained = project.read_train_result()
    metrics = json.loads(project.metrics.read_text())
    manifest = read_manifest(project.shards)
    tracking_uri = project.tracking_uri
    ship_when_back(tracking_uri, project.checkpoints, wait_s, say, "register the model")
    # A job that ended while the server was down logged its model when it shipped.
    model_uri = trained["model_uri"] or run_model_uri(tracking_uri, trained["run_id"])
    run = client(tracking_uri).get_run(trained["run_id"])
    score = gate_score(cfg, metrics)
    # The champion's reference for the next drift check, and this data's drift.
    drift_note = record_drift(project, cfg, trained["run_id"])
    registration = register_and_gate(
        tracking_uri,
        cfg.registry.model_name,
        model_uri,
        trained["run_id"],
        score,
        split_digest(manifest, "test"),
        lambda uri: _rescore_champion(cfg, project.shards, uri, score.metric, tracking_uri),
        tags={**version_tags(run.data.tags), TAG_MODEL_CARD: card_uri(run.info.run_id)},
        card_link=card_link(run.info.experiment_id, run.info.run_id),
        note=drift_note,
    )
    # Once the gate has decided (its verdict is in the card); written again by every
    # registration of the run, so a card cut short is completed by the next run.
    sources = CardSources(project.shards / MANIFEST, project.ingest_report, project.train_result)
    write_card(
        tracking_uri,
        registration.model_name,
        registration.version,
        registration.verdict,
        cfg.task.card,
        sources,
    )
    return summarize(cfg, project.root, trained["run_id"], "completed", registration.verdict)


def _rescore_champion(cfg: Config, shards: Path, model_uri: str, metric: str, uri: str) -> float:
    # Imported only when there is a champion to re-score: it needs torch.
    from training.mlops.serving import rescore_champion

    return rescore_champion(cfg, shards, model_uri, metric, uri)
