"""Forecasting: from a window of `context` past values, the next `horizon` values.

Rows are windows cut from time series by training.data.series: features are the scaled
context (then covariates), the label is the scaled targets followed by the window's
series mean, std and MASE scale. The model predicts scaled values; the loss is their
MSE. Metrics are in the target's units, from additive sums over every forecast value:
MAE, RMSE, sMAPE (percent, 0..200) and MASE (each absolute error over its series'
in-sample seasonal-naive MAE on the train span, then averaged: below 1 beats that
naive forecast's in-sample error). Baselines on the same test windows: seasonal naive
(the value one season earlier, `task.season`) as `baseline_test_*`, which the gate
compares with, and the last value as `baseline_last_value_test_*`. The registered model
takes a history frame and returns the next `horizon` values of each series.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from training import plots
from training.data.spec import DataSpec
from training.errors import ConfigError, DataError
from training.objectives import TASKS, Generation, base
from training.objectives.base import Predictions, Reader, Scored
from training.objectives.bootstrap import Bootstrap

# What the last-value baseline's metrics are called (the seasonal-naive one is the
# plain `baseline_`: the gate's comparison).
LAST_VALUE_PREFIX = "baseline_last_value_"
_SERIES = "series"


class Objective(base.Objective):
    name = "forecasting"
    metric_names = TASKS["forecasting"].metric_names
    # |e|, e^2, sMAPE term, |e| / MASE scale, values, e^2 in scaled units
    num_stats = 6
    prediction_dtype = np.float32

    def __init__(self, data: DataSpec) -> None:
        super().__init__(data)
        forecast = data.forecast or {}
        self.context = int(forecast["context"])
        self.horizon = int(forecast["horizon"])
        self.season = int(forecast["season"])
        self.forecast = forecast

    @classmethod
    def for_data(cls, data: DataSpec, tokenizer: Any = None) -> Objective:
        if data.kind != "series" or not data.forecast:
            raise DataError(
                f"task.type is forecasting but the shards hold {data.kind} data, not "
                "forecasting windows; re-run ingest and shard with task.type forecasting"
            )
        return cls(data)

    @property
    def output_size(self) -> int:
        return self.horizon

    # --- training and scoring -----------------------------------------------------------

    def _split(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if output.shape[-1] != self.horizon or output.numel() != len(target) * self.horizon:
            raise ConfigError(
                f"a forecasting model must output task.horizon ({self.horizon}) values per "
                f"window: got output of shape {tuple(output.shape)} for {len(target)} windows"
            )
        h = self.horizon
        return output.reshape(len(target), h), target[:, :h], target[:, h : h + 3]

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        prediction, label, _ = self._split(output, target)
        return F.mse_loss(prediction.float(), label.float())

    def predict(self, output: torch.Tensor) -> torch.Tensor:
        return output.reshape(len(output), self.horizon)

    def row_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        prediction, label, extras = (t.double() for t in self._split(output, target))
        mean, std, scale = extras[:, :1], extras[:, 1:2], extras[:, 2:3]
        predicted, actual = prediction * std + mean, label * std + mean
        error = (predicted - actual).abs()
        denominator = predicted.abs() + actual.abs()
        smape = torch.where(denominator > 0, 2 * error / denominator, torch.zeros_like(error))
        count = torch.full_like(error[:, 0], float(self.horizon))
        return torch.stack(
            [
                error.sum(1),
                error.square().sum(1),
                smape.sum(1),
                (error / scale).sum(1),
                count,
                (prediction - label).square().sum(1),
            ],
            1,
        )

    def batch_stats(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.row_stats(output, target).sum(0)

    def metrics(self, stats: torch.Tensor, prefix: str) -> dict[str, float]:
        absolute, squared, smape, scaled, count, squared_scaled = stats.tolist()
        return {
            f"{prefix}_mase": base.ratio(scaled, count),
            f"{prefix}_mae": base.ratio(absolute, count),
            f"{prefix}_rmse": math.sqrt(base.ratio(squared, count)) if count else math.nan,
            f"{prefix}_smape": 100.0 * base.ratio(smape, count),
            f"{prefix}_loss": base.ratio(squared_scaled, count),
        }

    # --- baselines ----------------------------------------------------------------------

    def seasonal_naive(self, features: torch.Tensor) -> torch.Tensor:
        """Each future value is the context's value one season (or a whole number of
        seasons) before it: step h repeats context[-season + (h - 1) % season]."""
        past = features.reshape(len(features), -1)[:, : self.context]
        steps = torch.arange(self.horizon)
        return past[:, self.context - self.season + steps % self.season]

    def last_value(self, features: torch.Tensor) -> torch.Tensor:
        past = features.reshape(len(features), -1)[:, : self.context]
        return past[:, -1:].expand(len(features), self.horizon)

    def baseline(
        self,
        train_reader: Reader,
        test_reader: Reader,
        max_rows: int,
        bootstrap: Bootstrap | None = None,
    ) -> dict:
        """Seasonal naive (`baseline_test_*`, with the intervals) and last value
        (`baseline_last_value_test_*`), on the very test windows the model is scored on.
        Nothing is fitted: both read the window's context."""
        seasonal = self.score_baseline(self.seasonal_naive, test_reader, bootstrap=bootstrap)
        last = self.score_baseline(self.last_value, test_reader)
        renamed = {LAST_VALUE_PREFIX + k.removeprefix("baseline_"): v for k, v in last.items()}
        return {**seasonal, **renamed}

    # --- what a run shows ---------------------------------------------------------------

    plot_file = "forecast_vs_actual.png"

    def artifacts(
        self,
        model: torch.nn.Module,
        scored: Scored,
        plots_dir: Path,
        generation: Generation,
        context: int | None,
    ) -> list[Path]:
        if scored.predictions is None:
            return []
        image = plots_dir / self.plot_file
        self.plot(scored.predictions, image)
        return [image]

    def plot(self, predictions: Predictions, out: Path) -> None:
        """The test span of the first series: the actual values, the one-step-ahead
        forecasts of every window, and the whole horizon of windows a horizon apart."""
        labels, predicted = predictions.y_true, predictions.y_pred
        h = self.horizon
        mean, std = labels[:, h : h + 1], labels[:, h + 1 : h + 2]
        actual, forecast = labels[:, :h] * std + mean, predicted * std + mean
        # Windows are written series by series in time order; the first series' windows
        # are those sharing the first window's mean and std.
        same = np.all(labels[:, h : h + 2] == labels[:1, h : h + 2], axis=1)
        count = int(np.argmin(same)) if not same.all() else len(same)
        actual, forecast = actual[:count], forecast[:count]
        fig, axes = plots.figure(9, 4)
        ax = axes[0][0]
        steps = np.arange(count)
        ax.plot(steps, actual[:, 0], "k-", linewidth=1, label="actual")
        ax.plot(steps, forecast[:, 0], "C0-", linewidth=1, label="forecast, 1 step ahead")
        for start in range(0, count, h):
            span = np.arange(start, start + h)
            ax.plot(span, forecast[start], "C1-", linewidth=1, alpha=0.7,
                    label=f"forecast, {h} steps" if start == 0 else None)  # fmt: skip
        name = self.forecast["series"][0]["name"] if self.forecast.get("series_column") else ""
        ax.set(
            xlabel="test window (first target, in steps from the test cutoff)",
            ylabel=self.forecast.get("target", "value"),
            title=f"Forecast vs actual on the test span {name}".strip()
            + " (its first series)" * bool(name),
        )
        ax.legend()
        plots.save(fig, out)

    # --- the registered model -----------------------------------------------------------

    def check_scores_rows(self) -> None:
        self.features(None)

    def features(self, model_input: Any) -> np.ndarray:
        raise ConfigError(
            "a forecasting model does not score rows one by one: call it with a history "
            f"frame ({self._input_columns_text()}), at least task.context "
            f"({self.context}) points per series, and it returns the next "
            f"{self.horizon} values of each series (mlflow.pyfunc.load_model(...).predict"
            "(history)); `gradline score` scores rows and cannot run it"
        )

    def prediction_columns(self, output: torch.Tensor) -> dict[str, np.ndarray]:
        return self.features(None)

    def _input_columns_text(self) -> str:
        return ", ".join(self._input_columns())

    def _input_columns(self) -> list[str]:
        f = self.forecast
        series = [f["series_column"]] if f.get("series_column") else []
        return [f["time_column"], *series, f["target"], *f.get("covariates", [])]

    def _series_stats(self) -> dict[str, dict[str, Any]]:
        return {s["name"]: s for s in self.forecast["series"]}

    def _times(self, values: Any) -> np.ndarray:
        import pandas as pd

        if self.forecast["time_kind"] == "step":
            return np.asarray(values, dtype=np.int64)
        return pd.to_datetime(values).to_numpy(dtype="datetime64[ns]").astype(np.int64)

    def serve(self, model: torch.nn.Module, model_input: Any, params: dict | None = None) -> Any:
        """The next `horizon` values of each series in the history frame: a frame of
        series, step (1..horizon), time (the last time plus step times the data's usual
        gap, when it has one) and prediction, in the target's units."""
        import pandas as pd

        f = self.forecast
        if not isinstance(model_input, pd.DataFrame):
            raise ValueError(
                f"a forecasting model takes a history DataFrame with columns "
                f"{self._input_columns_text()}; got {type(model_input).__name__}"
            )
        missing = [c for c in self._input_columns() if c not in model_input.columns]
        if missing:
            raise ValueError(
                f"the history frame lacks column(s) {missing}; it needs "
                f"{self._input_columns_text()}"
            )
        history = model_input.copy()
        history["__time"] = self._times(history[f["time_column"]])
        series_col = f.get("series_column")
        history["__series"] = history[series_col].astype(str) if series_col else ""
        known = self._series_stats()
        covariates = list(f.get("covariates", []))
        rows, names, last_times = [], [], []
        for name, group in history.sort_values("__time").groupby("__series", sort=True):
            key = name if series_col else next(iter(known))
            if key not in known:
                raise ValueError(
                    f"series {name!r} was not in the training data, so its scale is unknown; "
                    f"this model forecasts {', '.join(sorted(known))}"
                )
            if len(group) < self.context:
                raise ValueError(
                    f"series {key!r} has {len(group)} points of history; the model needs "
                    f"the last task.context = {self.context} points to forecast"
                )
            stats = known[key]
            recent = group.iloc[-self.context :]
            values = recent[f["target"]].to_numpy(dtype=np.float64)
            if not np.isfinite(values).all():
                raise ValueError(f"series {key!r}: the last {self.context} targets must be numbers")
            scaled = (values - stats["mean"]) / stats["std"]
            cov = recent[covariates].to_numpy(dtype=np.float64)[-1] if covariates else []
            cov = (np.asarray(cov) - np.asarray(f["covariate_mean"])) / np.asarray(
                f["covariate_std"]
            ) if covariates else np.zeros(0)  # fmt: skip
            rows.append(np.concatenate([scaled, cov]))
            names.append(key)
            last_times.append(int(group["__time"].iloc[-1]))
        with torch.no_grad():
            out = model(torch.from_numpy(np.asarray(rows, dtype=np.float32))).double().numpy()
        step = f.get("time_step")
        frames = []
        for i, key in enumerate(names):
            stats = known[key]
            steps = np.arange(1, self.horizon + 1)
            frame = {
                _SERIES: key,
                "step": steps,
                "prediction": out[i] * stats["std"] + stats["mean"],
            }
            if step:
                times = last_times[i] + steps * step
                if f["time_kind"] == "datetime":
                    times = pd.to_datetime(times)
                frame["time"] = times
            frames.append(pd.DataFrame(frame))
        return pd.concat(frames, ignore_index=True)

    def signature(self, generation: Generation):
        """A history frame in (the source's time, series, target and covariate columns),
        a frame of series, step, time and prediction out; the example is the last
        context of the first series, synthesized near its train statistics."""
        import pandas as pd
        from mlflow.models import ModelSignature
        from mlflow.types import ColSpec, Schema

        f = self.forecast
        first = f["series"][0]
        rng = np.random.default_rng(0)
        step = f.get("time_step") or 1
        times = f["test_start"] - step * np.arange(self.context, 0, -1)
        example: dict[str, Any] = {}
        datetime = f["time_kind"] == "datetime"
        example[f["time_column"]] = pd.to_datetime(times) if datetime else times
        if f.get("series_column"):
            example[f["series_column"]] = first["name"]
        example[f["target"]] = first["mean"] + first["std"] * rng.standard_normal(self.context)
        for name, mean in zip(f.get("covariates", []), f.get("covariate_mean", []), strict=True):
            example[name] = np.full(self.context, mean)
        frame = pd.DataFrame(example)
        inputs = [ColSpec("datetime" if datetime else "long", f["time_column"])]
        if f.get("series_column"):
            inputs.append(ColSpec("string", f["series_column"]))
        inputs += [ColSpec("double", c) for c in (f["target"], *f.get("covariates", []))]
        outputs = [ColSpec("string", _SERIES), ColSpec("long", "step")]
        if f.get("time_step"):
            outputs.append(ColSpec("datetime" if datetime else "long", "time"))
        outputs.append(ColSpec("double", "prediction"))
        return ModelSignature(inputs=Schema(inputs), outputs=Schema(outputs)), frame
