"""Model cards: the bootstrap behind their intervals (against a plain resampling and the
normal approximation), their markdown, and, end to end, the card of a version
registered by `gradline run`: its numbers are the run's, its intervals hold the point
estimates, it is an artifact of the run, the version's description links it and
`gradline lineage` prints it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_objectives import ArrayReader, classification, language_model, regression
from training.objectives import TASKS
from training.objectives import base as objectives_base
from training.objectives import bootstrap as bootstrap_module
from training.objectives.bootstrap import Bootstrap

from .conftest import _client, _gradline

BYTES_VOCAB = 257


def _outputs(task: str, rows: int, seed: int = 5):
    rng = np.random.default_rng(seed)
    if task == "classification":
        objective = classification(4)
        output = torch.from_numpy(rng.normal(size=(rows, 4))).float()
        target = torch.from_numpy(rng.integers(0, 4, size=rows))
    elif task == "regression":
        objective = regression(label_mean=10.0, label_std=3.0)
        output = torch.from_numpy(rng.normal(10, 3, size=(rows, 1))).float()
        target = torch.from_numpy(rng.normal(10, 3, size=rows)).float()
    else:
        objective = language_model(rng.integers(1, 4, size=BYTES_VOCAB))
        output = torch.from_numpy(rng.normal(size=(rows, 5, BYTES_VOCAB))).float()
        target = torch.from_numpy(rng.integers(0, BYTES_VOCAB, size=(rows, 5)))
    return objective, output, target


@pytest.mark.parametrize("task", ["classification", "regression", "language_modeling"])
def test_row_statistics_add_up_to_the_batch_statistics(task: str) -> None:
    """Each task's one-pass row statistics are its batch statistics row by row (what the
    generic fallback computes) and sum to the batch's."""
    objective, output, target = _outputs(task, 37)
    rows = objective.row_stats(output, target)
    dense = rows.to_dense() if rows.is_sparse else rows
    assert dense.shape == (37, objective.num_stats)
    generic = objectives_base.Objective.row_stats(objective, output, target)
    assert torch.allclose(dense, generic, rtol=1e-6, atol=1e-9)
    # (float32 losses summed in another order: equal to float32's precision)
    assert torch.allclose(dense.sum(0), objective.batch_stats(output, target), rtol=1e-6)


def _scored_with_intervals(objective, reader, batch_size: int, replicates: int, seed: int):
    model = torch.nn.Linear(reader.x.shape[1], objective.output_size)
    torch.manual_seed(0)
    boot = Bootstrap(replicates, seed)
    rows = np.arange(reader.num_rows)
    scored = objective.score(model, reader, rows, batch_size, "cpu", bootstrap=boot)
    return scored.metrics, boot


def _table(rows: int, seed: int = 1) -> ArrayReader:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    y = (x[:, 0] + 0.8 * rng.normal(size=rows) > 0).astype(np.int64) * 2 + (x[:, 1] > 0)
    return ArrayReader(x, y)


def test_intervals_depend_on_the_seed_and_rows_not_on_the_batch_size() -> None:
    torch.manual_seed(0)
    objective, reader = classification(4), _table(300)
    model = torch.nn.Linear(4, 4)

    def intervals(batch_size: int, seed: int) -> dict:
        boot = Bootstrap(200, seed)
        rows = np.arange(reader.num_rows)
        objective.score(model, reader, rows, batch_size, "cpu", bootstrap=boot)
        return boot.intervals

    first = intervals(7, seed=3)
    assert set(first) == {f"test_{name}" for name in objective.metric_names}
    assert intervals(64, seed=3) == first == intervals(7, seed=3)
    assert intervals(64, seed=4) != first


def test_accuracy_interval_matches_the_normal_approximation() -> None:
    """A model right on ~80 % of 4000 rows: the bootstrap's 95 % interval is p +- 1.96
    sqrt(p(1-p)/n) to within a few percent of its width, and holds p."""
    rng = np.random.default_rng(7)
    rows, classes = 4000, 2
    y = rng.integers(0, classes, size=rows)
    right = rng.random(rows) < 0.8
    predicted = np.where(right, y, 1 - y)
    logits = np.eye(classes, dtype=np.float32)[predicted] * 4.0
    objective = classification(classes)
    boot = Bootstrap(2000, 0)
    forward = lambda x: x  # noqa: E731  (the rows are the logits themselves)
    metrics = objective.score(
        forward, ArrayReader(logits, y), np.arange(rows), 512, "cpu", bootstrap=boot
    ).metrics
    p = metrics["test_accuracy"]
    low, high = boot.intervals["test_accuracy"]
    half = 1.96 * math.sqrt(p * (1 - p) / rows)
    assert low < p < high
    assert (high - low) / 2 == pytest.approx(half, rel=0.08)
    assert (low + high) / 2 == pytest.approx(p, abs=0.2 * half)


def test_regression_intervals_agree_with_a_plain_resampling_of_rows() -> None:
    """The Poisson bootstrap's RMSE and MAE intervals against the textbook one: n rows
    drawn with replacement, 4000 times, with numpy."""
    rng = np.random.default_rng(11)
    rows = 600
    label = rng.normal(5.0, 2.0, size=rows).astype(np.float32)
    prediction = (label + rng.standard_t(3, size=rows)).astype(np.float32)  # heavy tails
    objective = regression(label_mean=5.0, label_std=2.0)
    boot = Bootstrap(4000, 1)
    reader = ArrayReader(prediction.reshape(-1, 1), label)
    objective.score(lambda x: x, reader, np.arange(rows), 100, "cpu", bootstrap=boot)

    error = (prediction - label).astype(np.float64)
    picks = np.random.default_rng(2).integers(0, rows, size=(4000, rows))
    textbook = {
        "test_rmse": np.sqrt((error[picks] ** 2).mean(axis=1)),
        "test_mae": np.abs(error[picks]).mean(axis=1),
    }
    for key, values in textbook.items():
        low, high = np.percentile(values, [2.5, 97.5])
        ours = boot.intervals[key]
        assert ours[0] == pytest.approx(low, abs=0.08 * (high - low)), key
        assert ours[1] == pytest.approx(high, abs=0.08 * (high - low)), key


def test_the_baseline_is_resampled_alike_under_its_own_keys() -> None:
    objective = classification(4)
    train, test = _table(400, seed=2), _table(300, seed=3)
    boot = Bootstrap(300, 5)
    baseline = objective.baseline(train, test, max_rows=400, bootstrap=boot)
    assert set(boot.intervals) == set(baseline)
    for key, value in baseline.items():
        low, high = boot.intervals[key]
        assert low <= value <= high
    again = Bootstrap(300, 5)
    objective.baseline(train, test, max_rows=400, bootstrap=again)
    assert again.intervals == boot.intervals


def test_too_many_statistics_skip_intervals_and_say_why(monkeypatch) -> None:
    monkeypatch.setattr(bootstrap_module, "MAX_CELLS", 17 * 50)  # 50 resamples of 4x4+1
    metrics, boot = _scored_with_intervals(classification(4), _table(50), 16, 1000, 0)
    assert boot.intervals == {} and "no intervals" in boot.note
    assert metrics["test_accuracy"] >= 0.0  # the metrics themselves are unaffected


# --- the markdown ----------------------------------------------------------------------


def results_table(card: str) -> dict[str, tuple[float, tuple, float, tuple]]:
    """metric -> (model, (low, high), baseline, (low, high)) from the card's results."""
    found = {}
    pair = r"\[(-?[\d.]+|inf|n/a), (-?[\d.]+|inf|n/a)\]"
    pattern = re.compile(
        rf"^\| (test_\w+) \| (-?[\d.]+) \| {pair} \| (-?[\d.]+) \| {pair} \|$", re.MULTILINE
    )
    for match in pattern.finditer(card):
        key, model, low, high, baseline, base_low, base_high = match.groups()
        found[key] = (
            float(model),
            (float(low), float(high)),
            float(baseline),
            (float(base_low), float(base_high)),
        )
    return found


def _facts(**changes):
    from training.mlops.model_card import CardFacts

    task = TASKS["classification"]
    facts = dict(
        model_name="m",
        version=3,
        aliases=["champion"],
        verdict="champion: test_accuracy 0.9000 beats the baseline's 0.8000; first champion",
        task=task.name,
        gate_metric=task.gate_metric,
        higher_is_better=True,
        run_id="r1",
        experiment_id="7",
        start_ms=1_700_000_000_000,
        end_ms=1_700_000_060_000,
        metrics={"test_accuracy": 0.9, "baseline_test_accuracy": 0.8, "train_seconds": 12.5},
        params={"model.name": "mlp", "model.hidden": "64", "update.rule": "sync"},
        tags={
            "gradline.job_key": "abc",
            "gradline.runtime.procs_per_node": "2",
            "gradline.parallel.dp_replicate": "-1",  # the rest of the workers
        },
        details={
            "test_rows": 100,
            "parameters": 1234,
            "bootstrap": {
                "confidence": 0.95,
                "replicates": 1000,
                "seed": 0,
                "intervals": {
                    "test_accuracy": [0.84, 0.95],
                    "baseline_test_accuracy": [0.72, 0.87],
                },
            },
            "per_class": {"recall": [1.0, 0.5, math.nan, 0.75], "support": [40, 20, 0, 40]},
        },
    )
    facts.update(changes)
    return CardFacts(**facts)


def test_card_markdown_shows_metrics_drift_hook_selected_step_and_worst_recall() -> None:
    from training.mlops.card_markdown import NO_DRIFT, render

    card = render(_facts())
    assert results_table(card) == {
        "test_accuracy": (0.9, (0.84, 0.95), 0.8, (0.72, 0.87)),
    }
    assert NO_DRIFT in card
    assert "| parameters | 1,234 |" in card
    assert "2 workers (1 node x 2); mesh dp_replicate=2 dp_shard=1 tp=1 pp=1" in card
    # The worst recall first; a class absent from the split is not ranked.
    assert "Worst recall: class 1: 0.5000 (10 of 20 test rows); class 3: 0.7500" in card
    assert "class 2:" not in card.split("Worst recall")[1]
    assert "model from step" not in card

    drift = {"verdict": "warn", "psi_max": 0.31, "top": [{"feature": "x3", "psi": 0.31}]}
    card = render(_facts(drift=drift, final={"step": 400, "selected_step": 250}))
    assert NO_DRIFT not in card
    assert "| verdict | warn |" in card and "| psi_max | 0.31 |" in card
    assert "| feature | psi |" in card and "| x3 | 0.31 |" in card
    assert "| model from step | 250 (train.select: best) |" in card
    assert "| steps | 400 |" in card


def test_a_card_without_intervals_says_why() -> None:
    from training.mlops.card_markdown import render

    details = {"test_rows": 5, "bootstrap": {"intervals": {}, "note": "no intervals: too big"}}
    card = render(_facts(details=details))
    assert "No intervals: no intervals: too big" in card
    assert "| test_accuracy | 0.9000 | n/a | 0.8000 | n/a |" in card


# --- end to end: the card of a version `gradline run` registered ------------------------


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_registered_version_has_a_card_with_the_run_s_numbers(first_run, tmp_path) -> None:
    from training.mlops.model_card import card_link

    project, _, run_id = first_run
    client = _client(project)
    (found,) = client.search_model_versions(f"name='gradline-digits' and run_id='{run_id}'")
    version = client.get_model_version("gradline-digits", found.version)
    run = client.get_run(run_id)

    # An artifact of the version's run, linked from its description and tags.
    assert "model_card.md" in {a.path for a in client.list_artifacts(run_id)}
    card = Path(client.download_artifacts(run_id, "model_card.md", str(tmp_path))).read_text()
    link = card_link(run.info.experiment_id, run_id)
    assert link == (
        f"#/experiments/{run.info.experiment_id}/runs/{run_id}/artifacts/model_card.md"
        "?workflowType=machine_learning"
    )
    assert f"Model card: [model_card.md]({link})." in version.description
    assert version.tags["gradline.model_card"] == f"runs:/{run_id}/model_card.md"

    # Every test metric of the run, with the run's value, beside its baseline's; each
    # interval holds its point estimate and is the one the evaluation recorded.
    table = results_table(card)
    metrics = run.data.metrics
    assert set(table) == {k for k in metrics if k.startswith("test_")}
    details = json.loads(
        Path(
            client.download_artifacts(run_id, "evaluation/details.json", str(tmp_path))
        ).read_text()
    )
    recorded = details["bootstrap"]["intervals"]
    assert details["bootstrap"]["replicates"] == 1000 and details["bootstrap"]["seed"] == 0
    for key, (model, (low, high), baseline, (base_low, base_high)) in table.items():
        assert model == pytest.approx(metrics[key], abs=5e-5), key
        assert baseline == pytest.approx(metrics[f"baseline_{key}"], abs=5e-5), key
        assert low <= metrics[key] <= high and low < high, (key, low, high)
        assert base_low <= metrics[f"baseline_{key}"] <= base_high, key
        assert (low, high) == pytest.approx(tuple(recorded[key]), abs=5e-5)
        assert (base_low, base_high) == pytest.approx(tuple(recorded[f"baseline_{key}"]), abs=5e-5)

    # The per-class recalls weighted by their support are the run's accuracy.
    recall, support = (np.array(details["per_class"][k]) for k in ("recall", "support"))
    seen = support > 0
    assert np.dot(recall[seen], support[seen]) / support.sum() == pytest.approx(
        metrics["test_accuracy"]
    )
    assert support.sum() == details["test_rows"]

    # The data as the shard manifest has it, the gate's verdict, the lineage.
    manifest = json.loads((project / "data" / "shards" / "manifest.json").read_text())
    for split, facts in manifest["splits"].items():
        assert f"{split} {facts['rows']:,}" in card
    # The first ingest had no champion to compare with: its drift section says so.
    ingest = json.loads((project / "data" / "ingest.json").read_text())
    assert ingest["drift"]["status"] == "no_champion", ingest["drift"]
    assert ingest["drift"]["message"] in card
    assert version.description.split(". Trained in")[0] in card
    for fact in (run.data.tags["gradline.job_key"], run.data.tags["gradline.data_version"]):
        assert f"`{fact}`" in card
    assert run.data.tags["gradline.prefect_flow_run_id"] in card
    assert run.data.tags["mlflow.source.git.commit"] in card
    hardware = run.data.tags["gradline.hardware"]
    assert "CPU cores" in hardware and f"| hardware | {hardware} |" in card
    assert "Worst recall: class " in card

    lineage = _gradline(project, "lineage", f"gradline-digits/{version.version}")
    assert lineage.returncode == 0, lineage.stderr[-2000:]
    assert card.strip() in lineage.stdout
