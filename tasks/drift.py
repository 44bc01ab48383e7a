"""The drift check after ingest: orchestrate.drift applied to the ingested data's drift
from the champion's (computed by the ingest stage, training.mlops.drift)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from training.config import Config
from training.errors import DriftBlocked
from training.mlops.drift import accept, accepted_versions, decide, ingested_drift
from training.mlops.versioning import data_version
from training.project import Project


@task(name="check-drift", task_run_name="check-drift")
def check_drift(root: str, cfg: Config, accept_drift: bool = False) -> str:
    """Say how far the new data drifted from the champion's; under orchestrate.drift:
    block, stop the run (DriftBlocked) before anything trains, unless this data version's
    drift was accepted (`accept_drift` now, or by an earlier run)."""
    logger = get_run_logger()
    project = Project(Path(root))
    drift = ingested_drift(project)
    version = data_version(project.root)
    accepted = version in accepted_versions(project.root)
    decision = decide(drift, cfg.orchestrate, accepted or accept_drift)
    if decision.blocked:
        raise DriftBlocked(decision.message)
    if decision.drifted:
        if accept_drift and cfg.orchestrate.drift == "block":
            accept(project.root, version)  # later runs on this data do not ask again
        logger.warning(decision.message)
    else:
        logger.info(decision.message)
    return decision.message
