"""Tasks that record results: the model version with its alias, and the run summary."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact

from training.config import Config
from training.paths import ProjectPaths


@dataclass(frozen=True)
class RunSummary:
    data_version: str
    run_id: str
    experiment: str
    tracking_uri: str
    model_name: str
    version: int
    alias: str
    metrics: dict[str, float]
    champion_accuracy: float | None

    def describe(self) -> str:
        metrics = "  ".join(f"{k}={v:.4f}" for k, v in sorted(self.metrics.items()))
        return (
            f"gradline run complete\n"
            f"  data version   {self.data_version}\n"
            f"  MLflow run     {self.run_id} (experiment {self.experiment!r})\n"
            f"  model version  {self.model_name} v{self.version} -> alias {self.alias!r}\n"
            f"  metrics        {metrics}\n"
            f"  tracking store {self.tracking_uri}\n"
            f"  see them with  gradline ui  (MLflow UI and Prefect UI on 127.0.0.1)"
        )


@task(name="register-model")
def register_model(root: str, cfg: Config) -> RunSummary:
    from training.data.shards import read_manifest, split_digest
    from training.evaluate import predict_split
    from training.registry import register_and_gate
    from training.stages import read_train_result
    from training.tracking import default_tracking_uri

    paths = ProjectPaths(Path(root))
    trained = read_train_result(paths.train_result)
    metrics = json.loads(paths.metrics.read_text())
    manifest = read_manifest(paths.shards)
    tracking_uri = default_tracking_uri(paths.root)

    def reevaluate(model_uri: str) -> float:
        import mlflow.pytorch

        champion = mlflow.pytorch.load_model(model_uri)
        pred = predict_split(champion, paths.shards, manifest, "test", cfg.evaluate.batch_size)
        return float((pred.y_true == pred.y_pred).mean())

    registration = register_and_gate(
        tracking_uri,
        cfg.registry.model_name,
        trained["model_uri"],
        trained["run_id"],
        metrics["test_accuracy"],
        split_digest(manifest, "test"),
        reevaluate,
        description=f"data {trained['data_version']}, run {trained['run_id']}",
    )
    return RunSummary(
        data_version=trained["data_version"],
        run_id=trained["run_id"],
        experiment=cfg.registry.experiment,
        tracking_uri=tracking_uri,
        model_name=registration.model_name,
        version=registration.version,
        alias=registration.alias,
        metrics=metrics,
        champion_accuracy=registration.champion_accuracy,
    )


@task(name="publish-summary")
def publish_summary(summary: RunSummary) -> None:
    rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in sorted(summary.metrics.items()))
    previous = (
        "none (first champion)"
        if summary.champion_accuracy is None
        else f"{summary.champion_accuracy:.4f}"
    )
    markdown = f"""# gradline run

| | |
|---|---|
| data version (DVC md5) | `{summary.data_version}` |
| MLflow run | `{summary.run_id}` (experiment `{summary.experiment}`) |
| model version | `{summary.model_name}` v{summary.version} |
| alias | **{summary.alias}** |
| previous champion test_accuracy | {previous} |

| metric | value |
|---|---|
{rows}
"""
    create_markdown_artifact(
        key="gradline-run-summary", markdown=markdown, description="gradline run summary"
    )
    print(json.dumps(asdict(summary), indent=2))
