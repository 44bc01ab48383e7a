"""Objectives: metric formulas against scikit-learn, additive statistics, one scoring
routine, baselines on tiny data, the gate's direction, and the evaluate stage's files."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import assert_drawn
from training.data.spec import DataSpec
from training.errors import ConfigError, DataError
from training.objectives import TASKS, Generation, objective_for
from training.objectives.base import Predictions, Scored
from training.objectives.language_modeling import sample_text
from training.plots import plot_loss_curves

BYTES_VOCAB = 257  # 256 byte values and the end-of-document token
EOT = 256


class ArrayReader:
    """An in-memory stand-in for a shard reader."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    @property
    def num_rows(self) -> int:
        return len(self.x)

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.x[indices], self.y[indices]


def windows(tokens: np.ndarray, context: int) -> ArrayReader:
    """Token windows as the token reader serves them: y is x shifted by one."""
    count = (len(tokens) - 1) // context
    starts = np.arange(count)[:, None] * context + np.arange(context)
    return ArrayReader(tokens[starts].astype(np.int64), tokens[starts + 1].astype(np.int64))


def classification(num_classes: int = 5):
    return objective_for("classification", DataSpec("table", (4,), num_classes=num_classes))


def regression(label_mean: float = 0.0, label_std: float = 1.0):
    spec = DataSpec("table", (3,), label_mean=label_mean, label_std=label_std)
    return objective_for("regression", spec)


class TokenBytes:
    """A stand-in tokenizer that only says how many bytes each token id stands for."""

    def __init__(self, token_bytes: np.ndarray) -> None:
        self.values = token_bytes

    def token_bytes(self) -> np.ndarray:
        return self.values


def language_model(token_bytes: np.ndarray | None = None):
    tokenizer = None if token_bytes is None else TokenBytes(token_bytes)
    return objective_for("language_modeling", DataSpec("tokens", vocab_size=BYTES_VOCAB), tokenizer)


# --- metric formulas -------------------------------------------------------------------


# scikit-learn's metrics, the reference, are imported by the tests that use them: at the
# top of the file every test process would import them (~1 s) as it collects the suite.


def test_classification_metrics_match_scikit_learn() -> None:
    from sklearn.metrics import accuracy_score, f1_score, log_loss

    rng = np.random.default_rng(1)
    # Seven classes, labels drawn from five: class 5 occurs only among predictions and
    # class 6 nowhere, which is where a hand-written macro-F1 departs from scikit-learn.
    logits = torch.from_numpy(rng.normal(size=(400, 7)) * 2).float()
    logits[:, 6] = -100.0
    labels = torch.from_numpy(rng.integers(0, 5, size=400))
    objective = classification(7)
    metrics = objective.metrics(objective.batch_stats(logits, labels), "test")

    predicted = logits.argmax(1).numpy()
    probabilities = torch.softmax(logits.double(), 1).numpy()
    assert metrics["test_accuracy"] == pytest.approx(accuracy_score(labels, predicted))
    assert metrics["test_macro_f1"] == pytest.approx(f1_score(labels, predicted, average="macro"))
    assert 5 in predicted and 6 not in predicted
    expected_loss = log_loss(labels, probabilities, labels=list(range(7)))
    assert metrics["test_loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert objective.loss(logits, labels).item() == pytest.approx(expected_loss, rel=1e-5)


def test_regression_metrics_match_scikit_learn() -> None:
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    rng = np.random.default_rng(2)
    actual = rng.normal(150.0, 40.0, size=300)
    predicted = actual + rng.normal(0.0, 25.0, size=300)
    objective = regression(label_mean=150.0, label_std=40.0)
    stats = objective.batch_stats(torch.from_numpy(predicted)[:, None], torch.from_numpy(actual))
    metrics = objective.metrics(stats, "val")

    mse = mean_squared_error(actual, predicted)
    assert metrics["val_rmse"] == pytest.approx(math.sqrt(mse))
    assert metrics["val_mae"] == pytest.approx(mean_absolute_error(actual, predicted))
    assert metrics["val_r2"] == pytest.approx(r2_score(actual, predicted))
    assert metrics["val_loss"] == pytest.approx(mse / 40.0**2)


def test_regression_r2_stays_exact_for_labels_far_from_zero() -> None:
    # sum(y^2) - sum(y)^2 / n cancels catastrophically at a mean of 1e7 unless the sums
    # are taken around the train mean.
    from sklearn.metrics import r2_score

    rng = np.random.default_rng(12)
    actual = rng.normal(1e7, 1.0, size=300)
    predicted = actual + rng.normal(0.0, 0.5, size=300)
    objective = regression(label_mean=1e7, label_std=1.0)
    stats = objective.batch_stats(torch.from_numpy(predicted), torch.from_numpy(actual))
    assert objective.metrics(stats, "test")["test_r2"] == pytest.approx(
        r2_score(actual, predicted), rel=1e-9
    )


def test_regression_loss_is_near_one_for_the_mean_whatever_the_units() -> None:
    rng = np.random.default_rng(3)
    for scale in (1e-3, 1.0, 1e4):
        labels = torch.from_numpy(rng.normal(5 * scale, scale, size=2000)).float()
        objective = regression(label_mean=5 * scale, label_std=scale)
        mean_prediction = torch.full((2000, 1), 5 * scale)
        assert objective.loss(mean_prediction, labels).item() == pytest.approx(1.0, abs=0.1)


def test_regression_rejects_a_model_with_several_outputs_per_row() -> None:
    with pytest.raises(ConfigError, match="one value per row"):
        regression().loss(torch.zeros(8, 2), torch.zeros(8))


def test_language_model_metrics_count_nats_tokens_and_bytes() -> None:
    rng = np.random.default_rng(4)
    logits = torch.from_numpy(rng.normal(size=(3, 7, BYTES_VOCAB))).float()
    targets = torch.from_numpy(rng.integers(0, BYTES_VOCAB, size=(3, 7)))
    token_bytes = rng.integers(1, 5, size=BYTES_VOCAB)
    objective = language_model(token_bytes)
    metrics = objective.metrics(objective.batch_stats(logits, targets), "test")

    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, BYTES_VOCAB), targets.reshape(-1))
    loss = nll.item()
    assert metrics["test_loss"] == pytest.approx(loss, rel=1e-6)
    assert objective.loss(logits, targets).item() == pytest.approx(loss, rel=1e-6)
    assert metrics["test_perplexity"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert metrics["test_bits_per_token"] == pytest.approx(loss / math.log(2), rel=1e-6)
    byte_count = token_bytes[targets.numpy()].sum()
    expected_bpb = loss * targets.numel() / byte_count / math.log(2)
    assert metrics["test_bits_per_byte"] == pytest.approx(expected_bpb, rel=1e-6)
    # The bytes tokenizer: every token is one byte.
    plain = language_model(None)
    plain_metrics = plain.metrics(plain.batch_stats(logits, targets), "test")
    assert plain_metrics["test_bits_per_byte"] == pytest.approx(metrics["test_bits_per_token"])


@pytest.mark.parametrize("task", ["classification", "regression", "language_modeling"])
def test_statistics_are_additive(task: str) -> None:
    rng = np.random.default_rng(5)
    if task == "classification":
        objective = classification(4)
        output = torch.from_numpy(rng.normal(size=(101, 4))).float()
        target = torch.from_numpy(rng.integers(0, 4, size=101))
    elif task == "regression":
        objective = regression(label_mean=10.0, label_std=3.0)
        output = torch.from_numpy(rng.normal(10, 3, size=(101, 1))).float()
        target = torch.from_numpy(rng.normal(10, 3, size=101)).float()
    else:
        objective = language_model(rng.integers(0, 4, size=BYTES_VOCAB))
        output = torch.from_numpy(rng.normal(size=(101, 5, BYTES_VOCAB))).float()
        target = torch.from_numpy(rng.integers(0, BYTES_VOCAB, size=(101, 5)))

    whole = objective.batch_stats(output, target)
    halves = objective.batch_stats(output[:40], target[:40]) + objective.batch_stats(
        output[40:], target[40:]
    )
    assert whole.dtype == torch.float64 and whole.dim() == 1
    assert len(whole) == objective.num_stats
    expected = objective.metrics(whole, "val")
    assert objective.metrics(halves, "val") == pytest.approx(expected)
    assert set(expected) == {f"val_{name}" for name in objective.metric_names}


# --- the one scoring routine -------------------------------------------------------------


def test_score_is_the_same_for_any_batch_size_and_restores_train_mode() -> None:
    rng = np.random.default_rng(6)
    x = rng.normal(size=(97, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=97)
    reader, rows = ArrayReader(x, y), np.arange(97)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5))
    model.train()
    objective = classification(3)
    reduced = []

    def reduce(stats: torch.Tensor) -> torch.Tensor:
        reduced.append(stats.clone())
        return stats

    scored = objective.score(model, reader, rows, 10, "cpu", reduce, keep_predictions=True)
    assert model.training, "score must give the model back in train mode"
    assert len(reduced) == 1, "statistics are reduced once, after the last batch"
    for batch_size in (1, 33, 1000):
        again = objective.score(model, reader, rows, batch_size, "cpu").metrics
        assert again == pytest.approx(scored.metrics)

    # Predictions in row order, and the metrics agree with them (no dropout at eval).
    with torch.no_grad():
        model.eval()
        expected = model(torch.from_numpy(x)).argmax(1).numpy()
    np.testing.assert_array_equal(scored.predictions.y_true, y)
    np.testing.assert_array_equal(scored.predictions.y_pred, expected)
    assert scored.metrics["test_accuracy"] == pytest.approx((expected == y).mean())


def test_score_of_no_rows_gives_nan_rather_than_an_error() -> None:
    reader = ArrayReader(np.zeros((0, 3), np.float32), np.zeros(0, np.float32))
    metrics = regression().score(torch.nn.Linear(3, 1), reader, np.arange(0), 8, "cpu").metrics
    assert math.isnan(metrics["test_rmse"])


def test_score_uses_the_prefix_it_is_given() -> None:
    reader = ArrayReader(np.ones((4, 3), np.float32), np.ones(4, np.float32))
    metrics = (
        regression()
        .score(torch.nn.Linear(3, 1), reader, np.arange(4), 2, "cpu", prefix="val")
        .metrics
    )
    assert set(metrics) == {"val_rmse", "val_mae", "val_r2", "val_loss"}


# --- baselines ---------------------------------------------------------------------------


def test_logistic_regression_baseline_separates_a_separable_table() -> None:
    rng = np.random.default_rng(7)

    def table(n: int) -> ArrayReader:
        x = rng.normal(size=(n, 3)).astype(np.float32) * [1.0, 100.0, 0.01]
        y = (x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 2] > 0)  # four classes
        x[:, 0] += np.sign(x[:, 0]) * 0.5  # a margin around each boundary
        x[:, 2] += np.sign(x[:, 2]) * 0.005
        return ArrayReader(x.astype(np.float32), y)

    objective = classification(4)
    result = objective.baseline(table(400), table(200), max_rows=300)
    assert set(result) == {f"baseline_test_{name}" for name in objective.metric_names}
    assert result["baseline_test_accuracy"] == 1.0
    assert result["baseline_test_macro_f1"] == 1.0


def test_baseline_falls_back_to_the_majority_class_when_the_sample_has_one_class() -> None:
    train = ArrayReader(np.zeros((50, 2), np.float32), np.full(50, 2))
    test = ArrayReader(np.zeros((10, 2), np.float32), np.array([2] * 7 + [0] * 3))
    result = classification(3).baseline(train, test, max_rows=1000)
    assert result["baseline_test_accuracy"] == pytest.approx(0.7)
    assert math.isfinite(result["baseline_test_loss"])


def test_linear_regression_baseline_fits_a_linear_target() -> None:
    rng = np.random.default_rng(8)

    def table(n: int) -> ArrayReader:
        x = rng.normal(size=(n, 3)).astype(np.float32)
        y = (x @ np.array([3.0, -2.0, 0.5]) + 100.0).astype(np.float32)
        return ArrayReader(x, y)

    objective = regression(label_mean=100.0, label_std=3.6)
    result = objective.baseline(table(500), table(100), max_rows=200)
    assert set(result) == {f"baseline_test_{name}" for name in objective.metric_names}
    assert result["baseline_test_r2"] == pytest.approx(1.0, abs=1e-4)
    assert result["baseline_test_rmse"] < 1e-3


def test_unigram_baseline_loss_is_the_entropy_of_a_skewed_stream() -> None:
    rng = np.random.default_rng(9)
    symbols, p = np.array([ord(c) for c in "etao"]), np.array([0.7, 0.2, 0.08, 0.02])
    entropy = float(-(p * np.log(p)).sum())
    train = windows(rng.choice(symbols, size=200_001, p=p), context=50)
    test = windows(rng.choice(symbols, size=100_001, p=p), context=50)
    objective = language_model()
    result = objective.baseline(train, test, max_rows=10_000)
    assert set(result) == {f"baseline_test_{name}" for name in objective.metric_names}
    assert result["baseline_test_loss"] == pytest.approx(entropy, abs=0.01)
    assert result["baseline_test_bits_per_byte"] == pytest.approx(entropy / math.log(2), abs=0.02)


def test_baseline_rows_are_sampled_the_same_way_every_time() -> None:
    rng = np.random.default_rng(10)
    x = rng.normal(size=(3000, 2)).astype(np.float32)
    y = (x[:, 0] + rng.normal(scale=1.0, size=3000) > 0).astype(np.int64)
    train, test = ArrayReader(x, y), ArrayReader(x[:500], y[:500])
    first = classification(2).baseline(train, test, max_rows=100)
    assert classification(2).baseline(train, test, max_rows=100) == first


# --- the gate's direction and construction -------------------------------------------------


def test_gate_metric_and_direction_per_task() -> None:
    cls, reg, lm = classification(), regression(), language_model()
    assert (cls.gate_metric, cls.higher_is_better) == ("test_accuracy", True)
    assert (reg.gate_metric, reg.higher_is_better) == ("test_rmse", False)
    assert (lm.gate_metric, lm.higher_is_better) == ("test_loss", False)
    assert cls.beats(0.9, 0.8) and not cls.beats(0.8, 0.9) and not cls.beats(0.8, 0.8)
    assert reg.beats(1.0, 2.0) and not reg.beats(2.0, 1.0) and not reg.beats(1.0, 1.0)
    assert not lm.beats(math.nan, 3.0)
    assert (cls.curve_metric, reg.curve_metric, lm.curve_metric) == (
        "val_accuracy",
        "val_rmse",
        "val_loss",
    )


def test_objective_for_names_the_fix_when_task_and_data_disagree() -> None:
    with pytest.raises(DataError, match=r"task\.type: regression"):
        objective_for("classification", DataSpec("table", (3,), label_mean=0.0, label_std=1.0))
    with pytest.raises(DataError, match="text source"):
        objective_for("language_modeling", DataSpec("table", (3,), num_classes=2))
    with pytest.raises(DataError, match="re-run shard"):
        objective_for(
            "language_modeling", DataSpec("tokens", vocab_size=10), TokenBytes(np.ones(9))
        )
    with pytest.raises(ConfigError, match="not one of"):
        objective_for("ranking", DataSpec("table", (3,), num_classes=2))


def _deciding_parts(node: ast.AST) -> list:
    """The parts of a node that decide by value: both sides of a comparison (`==`,
    `in`), or a table's keys."""
    if isinstance(node, ast.Compare):
        return [node.left, *node.comparators]
    if isinstance(node, ast.Dict):
        return [key for key in node.keys if key is not None]
    return []


def _task_names_decided_outside_objectives() -> list[str]:
    """Each place outside training/objectives that compares against a task name or keys
    a table by one: where adding a task would have to edit another file."""
    root = Path(__file__).resolve().parents[1]
    files = [p for folder in ("training", "flows", "tasks") for p in (root / folder).rglob("*.py")]
    found = []
    for path in sorted(files):
        if "objectives" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for part in _deciding_parts(node):
                if any(
                    isinstance(leaf, ast.Constant) and leaf.value in TASKS
                    for leaf in ast.walk(part)
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_layer_outside_the_task_modules_decides_by_task_name() -> None:
    # Tasks are plug-ins: a new task is its module and its card; nothing else may branch
    # on a task's name (the issue counted ~24 such places before).
    assert _task_names_decided_outside_objectives() == []


# --- the evaluate stage's files ------------------------------------------------------------


def _artifacts(objective, predictions: Predictions, folder) -> list:
    folder.mkdir()
    generation = Generation((), 1, 1.0, None, 0)
    return objective.artifacts(None, Scored({}, predictions), folder, generation, None)


def test_prediction_artifacts_per_task(tmp_path) -> None:
    labels = np.array([0, 1, 2, 1])
    predictions = Predictions(labels, np.array([0, 1, 1, 1]))
    made = _artifacts(classification(3), predictions, tmp_path / "cls")
    assert [p.name for p in made] == ["confusion_matrix.png"]
    assert_drawn(made[0])
    rows = json.loads((tmp_path / "cls" / "predictions.json").read_text())
    assert rows[2] == {"actual": 2, "predicted": 1}

    values = Predictions(np.array([1.5, 2.0], np.float32), np.array([1.25, 2.5], np.float32))
    made = _artifacts(regression(), values, tmp_path / "reg")
    assert [p.name for p in made] == ["predicted_vs_actual.png"]
    assert_drawn(made[0])
    rows = json.loads((tmp_path / "reg" / "predictions.json").read_text())
    assert rows == [{"actual": 1.5, "predicted": 1.25}, {"actual": 2.0, "predicted": 2.5}]


@pytest.mark.parametrize("metric", ["val_accuracy", "val_rmse", "val_loss", None])
def test_loss_curves_plot_any_validation_metric(tmp_path, metric) -> None:
    history = {"train_loss": [(1, 2.0), (2, 1.0)], "val_loss": [(2, 1.1)]}
    if metric:
        history[metric] = [(2, 0.5)]
    plot_loss_curves(history, tmp_path / "curves.png", metric)
    assert_drawn(tmp_path / "curves.png")


class ByteTokenizer:
    """A stand-in for the bytes tokenizer: ids 0..255 are bytes, 256 ends a document."""

    eot = EOT
    vocab_size = BYTES_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(ids).decode(errors="replace")


class FavouriteToken(torch.nn.Module):
    """Returns (B, T, V) logits that all but force one next token."""

    def __init__(self, token: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.full((BYTES_VOCAB,), -50.0))
        with torch.no_grad():
            self.bias[token] = 50.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(*ids.shape, BYTES_VOCAB)


def _samples(model, prompts, max_new_tokens, temperature, top_k, context, seed) -> str:
    generation = Generation(tuple(prompts), max_new_tokens, temperature, top_k, seed)
    return sample_text(model, ByteTokenizer(), generation, context)


def test_sample_text_continues_each_prompt_and_stops_at_end_of_document() -> None:
    model = FavouriteToken(ord("a"))
    model.train()
    text = _samples(model, ["def ", "x"], 5, 0.8, 40, 16, seed=1)
    assert "=== sample 1, prompt 'def ' ===\ndef aaaaa\n" in text
    assert "=== sample 2, prompt 'x' ===\nxaaaaa\n" in text
    assert model.training, "sampling must give the model back in train mode"

    ended = _samples(FavouriteToken(EOT), ["import "], 5, 1.0, None, 16, 1)
    assert "===\nimport \n" in ended


def test_sample_text_is_reproducible_for_a_seed() -> None:
    torch.manual_seed(0)
    model = FavouriteToken(0)
    with torch.no_grad():
        model.bias.copy_(torch.randn(BYTES_VOCAB) * 0.1)  # near uniform: samples vary
    model.bias.data[EOT] = -50.0
    first = _samples(model, ["a"], 30, 1.0, None, 8, seed=3)
    assert _samples(model, ["a"], 30, 1.0, None, 8, seed=3) == first
    assert _samples(model, ["a"], 30, 1.0, None, 8, seed=4) != first
