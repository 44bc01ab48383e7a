"""The pipeline as a Prefect flow; its body reads like the data flow in the docs."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task

from tasks.dvc_stages import push_data, reproduce_stage
from tasks.registry import RunSummary, publish_summary, register_model
from training.config import Config, write_overrides
from training.paths import ProjectPaths, find_project_root


@task(name="apply-params")
def apply_params(root: str, overrides: list[str]) -> Config:
    """Validate params.yaml + overrides and record the overrides in params.yaml."""
    return write_overrides(ProjectPaths(Path(root)).params, overrides)


@flow(name="gradline")
def pipeline(overrides: list[str] | None = None, root: str | None = None) -> RunSummary:
    root = str(Path(root).resolve()) if root else str(find_project_root())
    cfg = apply_params(root, list(overrides or []))
    reproduce_stage(root, "ingest")
    push_data(root)
    reproduce_stage(root, "shard")
    reproduce_stage(root, "train")
    reproduce_stage(root, "evaluate")
    summary = register_model(root, cfg)
    publish_summary(summary)
    return summary
