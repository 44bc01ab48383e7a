"""What a pipeline run leaves to say: the run, its model version, metrics and gate, and
whether an unchanged project is already up to date with its last run (no Prefect here:
`gradline run` answers that before it starts a server)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from training.config import Config
from training.mlops.lineage import model_version_url, run_url, ui_base
from training.mlops.registry import is_gated, version_of_run
from training.mlops.tracking import TAG_DATA_VERSION, client, redact_uri
from training.project import Project, default_tracking_uri


@dataclass(frozen=True)
class RunSummary:
    status: str  # "completed" or "skipped"
    data_version: str
    run_id: str
    run_url: str
    experiment: str
    tracking_uri: str
    model_name: str
    version: int
    version_url: str
    alias: str
    metrics: dict[str, float] = field(default_factory=dict)
    verdict: str = ""

    @property
    def headline(self) -> str:
        if self.status == "skipped":
            return f"up to date with run {self.run_id}"
        return f"trained run {self.run_id}"

    def describe(self) -> str:
        metrics = "  ".join(
            f"{k}={v:.4f}"
            + (
                f" (baseline {b:.4f}"
                # A task with a second baseline (forecasting's last value) shows it too.
                + (
                    f", last value {last:.4f}"
                    if (last := self.metrics.get(f"baseline_last_value_{k}")) is not None
                    else ""
                )
                + ")"
                if (b := self.metrics.get(f"baseline_{k}")) is not None
                else ""
            )
            for k, v in sorted(self.metrics.items())
            if not k.startswith("baseline_")
        )
        first = (
            f"gradline: nothing changed, {self.headline} (pass --force to retrain)"
            if self.status == "skipped"
            else "gradline run complete"
        )
        return (
            f"{first}\n"
            f"  data version   {self.data_version}\n"
            f"  MLflow run     {self.run_id} (experiment {self.experiment!r})\n"
            f"                 {self.run_url}\n"
            f"  model version  {self.model_name} v{self.version} -> alias {self.alias!r}\n"
            f"                 {self.version_url}\n"
            f"  metrics        {metrics}\n"
            f"  gate           {self.verdict.split('. ')[0]}\n"
            f"  tracking store {self.tracking_uri}\n"
            f"  see them with  gradline ui  (MLflow UI and Prefect UI on 127.0.0.1)"
        )


def summarize(cfg: Config, root: Path, run_id: str, status: str, verdict: str = "") -> RunSummary:
    """Build the summary from what MLflow recorded for `run_id`."""
    tracking_uri = default_tracking_uri(root)
    mlflow_client = client(tracking_uri)
    run = mlflow_client.get_run(run_id)
    name = cfg.registry.model_name
    version = version_of_run(mlflow_client, name, run_id)
    base = ui_base(tracking_uri, cfg.orchestrate.mlflow_ui_url)
    return RunSummary(
        status=status,
        data_version=run.data.tags.get(TAG_DATA_VERSION, ""),
        run_id=run_id,
        run_url=run_url(base, run.info.experiment_id, run_id),
        experiment=cfg.registry.experiment,
        tracking_uri=redact_uri(tracking_uri),  # printed and published
        model_name=name,
        version=int(version.version),
        version_url=model_version_url(base, name, int(version.version)),
        alias=",".join(version.aliases) or "(none)",
        metrics={
            k: v
            for k, v in run.data.metrics.items()
            if k.startswith(("test_", "baseline_test_", "baseline_last_value_test_"))
        },
        verdict=verdict or version.description or "",
    )


def up_to_date_run(
    root: Path,
    cfg: Config,
    stale: Callable[[Path], dict],
    say: Callable[[str], None],
    changes_first: bool = False,
) -> RunSummary | None:
    """The last run's summary when data, params and code are all as it left them.

    DVC decides what changed (`stale(root)`: `dvc status`, whose stage deps are the data
    source, the params and the stages' code); the run itself must have finished and been
    registered. `changes_first`: ask DVC before MLflow, which is then imported only when
    nothing changed (the flow, whose process has no other use for MLflow); otherwise
    MLflow first, while a `stale` started in the background (the CLI's) runs.
    """
    paths = Project(root)
    if not paths.train_result.is_file():
        say("no previous run in this project")
        return None  # before importing MLflow (~1.6 s): a first run has no use for it yet
    if changes_first and _changed(stale, paths.root, say):
        return None
    from mlflow.exceptions import MlflowException

    run_id = paths.read_train_result()["run_id"]
    mlflow_client = client(default_tracking_uri(paths.root))
    try:
        finished = mlflow_client.get_run(run_id).info.status == "FINISHED"
    except MlflowException:
        finished = False
    registered = is_gated(mlflow_client, cfg.registry.model_name, run_id)
    if not changes_first and _changed(stale, paths.root, say):
        return None
    if not (finished and registered):
        say(f"run {run_id} is not finished and registered; completing it")
        return None
    return summarize(cfg, paths.root, run_id, "skipped")


def _changed(stale: Callable[[Path], dict], root: Path, say: Callable[[str], None]) -> bool:
    """Whether DVC finds anything changed since the last run (said, when it does)."""
    changed = stale(root)
    if changed:
        say(f"changed since the last run: {', '.join(sorted(changed))}")
    return bool(changed)
