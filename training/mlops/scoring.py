"""`gradline score`: a registered model version's predictions on new rows, as Parquet.

The version (`NAME@ALIAS`, `NAME/VERSION`; by default `<registry.model_name>@champion`)
is downloaded from the registry and run as the pyfunc model runs it (`Predictor`: the
same model folder, the same task code), so its predictions equal `mlflow.pyfunc`'s on
the same rows. The new rows stream through ingest's validation batch by batch
(training/data/score_input.py), read ahead and written behind on threads while the
model predicts (training/mlops/score_output.py), so memory stays a few batches whatever
the input's size.

The output holds the row key (the input's id column, else `file` and `row`), the
`prediction` (what the pyfunc model returns: a class id, a value, or for a language
model the sampled continuation) and what else the task knows per row (classification:
`prob_<class>`). It and the quarantine file beside it (`<name>.quarantine.parquet`:
origin, row, reason, the row as JSON) are written aside and renamed into place only
when the whole input was read; with `on_bad_rows: fail`, a bad row stops the command
before anything is written, naming how many rows failed and why.

`record_score_run` records the result as an MLflow run in the experiment of the version's
training run: which version (name, version, its run id), the input's md5, rows scored
and quarantined, the outputs' DVC md5s.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from training.config import Config
from training.data.score_input import InputBatch, InputOptions, NewRows
from training.errors import ConfigError
from training.mlops.lineage import parse_model_ref, resolve_version
from training.mlops.score_output import (
    Background,
    Prediction,
    quarantine_path,
    write_predictions,
)
from training.mlops.serving import Predictor, downloaded_model
from training.mlops.tracking import (
    FLOW_RUN_ENV,
    TAG_FLOW_RUN,
    TAG_GIT_COMMIT,
    TAG_GIT_DIRTY,
    client,
    git_commit,
)
from training.objectives.base import PREDICT_BATCH_ROWS

TAG = "gradline.score."  # every tag of a scoring run starts with it
# Outputs up to this size are logged on the run too; larger ones are referenced (path and
# DVC md5: `dvc pull` fetches them).
LOG_ARTIFACT_BYTES = 16 << 20


@dataclass(frozen=True)
class ScoredModel:
    """The registered version that scores, and where it came from."""

    name: str
    version: int
    run_id: str  # its training run
    experiment_id: str  # the training run's experiment: scoring runs go there too
    alias: str | None  # how it was named, when by alias

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"

    def __str__(self) -> str:
        return f"{self.name}/{self.version}" + (f" (@{self.alias})" if self.alias else "")


@dataclass(frozen=True)
class ScoreRequest:
    """What to score with which version; defaults from the `score` section."""

    model: str  # NAME@ALIAS or NAME/VERSION
    input: str
    output: str
    on_bad_rows: str  # fail | quarantine
    options: InputOptions
    generation: dict[str, Any] = field(default_factory=dict)  # language models' overrides

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        model: str | None = None,
        input: str | None = None,
        output: str | None = None,
        on_bad_rows: str | None = None,
    ) -> ScoreRequest:
        score = cfg.score
        input_path = input or score.input
        generation = {
            key: getattr(score, key)
            for key in ("max_new_tokens", "temperature", "top_k", "seed")
            if getattr(score, key) is not None
        }
        bad_rows = on_bad_rows or score.on_bad_rows
        if bad_rows not in ("fail", "quarantine"):
            raise ConfigError(f"on_bad_rows must be fail or quarantine, not {bad_rows!r}")
        output_path = output or score.output
        if not output_path.endswith(".parquet"):
            raise ConfigError(f"the output {output_path!r} must be a .parquet file")
        return cls(
            model=model or score.model or f"{cfg.registry.model_name}@champion",
            input=input_path,
            output=output_path,
            on_bad_rows=bad_rows,
            options=InputOptions(
                path=input_path,
                format=score.format,
                key_column=score.key_column,
                tensor_column=score.tensor_column,
                prompt_column=score.prompt_column,
                batch_rows=score.batch_rows,
            ),
            generation=generation,
        )


@dataclass(frozen=True)
class ScoreOutcome:
    model: ScoredModel
    input: str
    input_md5: str
    output: str  # relative to the project
    quarantine: str
    rows_scored: int
    rows_quarantined: int
    report: dict
    columns: list[str]
    seconds: float

    @property
    def rows_per_s(self) -> float:
        return self.rows_scored / self.seconds if self.seconds > 0 else math.nan

    def to_dict(self) -> dict:
        values = asdict(self)
        values["model"] = {**asdict(self.model), "uri": self.model.uri}
        return values


def project_path(root: Path, path: str, what: str) -> Path:
    """`path` resolved in the project; outputs must lie inside it, where DVC tracks them."""
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise ConfigError(
            f"the {what} {path!r} is outside the project ({root}): DVC tracks only files "
            "inside it; give a path under the project, e.g. data/scores/predictions.parquet"
        )
    return resolved


def resolve_model(tracking_uri: str, text: str) -> ScoredModel:
    """The registered version `text` names (TrackingError listing the versions if none)."""
    ref = parse_model_ref(text)
    mlflow_client = client(tracking_uri)
    version = resolve_version(mlflow_client, ref)
    run = mlflow_client.get_run(version.run_id)
    return ScoredModel(
        ref.name, int(version.version), version.run_id, run.info.experiment_id, ref.alias
    )


@contextlib.contextmanager
def loaded_model(tracking_uri: str, model: ScoredModel) -> Iterator[tuple[Predictor, dict]]:
    """The version's `Predictor` for the `with` block, and its signature's params (a
    language model's sampling defaults: what the pyfunc model uses when given none)."""
    with downloaded_model(model.uri, tracking_uri) as (folder, logged):
        params = logged.signature.params if logged.signature else None
        defaults = {p.name: p.default for p in params.params} if params else {}
        yield Predictor(folder), defaults


def score_new_rows(
    root: Path, cfg: Config, request: ScoreRequest, tracking_uri: str
) -> ScoreOutcome:
    """Score `request.input` with the version it names into `request.output` (and the
    quarantine file beside it); on any failure neither is written."""
    output = project_path(root, request.output, "output")
    if output.is_relative_to((root / request.input).resolve()):
        raise ConfigError(
            f"the output {request.output!r} lies inside the input {request.input!r}: the next "
            "scoring would read the predictions as new rows; write them elsewhere"
        )
    model = resolve_model(tracking_uri, request.model)
    with loaded_model(tracking_uri, model) as (predictor, defaults):
        predictor.objective.check_scores_rows()
        rows = NewRows(root, request.options, predictor.spec.data_spec, cfg.data)
        prediction = _prediction(predictor, {**defaults, **request.generation})
        started = time.perf_counter()
        # The input is hashed while it is scored (hashing and reading release the GIL);
        # the md5 lands in the output's footer, written last.
        md5 = Background(rows.md5)
        footer = {f"{TAG}model": str(model), f"{TAG}model_run_id": model.run_id}
        written = write_predictions(
            rows,
            prediction,
            output,
            request.on_bad_rows == "fail",
            lambda: {**footer, f"{TAG}input_md5": md5.result()},
        )
        input_md5 = md5.result()
        seconds = time.perf_counter() - started
    report = rows.report
    return ScoreOutcome(
        model=model,
        input=request.input,
        input_md5=input_md5,
        output=str(output.relative_to(root.resolve())),
        quarantine=str(quarantine_path(output).relative_to(root.resolve())),
        rows_scored=report.rows_in - report.rows_bad,
        rows_quarantined=report.rows_bad,
        report=report.to_dict(),
        columns=written,
        seconds=seconds,
    )


def _prediction(predictor: Predictor, generation: dict[str, Any]) -> Prediction:
    """How the pyfunc model predicts a batch, and the columns the output keeps of it."""
    objective, model = predictor.objective, predictor.model
    if predictor.spec.data_spec.kind == "tokens":

        def generate(batch: InputBatch) -> dict[str, Any]:
            texts = objective.serve(model, batch.prompts, generation)
            return {"prediction": pa.array(texts["text"].tolist(), pa.string())}

        return Prediction(generate, lambda columns: columns)

    def forward(batch: InputBatch) -> torch.Tensor:
        features = torch.from_numpy(batch.features)
        with torch.no_grad():  # forward passes of the pyfunc model's size
            return torch.cat(
                [
                    model(features[start : start + PREDICT_BATCH_ROWS])
                    for start in range(0, batch.rows, PREDICT_BATCH_ROWS)
                ]
            )

    # The task's columns (argmax, softmax: row by row) once per batch, on the writer.
    return Prediction(forward, objective.prediction_columns)


# ---- the record ------------------------------------------------------------------------


def record_score_run(
    root: Path,
    tracking_uri: str,
    outcome: ScoreOutcome,
    tracked: dict[str, str],
    flow_run_id: str | None = None,
) -> str:
    """An MLflow run, in the experiment of the version's training run, recording what was
    scored with which version; `tracked`: the outputs' DVC md5s by path; `flow_run_id`: the
    Prefect flow run that scored (else the one in the environment). Returns its id."""
    from mlflow.entities import Metric

    model = outcome.model
    tags = {
        "mlflow.runName": f"score {model.name} v{model.version}",
        f"{TAG}model_name": model.name,
        f"{TAG}model_version": str(model.version),
        f"{TAG}model_run_id": model.run_id,
        f"{TAG}input": outcome.input,
        f"{TAG}input_md5": outcome.input_md5,
        f"{TAG}output": outcome.output,
        f"{TAG}output_md5": tracked.get(outcome.output, ""),
        f"{TAG}quarantine": outcome.quarantine,
        f"{TAG}quarantine_md5": tracked.get(outcome.quarantine, ""),
        f"{TAG}rows_scored": str(outcome.rows_scored),
        f"{TAG}rows_quarantined": str(outcome.rows_quarantined),
    }
    if model.alias:
        tags[f"{TAG}model_alias"] = model.alias
    if commit := git_commit(root):
        tags[TAG_GIT_COMMIT], tags[TAG_GIT_DIRTY] = commit[0], str(commit[1]).lower()
    if flow_run := flow_run_id or os.environ.get(FLOW_RUN_ENV):
        tags[TAG_FLOW_RUN] = flow_run
    mlflow_client = client(tracking_uri)
    run_id = mlflow_client.create_run(model.experiment_id, tags=tags).info.run_id
    now = int(time.time() * 1000)
    values = {
        "rows_scored": outcome.rows_scored,
        "rows_quarantined": outcome.rows_quarantined,
        "score_seconds": outcome.seconds,
        "rows_per_s": outcome.rows_per_s,
    }
    metrics = [Metric(k, float(v), now, 0) for k, v in values.items() if math.isfinite(v)]
    mlflow_client.log_batch(run_id, metrics=metrics)
    _log_input(mlflow_client, run_id, root, outcome)
    mlflow_client.log_dict(run_id, {**outcome.to_dict(), "dvc_md5": tracked}, "score/summary.json")
    for relative in (outcome.output, outcome.quarantine):
        path = root / relative
        if path.stat().st_size <= LOG_ARTIFACT_BYTES:
            mlflow_client.log_artifact(run_id, str(path), "score")
    mlflow_client.set_terminated(run_id, "FINISHED")
    return run_id


def _log_input(mlflow_client, run_id: str, root: Path, outcome: ScoreOutcome) -> None:
    """The new rows as the run's dataset input (context `scoring`), digest = their md5."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    with warnings.catch_warnings():  # two registered classes claim local paths; either fits
        warnings.simplefilter("ignore", UserWarning)
        source = resolve_dataset_source((root / outcome.input).resolve().as_uri())
    name = f"score-input-{Path(outcome.input).name}"
    dataset = MetaDataset(source=source, name=name, digest=outcome.input_md5)
    context = [InputTag("mlflow.data.context", "scoring")]
    mlflow_client.log_inputs(run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(), context)])


def describe(outcome: ScoreOutcome, run_id: str | None = None) -> str:
    """The summary `gradline score` prints."""
    lines = [
        "gradline score complete",
        f"  model          {outcome.model} (trained in run {outcome.model.run_id})",
        f"  input          {outcome.input} (md5 {outcome.input_md5})",
        f"  rows           {outcome.rows_scored} scored, {outcome.rows_quarantined} quarantined"
        f" ({outcome.rows_per_s:,.0f} rows/s)",
        f"  predictions    {outcome.output}  columns: {', '.join(outcome.columns)}",
    ]
    if outcome.rows_quarantined:
        reasons = ", ".join(f"{r}: {n}" for r, n in outcome.report["invalid_by_reason"].items())
        lines.append(f"  quarantined    {outcome.quarantine}  ({reasons})")
    if run_id:
        lines.append(f"  MLflow run     {run_id} (experiment {outcome.model.experiment_id})")
    return "\n".join(lines)
