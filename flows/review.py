"""`gradline lineage` and `gradline runs`: answers for people, read from MLflow."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import yaml

from tasks.dvc_stages import StageFailed, dvc_output
from training.config import load_config
from training.errors import DataError
from training.mlops.filters import equals
from training.mlops.lineage import (
    aliases_by_version,
    artifact_url,
    model_version_url,
    parse_model_ref,
    read_lineage,
    run_url,
    ui_base,
)
from training.mlops.model_card import CARD_ARTIFACT, read_card
from training.mlops.tracking import TAG_DATA_VERSION, client
from training.objectives import TASKS
from training.project import Project, default_tracking_uri


def _prefect_flow_run_url(flow_run_id: str) -> str:
    # Deferred: Prefect takes ~1 s to import, and only a version trained by a flow needs it.
    from prefect.settings import get_current_settings

    base = get_current_settings().ui_url  # derived from PREFECT_API_URL when that is set
    if not base:
        return "(set PREFECT_API_URL to the server that ran it for a link)"
    return f"{base.rstrip('/')}/runs/flow-run/{flow_run_id}"


def lineage_text(root: Path, ref_text: str) -> str:
    cfg = load_config(Project(root).params)
    tracking_uri = default_tracking_uri(root)
    lineage = read_lineage(tracking_uri, parse_model_ref(ref_text))
    base = ui_base(tracking_uri, cfg.orchestrate.mlflow_ui_url)
    aliases = ", ".join(lineage.aliases) or "none"
    dirty = " (with uncommitted changes)" if lineage.git_dirty else ""
    name = f"{lineage.model_name}/{lineage.version}"
    lines = [
        f"model        {name}  aliases: {aliases}",
        f"             {model_version_url(base, lineage.model_name, lineage.version)}",
        f"description  {lineage.description}",
        f"MLflow run   {lineage.run_id} ({lineage.run_status})",
        f"             {run_url(base, lineage.experiment_id, lineage.run_id)}",
        f"data version {lineage.data_version}  (DVC md5 of data/raw; dataset {lineage.dataset})",
        f"             restore it: gradline lineage {name} --restore-data data/restored",
        f"git commit   {lineage.git_commit}{dirty}",
        f"flow run     {lineage.flow_run_id or '(not run by Prefect)'}",
    ]
    if lineage.flow_run_id:
        lines.append(f"             {_prefect_flow_run_url(lineage.flow_run_id)}")
    lines.append("metrics")
    lines += [f"  {k:<28} {v:.6g}" for k, v in sorted(lineage.metrics.items()) if "/" not in k]
    lines.append("params")
    lines += [f"  {k:<28} {v}" for k, v in sorted(lineage.params.items())]
    card = read_card(tracking_uri, lineage.run_id)
    if card is None:
        lines.append("model card   none (registered before gradline wrote model cards)")
    else:
        link = artifact_url(base, lineage.experiment_id, lineage.run_id, CARD_ARTIFACT)
        lines += [f"model card   {CARD_ARTIFACT} of the run", f"             {link}", "", card]
    return "\n".join(lines)


def restore_data(root: Path, ref_text: str, dest: Path) -> Path:
    """Check out the model's training data with DVC (from the cache or the DVC remote)."""
    lineage = read_lineage(default_tracking_uri(root), parse_model_ref(ref_text))
    if not lineage.data_version.endswith(".dir"):
        raise DataError(f"{ref_text}: its run records no DVC data version")
    target = (root / dest).resolve() if not dest.is_absolute() else dest.resolve()
    if not target.is_relative_to(root):
        raise DataError(f"--restore-data {dest}: must be a folder inside the project {root}")
    if target.exists() and any(target.iterdir()):
        raise DataError(f"--restore-data {dest}: exists and is not empty; name a new folder")
    # A throwaway .dvc file naming that md5 lets DVC fetch and check it out like any output.
    pointer = target.with_name(target.name + ".dvc")
    if pointer.exists():
        raise DataError(f"--restore-data {dest}: {pointer.name} already exists; name a new folder")
    pointer.write_text(
        # `hash: md5` marks a DVC 3 entry; without it DVC looks in its 2.x cache layout.
        yaml.safe_dump(
            {"outs": [{"md5": lineage.data_version, "hash": "md5", "path": target.name}]}
        )
    )
    try:
        dvc_output(root, "pull", str(pointer.relative_to(root)))
    except StageFailed as exc:
        raise DataError(
            f"dvc could not restore data version {lineage.data_version}: {exc}"
        ) from exc
    finally:
        pointer.unlink(missing_ok=True)
    return target


def runs_text(root: Path, limit: int) -> str:
    cfg = load_config(Project(root).params)
    mlflow_client = client(default_tracking_uri(root))
    experiment = mlflow_client.get_experiment_by_name(cfg.registry.experiment)
    if experiment is None:
        return f"no runs yet in experiment {cfg.registry.experiment!r}; start one: gradline run"
    runs = mlflow_client.search_runs(
        [experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=limit
    )
    name = cfg.registry.model_name
    versions = {}
    if found := mlflow_client.search_model_versions(equals(name=name)):
        aliases = aliases_by_version(mlflow_client, name)
        for v in found:
            tags = "".join(f" @{a}" for a in aliases.get(str(v.version), []))
            versions[v.run_id] = f"v{v.version}{tags}"
    header = (
        "started (UTC)",
        "run",
        "status",
        "data",
        "task",
        "metric",
        "model",
        "baseline",
        "model version",
    )
    rows = [header]
    for run in runs:
        started = datetime.fromtimestamp(run.info.start_time / 1000, UTC)
        metrics = run.data.metrics
        task = run.data.params.get("task.type", "classification")
        # Each run shows its own task's metric.
        metric = TASKS[task].gate_metric if task in TASKS else "test_loss"
        rows.append(
            (
                started.strftime("%Y-%m-%d %H:%M"),
                run.info.run_id[:12],
                run.info.status,
                run.data.tags.get(TAG_DATA_VERSION, "")[:10],
                task,
                metric,
                *(
                    f"{metrics[k]:.4f}" if k in metrics else "-"
                    for k in (metric, f"baseline_{metric}")
                ),
                versions.get(run.info.run_id, "-"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
