"""Click prediction: labels 1 (clicked) or 0, the model outputs one logit per row.

Loss: binary cross-entropy on the logit. Metrics, all from additive statistics:
- AUC from two score histograms (positives', negatives') of HISTOGRAM_BINS bins over the
  predicted probability: pairs in different bins are ordered exactly, pairs within one
  bin count one half, as ties do. So the error is at most half the share of
  positive-negative pairs that fall into one bin, reported as `auc_error_bound` by
  `auc_from_histograms` (below 1e-3 on 20k rows of a click rate like the example's;
  tests compare with scikit-learn's exact AUC).
- log loss (the mean BCE, equal to `loss`), and normalized entropy: log loss over the
  entropy of the split's base rate (1.0 is no better than predicting the base rate).
- recall@K and NDCG@K (K = RANK_K) of each user's test rows ranked by score, averaged
  over users with at least one click and one non-click. A user's rows must be together
  to rank them, so these are not additive: the evaluate stage computes them (with the
  baselines'), never the training loop; early stopping watches AUC or log loss.
Baselines on the same split: logistic regression on hashed one-hot ids plus the dense
features, and item popularity (each item's smoothed click-through rate on train); the
stronger by AUC is `baseline_test_*` (what the gate compares), both are also reported
as `lr_baseline_test_*` and `popularity_baseline_test_*`. Gate: test_auc, higher.
The registered model returns click probabilities.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training.data.categorical import id_codes
from training.data.hashing import mix64
from training.data.spec import DataSpec
from training.errors import DataError
from training.objectives import TASKS, base
from training.objectives.base import Reader, Scored, ratio
from training.objectives.bootstrap import Bootstrap

HISTOGRAM_BINS = 2048
RANK_K = 10
# Hashed one-hot features of the logistic-regression baseline: each id column's ids fold
# into this many columns (collisions are part of the hashing trick being measured).
LR_HASH_BUCKETS = 1 << 16
# Prior clicks of the popularity baseline: an item seen n times with c clicks scores
# (c + PRIOR * base rate) / (n + PRIOR), so a rarely seen item stays near the base rate.
POPULARITY_PRIOR = 20.0
# Which id columns hold the user and the item, by name (case-insensitive, first match):
# the user's rows are ranked for recall@K / NDCG@K, the item's click rates are the
# popularity baseline (the first id column when none matches).
USER_COLUMNS = ("user_id", "user", "userid", "customer_id", "customer")
ITEM_COLUMNS = ("item_id", "item", "itemid", "product_id", "product", "sku")

Forward = Callable[[torch.Tensor], torch.Tensor]


class Objective(base.Objective):
    name = "click"
    metric_names = TASKS["click"].metric_names
    prediction_dtype = np.float32

    def __init__(self, data: DataSpec) -> None:
        super().__init__(data)
        # Positives' histogram, negatives' histogram, summed BCE, rows, clicks.
        self.num_stats = 2 * HISTOGRAM_BINS + 3

    @classmethod
    def for_data(cls, data: DataSpec, tokenizer: Any = None) -> Objective:
        if data.num_classes not in (None, 2):
            raise DataError(
                f"task.type click learns 0/1 labels (clicked or not), but the shards have "
                f"{data.num_classes} classes; set data.num_classes: 2, or task.type: "
                "classification"
            )
        return cls(data)

    @property
    def output_size(self) -> int:
        return 1

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(output.float()[:, 0], target.float())

    def predict(self, output: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(output.float()[:, 0])

    # --- additive statistics ------------------------------------------------------------

    def _cells(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Each row's histogram cell: its probability's bin, offset by B for negatives."""
        bins = (self.predict(output) * HISTOGRAM_BINS).long().clamp(0, HISTOGRAM_BINS - 1)
        return bins + HISTOGRAM_BINS * (1 - target.long())

    def batch_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        histograms = torch.bincount(self._cells(output, target), minlength=2 * HISTOGRAM_BINS)
        bce = F.binary_cross_entropy_with_logits(
            output.float()[:, 0], target.float(), reduction="sum"
        )
        rows = torch.ones_like(bce).double() * len(target)
        totals = torch.stack([bce.double(), rows, target.double().sum()])
        return torch.cat([histograms.double(), totals])

    def row_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Four non-zeros per row of 2B+3 (a cell, its BCE, a row, its click): sparse.
        rows, b2 = len(target), 2 * HISTOGRAM_BINS
        bce = F.binary_cross_entropy_with_logits(
            output.float()[:, 0], target.float(), reduction="none"
        ).double()
        index = torch.arange(rows, device=target.device).repeat(4)
        columns = torch.cat(
            [self._cells(output, target)]
            + [torch.full((rows,), b2 + i, device=target.device) for i in range(3)]
        )
        ones = torch.ones(rows, dtype=torch.float64, device=target.device)
        values = torch.cat([ones, bce, ones, target.double()])
        return torch.sparse_coo_tensor(
            torch.stack([index, columns]), values, (rows, self.num_stats), check_invariants=False
        )

    def metrics(self, stats: torch.Tensor, prefix: str) -> dict[str, float]:
        b = HISTOGRAM_BINS
        values = stats.double().cpu().numpy()
        auc, _ = auc_from_histograms(values[:b], values[b : 2 * b])
        bce, rows, clicks = values[2 * b :]
        log_loss = ratio(float(bce), float(rows))
        return {
            f"{prefix}_auc": auc,
            f"{prefix}_log_loss": log_loss,
            f"{prefix}_normalized_entropy": ratio(
                log_loss, base_rate_entropy(float(clicks), float(rows))
            ),
            f"{prefix}_loss": log_loss,
        }

    # --- ranking metrics (evaluate stage only) ------------------------------------------

    def score(
        self,
        model: nn.Module | base.Forward,
        reader: Reader,
        rows: np.ndarray,
        batch_size: int,
        device: torch.device | str,
        reduce: base.Reduce = base._identity,
        prefix: str = "test",
        keep_predictions: bool = False,
        bootstrap: Bootstrap | None = None,
    ) -> Scored:
        """As every task scores; the evaluate stage (keep_predictions) adds recall@K and
        NDCG@K per user when the data has a user column."""
        scored = super().score(
            model, reader, rows, batch_size, device, reduce, prefix, keep_predictions, bootstrap
        )
        if not keep_predictions or scored.predictions is None or self.user_column is None:
            return scored
        users = self._users(reader, rows, batch_size)
        predictions = scored.predictions
        ranking = ranking_metrics(users, predictions.y_true, predictions.y_pred, RANK_K, prefix)
        return Scored({**scored.metrics, **ranking}, predictions)

    @property
    def user_column(self) -> int | None:
        """The user id's feature (USER_COLUMNS), or None: no ranking metrics."""
        return _named(self.data.categorical_columns, USER_COLUMNS)

    @property
    def item_column(self) -> int:
        """The item id's feature (ITEM_COLUMNS, else the first id column)."""
        found = _named(self.data.categorical_columns, ITEM_COLUMNS)
        return 0 if found is None else found

    def _users(self, reader: Reader, rows: np.ndarray, batch_size: int) -> np.ndarray:
        parts = [np.zeros(0, dtype=np.int64)]
        for start in range(0, len(rows), batch_size):
            x, _ = reader.gather(rows[start : start + batch_size])
            parts.append(x.reshape(len(x), -1)[:, self.user_column].astype(np.int64))
        return np.concatenate(parts)

    # --- baselines ----------------------------------------------------------------------

    def baseline(
        self,
        train_reader: Reader,
        test_reader: Reader,
        max_rows: int,
        bootstrap: Bootstrap | None = None,
    ) -> dict:
        x, y = base.flat_features(train_reader, base.sample_rows(train_reader.num_rows, max_rows))
        candidates = {"lr": self._hashed_lr(x, y), "popularity": self._popularity(x, y)}
        results: dict[str, float] = {}
        auc: dict[str, float] = {}
        for name, forward in candidates.items():
            if forward is None:
                continue
            scored = self._baseline_scores(forward, test_reader)
            results.update({f"{name}_{key}": value for key, value in scored.items()})
            auc[name] = scored["baseline_test_auc"]
        best = max(auc, key=lambda n: -math.inf if math.isnan(auc[n]) else auc[n])
        # The stronger again, for the gate's keys and their bootstrap intervals.
        results.update(self._baseline_scores(candidates[best], test_reader, bootstrap))
        return results

    def _baseline_scores(
        self, forward: Forward, test_reader: Reader, bootstrap: Bootstrap | None = None
    ) -> dict[str, float]:
        scores = self.score_baseline(forward, test_reader, bootstrap=bootstrap)
        if self.user_column is not None:
            rows = np.arange(test_reader.num_rows)
            y_true, y_pred, users = [], [], []
            for start in range(0, len(rows), base.BASELINE_BATCH_ROWS):
                x, y = test_reader.gather(rows[start : start + base.BASELINE_BATCH_ROWS])
                x = x.reshape(len(x), -1)
                y_true.append(y)
                y_pred.append(self.predict(forward(torch.from_numpy(x))).numpy())
                users.append(x[:, self.user_column].astype(np.int64))
            ranking = ranking_metrics(
                np.concatenate(users), np.concatenate(y_true), np.concatenate(y_pred),
                RANK_K, "baseline_test",
            )  # fmt: skip
            scores.update(ranking)
        return scores

    def _hashed_lr(self, x: np.ndarray, y: np.ndarray) -> Forward | None:
        """Logistic regression on one-hot ids (hashed into LR_HASH_BUCKETS per column)
        and the standardized dense features; None when it cannot be fitted."""
        # Deferred: scikit-learn takes ~2 s to import (see classification.py).
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression

        k = self.data.num_categorical
        mean = x[:, k:].mean(axis=0) if len(x) else 0.0
        std = np.where(x[:, k:].std(axis=0) > 1e-6, x[:, k:].std(axis=0), 1.0) if len(x) else 1.0

        def design(rows: np.ndarray):
            from scipy import sparse

            n = len(rows)
            ids = rows[:, :k].astype(np.int64)
            buckets = (mix64(ids.astype(np.uint64)) % np.uint64(LR_HASH_BUCKETS)).astype(np.int64)
            columns = buckets + np.arange(k) * LR_HASH_BUCKETS
            onehot = sparse.csr_matrix(
                (np.ones(n * k), columns.reshape(-1), np.arange(0, n * k + 1, k)),
                shape=(n, k * LR_HASH_BUCKETS),
            )
            dense = sparse.csr_matrix((rows[:, k:] - mean) / std)
            return sparse.hstack([onehot, dense], format="csr")

        # liblinear: ~1-3 s on 50k rows of 196k hashed columns, where lbfgs takes ~30 s for
        # the same AUC (measured on the clicks example).
        model = LogisticRegression(solver="liblinear", max_iter=300, C=1.0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                model.fit(design(x), y)
        except ValueError:  # one class only in the sample
            return None
        if len(model.classes_) != 2:
            return None

        def forward(features: torch.Tensor) -> torch.Tensor:
            rows = features.numpy().reshape(len(features), -1)
            logits = model.decision_function(design(rows))
            return torch.from_numpy(np.asarray(logits, dtype=np.float32)).reshape(-1, 1)

        return forward

    def _popularity(self, x: np.ndarray, y: np.ndarray) -> Forward:
        """Each item's smoothed click-through rate on the train sample (base rate for
        items it never saw)."""
        column = self.item_column
        items = x[:, column].astype(np.int64)
        rate = float(y.mean()) if len(y) else 0.5
        seen, index = np.unique(items, return_inverse=True)
        shows = np.bincount(index, minlength=len(seen)).astype(np.float64)
        clicks = np.bincount(index, weights=y.astype(np.float64), minlength=len(seen))
        ctr = (clicks + POPULARITY_PRIOR * rate) / (shows + POPULARITY_PRIOR)
        # Unseen items get the base rate: one more entry past the seen ones.
        logits = _logit(np.append(ctr, rate))

        def forward(features: torch.Tensor) -> torch.Tensor:
            asked = features.numpy().reshape(len(features), -1)[:, column].astype(np.int64)
            at = np.minimum(np.searchsorted(seen, asked), len(seen))
            known = at < len(seen)
            known[known] = seen[at[known]] == asked[known]
            chosen = logits[np.where(known, at, len(seen))]
            return torch.from_numpy(chosen.astype(np.float32)).reshape(-1, 1)

        return forward

    # --- the registered model -----------------------------------------------------------

    def features(self, model_input: Any) -> np.ndarray:
        """Rows as float32: raw ids of a user's table hashed as ingest hashed them
        (training.data.categorical), then the dense values; other inputs as every task
        takes them."""
        import pandas as pd  # deferred: pandas is needed only where a model serves

        names = self.data.column_names
        ids = self.data.categorical_columns
        hashed = self.data.categorical_hashed and isinstance(model_input, pd.DataFrame)
        if not hashed or not set(names) <= set(model_input.columns):
            return super().features(model_input)
        import pyarrow as pa

        columns = [
            id_codes(pa.array(model_input[name], from_pandas=True))
            if name in ids
            else model_input[name].to_numpy(dtype=np.float32, na_value=np.nan)
            for name in names
        ]
        return np.column_stack(columns).astype(np.float32).reshape(len(model_input), -1)

    def signature(self, generation):
        """A table's named columns in, one click probability per row out; the id
        columns of a user's table are strings (raw ids, hashed by the model)."""
        signature, example = super().signature(generation)
        if not self.data.categorical_hashed:
            return signature, example
        from mlflow.models import ModelSignature
        from mlflow.types import ColSpec, Schema

        ids = set(self.data.categorical_columns)
        names = self.data.column_names
        inputs = Schema([ColSpec("string" if n in ids else "double", n) for n in names])
        example = example.astype({n: "int64" for n in ids}).astype({n: str for n in ids})
        return ModelSignature(inputs=inputs, outputs=signature.outputs), example

    def prediction_columns(self, output: torch.Tensor) -> dict[str, np.ndarray]:
        """`prediction`: the click probability, and `clicked`: whether it is above 1/2."""
        probability = self.predicted(output)
        return {"prediction": probability, "clicked": (probability > 0.5).astype(np.int64)}


def _named(columns: tuple[str, ...], wanted: tuple[str, ...]) -> int | None:
    lowered = [c.lower() for c in columns]
    return next((lowered.index(name) for name in wanted if name in lowered), None)


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return np.log(p / (1 - p))


def base_rate_entropy(clicks: float, rows: float) -> float:
    """Entropy (nats) of a coin with the split's click rate: the log loss of always
    predicting that rate. NaN for an empty split, 0 when every row is alike."""
    if not rows:
        return math.nan
    p = clicks / rows
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def auc_from_histograms(positives: np.ndarray, negatives: np.ndarray) -> tuple[float, float]:
    """(AUC, bound on its error) from score histograms over the same ascending bins.

    A positive beats every negative in a lower bin and ties (counts one half) with the
    negatives in its own; the true order inside a bin is unknown, so the error is at most
    half the share of positive-negative pairs that share a bin."""
    pos, neg = np.asarray(positives, np.float64), np.asarray(negatives, np.float64)
    pairs = pos.sum() * neg.sum()
    if not pairs:
        return math.nan, math.nan
    below = np.cumsum(neg) - neg
    auc = float((pos * (below + 0.5 * neg)).sum() / pairs)
    return auc, float(0.5 * (pos * neg).sum() / pairs)


def ranking_metrics(
    users: np.ndarray, clicked: np.ndarray, scores: np.ndarray, k: int, prefix: str
) -> dict[str, float]:
    """`{prefix}_recall_at_{k}` and `{prefix}_ndcg_at_{k}`: each user's rows ranked by
    score (ties in row order), averaged over users with a click and a non-click.

    Recall@k: the user's clicks among the top k, over min(clicks, k) (1 for a perfect
    ranking). NDCG@k: discounted gain of the clicks in the top k over the best possible."""
    users = np.asarray(users, dtype=np.int64)
    clicked = np.asarray(clicked).astype(bool)
    if not len(users):
        return {f"{prefix}_recall_at_{k}": math.nan, f"{prefix}_ndcg_at_{k}": math.nan}
    order = np.lexsort((np.arange(len(users)), -np.asarray(scores, np.float64), users))
    users, clicked = users[order], clicked[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    group = np.cumsum(np.r_[True, users[1:] != users[:-1]]) - 1
    rank = np.arange(len(users)) - starts[group]
    sizes = np.diff(np.r_[starts, len(users)])
    positives = np.bincount(group, weights=clicked, minlength=len(starts))
    top = (rank < k) & clicked
    hits = np.bincount(group[top], minlength=len(starts))
    discount = 1.0 / np.log2(np.arange(k) + 2.0)
    dcg = np.bincount(group[top], weights=discount[rank[top]], minlength=len(starts))
    ideal = np.cumsum(discount)[np.minimum(positives, k).astype(np.int64) - 1]
    ranked = (positives > 0) & (positives < sizes)
    if not ranked.any():
        return {f"{prefix}_recall_at_{k}": math.nan, f"{prefix}_ndcg_at_{k}": math.nan}
    recall = hits[ranked] / np.minimum(positives[ranked], k)
    ndcg = dcg[ranked] / ideal[ranked]
    return {
        f"{prefix}_recall_at_{k}": float(recall.mean()),
        f"{prefix}_ndcg_at_{k}": float(ndcg.mean()),
    }
