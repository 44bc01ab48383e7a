"""Time series: ingest a table of (time, [series], target, covariates), split it by time
and cut it into forecasting windows written as ordinary shards.

Why not the row pipeline: rows there are split by a hash of their key, which for a time
series puts later points into train and earlier ones into test. Here the split is by
time, with cutoffs shared by every series:

- cutoffs: `data.split_dates` [validation start, test start], or fractions of the whole
  time span (shard.val_fraction, shard.test_fraction) measured from its first time. Data
  appended at the end only moves them forward, so an old train point stays train and no
  point ever moves from a later split into an earlier one's past;
- windows: `task.context` past values to predict the `task.horizon` next ones. A window
  belongs to the split of its first target time, and lies whole inside it: a train
  window's every time (context and targets) is before the validation cutoff, a
  validation window's targets are before the test cutoff. (Contexts may reach back into
  earlier splits: those values are known when the forecast is made.) Windows that
  straddle a cutoff are dropped;
- scaling: each series' mean and standard deviation over its train span only; MASE's
  scale is its in-sample seasonal-naive MAE over the same span.

Each window becomes one shard row (features: the scaled context, then the covariates at
the last context time, standardized with train-span statistics; label: the scaled
targets, then the series' mean, std and MASE scale so the objective can report metrics
in the target's units), so the loader, DDP, checkpoints and exact resume work unchanged.
A series snapshot is read whole (pandas): series data sets are small next to memory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training.atomic import atomic_dir, write_json
from training.data.manifest import MANIFEST, MANIFEST_VERSION, SPLITS
from training.data.options import DataConfig, ShardConfig
from training.data.sources import FEATURES, LABEL, ROW_KEY, SERIES_SOURCES, open_chunks
from training.errors import ConfigError, DataError

SERIES_FILE = "series.parquet"
META_SERIES = b"gradline.series"
SERIES, TIME, TARGET = "series", "time", "target"
# Extra columns of a window row: the loader reads features and label only; these say
# which series and which real times a window covers (tests, plots, audits).
SERIES_INDEX, CONTEXT_START, TARGET_START, TARGET_END = (
    "series_index",
    "context_start",
    "target_start",
    "target_end",
)
# Values after the scaled targets in a window's label.
LABEL_EXTRAS = ("series_mean", "series_std", "mase_scale")
MIN_STD = 1e-6
ONE_SERIES = "series"  # the name of the only series when data.series_column is null


@dataclass(frozen=True)
class SeriesLayout:
    """What a series snapshot holds, kept in its Parquet schema metadata."""

    source: str
    time_kind: str  # "datetime" (int64 nanoseconds since 1970) or "step" (whole numbers)
    time_column: str  # the source's names, for the registered model's input
    series_column: str | None
    target: str
    covariates: tuple[str, ...]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def of(cls, schema: pa.Schema) -> SeriesLayout:
        values = json.loads((schema.metadata or {})[META_SERIES])
        return cls(**{**values, "covariates": tuple(values["covariates"])})


def is_series_snapshot(raw_dir: Path) -> bool:
    return (raw_dir / SERIES_FILE).is_file()


# ---- ingest ---------------------------------------------------------------------------


def _source_frame(cfg: DataConfig, root: Path):
    """The source as one DataFrame, and the names of its time, series, target and
    covariate columns."""
    import pandas as pd

    if cfg.source in SERIES_SOURCES:
        builtin = SERIES_SOURCES[cfg.source]
        frame = builtin.frame()
        return frame, builtin.time_column, None, builtin.target, ()
    if cfg.time_column is None:
        raise ConfigError(
            "task.type forecasting needs data.time_column: the column holding each "
            "point's time (dates, or whole-number steps)"
        )
    chunks: Iterator = open_chunks(cfg, root, "values")
    tables = [chunk.table for chunk in chunks]
    frame = pd.concat([t.to_pandas() for t in tables], ignore_index=True)
    special = {cfg.time_column, cfg.label_column, cfg.series_column, cfg.key_column}
    covariates = tuple(
        cfg.feature_columns
        if cfg.feature_columns is not None
        else [c for c in frame.columns if c not in special]
    )
    return frame, cfg.time_column, cfg.series_column, cfg.label_column, covariates


def _times(values, column: str) -> tuple[np.ndarray, str]:
    """int64 times and their kind: whole numbers are steps, anything else is parsed as
    dates (nanoseconds since 1970)."""
    import pandas as pd

    if pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
        numbers = values.to_numpy(dtype=np.float64)
        if np.isnan(numbers).any() or (numbers != np.round(numbers)).any():
            raise DataError(
                f"time column {column!r} holds numbers that are not whole (or missing): "
                "give whole-number steps or dates"
            )
        return numbers.astype(np.int64), "step"
    try:
        parsed = pd.to_datetime(values)
    except (ValueError, TypeError) as exc:
        raise DataError(
            f"time column {column!r}: cannot read its values as dates ({exc}); give ISO "
            "dates (2024-01-31) or whole-number steps"
        ) from exc
    if parsed.isna().any():
        raise DataError(f"time column {column!r} has missing times; fill or drop those rows")
    return parsed.to_numpy(dtype="datetime64[ns]").astype(np.int64), "datetime"


def ingest_series(
    cfg: DataConfig, root: Path, raw_dir: Path, quarantine_dir: Path, report_path: Path
) -> dict[str, Any]:
    """Validate the series table and snapshot it into `raw_dir/series.parquet` (sorted by
    series, then time). Rows with a missing or infinite target or covariate are an error,
    or set aside in `quarantine_dir` with data.on_invalid: quarantine; a repeated
    (series, time) is always an error: which value would be the truth?"""
    import pandas as pd

    frame, time_col, series_col, target, covariates = _source_frame(cfg, root)
    needed = [c for c in (time_col, series_col, target, *covariates) if c is not None]
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise DataError(
            f"the {cfg.source} table has no column {missing[0]!r} (its columns: "
            f"{', '.join(map(str, frame.columns))}); set data.time_column, "
            "data.series_column, data.label_column and data.feature_columns to its names"
        )
    if cfg.max_rows is not None:
        frame = frame.iloc[: cfg.max_rows]
    rows_in = len(frame)
    if rows_in == 0:
        raise DataError(f"the {cfg.source} source has no rows; add data or fix data.path")
    times, time_kind = _times(frame[time_col], time_col)
    values = {}
    for column in (target, *covariates):
        try:
            values[column] = pd.to_numeric(frame[column]).to_numpy(dtype=np.float64)
        except (ValueError, TypeError) as exc:
            raise DataError(f"column {column!r} must hold numbers: {exc}") from exc
    bad = np.zeros(rows_in, dtype=bool)
    for column in values.values():
        bad |= ~np.isfinite(column)
    if bad.any() and cfg.on_invalid == "fail":
        first = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"{int(bad.sum())} rows have a missing or infinite target or covariate (the "
            f"first is row {first}); fill them, or set data.on_invalid: quarantine to set "
            "them aside in data/quarantine/"
        )
    names = frame[series_col].astype(str).to_numpy() if series_col else None
    clean = pd.DataFrame(
        {
            SERIES: names if names is not None else np.full(rows_in, ONE_SERIES),
            TIME: times,
            **{TARGET if c == target else c: v for c, v in values.items()},
        }
    )
    rejected = clean[bad]
    clean = clean[~bad].sort_values([SERIES, TIME], kind="stable").reset_index(drop=True)
    repeated = clean.duplicated([SERIES, TIME])
    if repeated.any():
        row = clean[repeated].iloc[0]
        raise DataError(
            f"series {row[SERIES]!r} has two rows at time {row[TIME]}: each (series, time) "
            "must appear once; drop the repeats (or set data.series_column if the table "
            "holds several series)"
        )
    layout = SeriesLayout(cfg.source, time_kind, time_col, series_col, target, covariates)
    table = pa.Table.from_pandas(clean, preserve_index=False)
    table = table.replace_schema_metadata({META_SERIES: layout.to_json()})
    with atomic_dir(raw_dir) as raw_stage, atomic_dir(quarantine_dir) as q_stage:
        pq.write_table(table, raw_stage / SERIES_FILE)
        if len(rejected):
            pq.write_table(
                pa.Table.from_pandas(rejected, preserve_index=False), q_stage / SERIES_FILE
            )
    report = {
        "source": cfg.source,
        "rows_in": rows_in,
        "rows_accepted": len(clean),
        "rows_quarantined": int(bad.sum()),
        "series": int(clean[SERIES].nunique()),
        "time_kind": time_kind,
        "covariates": list(covariates),
    }
    write_json(report_path, report)
    return report


def read_series(raw_dir: Path):
    """(the snapshot as a DataFrame sorted by series and time, its layout)."""
    path = raw_dir / SERIES_FILE
    if not path.is_file():
        raise DataError(
            f"no {SERIES_FILE} in {raw_dir}: the raw data is not a series snapshot; re-run "
            "the ingest stage with task.type forecasting"
        )
    table = pq.read_table(path)
    return table.to_pandas(), SeriesLayout.of(table.schema)


# ---- splitting by time ----------------------------------------------------------------


def parse_time(value: str, time_kind: str) -> int:
    """A date (or a step) as the snapshot's int64 times."""
    import pandas as pd

    if time_kind == "step":
        try:
            return int(value)
        except ValueError:
            raise ConfigError(
                f"data.split_dates {value!r}: the time column holds steps, give whole numbers"
            ) from None
    try:
        return int(pd.Timestamp(value).value)
    except ValueError as exc:
        raise ConfigError(f"data.split_dates {value!r} is not a date: {exc}") from None


def split_cutoffs(
    first: int,
    last: int,
    val_fraction: float,
    test_fraction: float,
    split_dates: list[str] | None = None,
    time_kind: str = "step",
) -> tuple[int, int]:
    """(validation start, test start): the first times of validation and test, shared by
    every series. From the dates when given, else fractions of [first, last] measured
    from `first`: appending later data (a larger `last`) only moves them forward."""
    if split_dates is not None:
        val_start, test_start = (parse_time(d, time_kind) for d in split_dates)
        if not val_start <= test_start:
            raise ConfigError(
                f"data.split_dates {split_dates}: the validation start must not be after the "
                "test start"
            )
        return val_start, test_start
    span = last - first
    val_start = first + math.ceil(span * (1.0 - val_fraction - test_fraction))
    test_start = first + math.ceil(span * (1.0 - test_fraction))
    return val_start, test_start


def split_of(times: np.ndarray, val_start: int, test_start: int) -> np.ndarray:
    """0 train, 1 validation, 2 test for each time."""
    return np.where(times >= test_start, 2, np.where(times >= val_start, 1, 0))


# ---- windows --------------------------------------------------------------------------


@dataclass(frozen=True)
class SeriesStats:
    name: str
    mean: float
    std: float
    mase_scale: float  # in-sample seasonal-naive MAE over the train span
    train_points: int


def series_stats(name: str, train_values: np.ndarray, season: int) -> SeriesStats:
    """Scaling and MASE scale of one series from its train span only."""
    if len(train_values) <= season:
        raise ConfigError(
            f"series {name!r} has {len(train_values)} points before the validation cutoff, "
            f"too few for task.season {season} (MASE's scale compares each train point with "
            "the one a season earlier); lower task.season or move the cutoffs later"
        )
    std = float(train_values.std())
    diffs = np.abs(train_values[season:] - train_values[:-season])
    scale = float(diffs.mean())
    return SeriesStats(
        name,
        float(train_values.mean()),
        std if std > MIN_STD else 1.0,
        scale if scale > MIN_STD else 1.0,  # a constant series: errors stay in units
        len(train_values),
    )


@dataclass
class Windows:
    """One split's windows as columns."""

    features: list[np.ndarray]
    labels: list[np.ndarray]
    series_index: list[np.ndarray]
    times: list[np.ndarray]  # (n, 3): context start, first target, last target

    @classmethod
    def empty(cls) -> Windows:
        return cls([], [], [], [])

    @property
    def rows(self) -> int:
        return sum(len(f) for f in self.features)

    def table(self, first_key: int) -> pa.Table:
        features = np.concatenate(self.features).astype(np.float32)
        labels = np.concatenate(self.labels).astype(np.float64)
        times = np.concatenate(self.times)
        n = len(features)
        return pa.Table.from_arrays(
            [
                pa.array(np.arange(first_key, first_key + n, dtype=np.uint64)),
                pa.FixedSizeListArray.from_arrays(
                    pa.array(features.reshape(-1)), features.shape[1]
                ),
                pa.FixedSizeListArray.from_arrays(pa.array(labels.reshape(-1)), labels.shape[1]),
                pa.array(np.concatenate(self.series_index).astype(np.int32)),
                pa.array(times[:, 0]),
                pa.array(times[:, 1]),
                pa.array(times[:, 2]),
            ],
            names=[ROW_KEY, FEATURES, LABEL, SERIES_INDEX, CONTEXT_START, TARGET_START, TARGET_END],
        )


def series_windows(
    times: np.ndarray,
    scaled: np.ndarray,
    covariates: np.ndarray,
    context: int,
    horizon: int,
    cutoffs: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every window of one series (sorted by time) that lies whole in one split: its
    features (scaled context, then the covariates at the last context time), its scaled
    targets, its split code and its (context start, first target, last target) times."""
    n = len(times)
    starts = np.arange(context, n - horizon + 1)  # index of each window's first target
    if not len(starts):
        empty = np.zeros((0, context + covariates.shape[1]))
        return empty, np.zeros((0, horizon)), np.zeros(0, int), np.zeros((0, 3), np.int64)
    codes = split_of(times, *cutoffs)
    first, last = codes[starts], codes[starts + horizon - 1]
    keep = first == last  # a window straddling a cutoff belongs to no split
    starts = starts[keep]
    past = scaled[starts[:, None] + np.arange(-context, 0)]
    future = scaled[starts[:, None] + np.arange(horizon)]
    features = np.concatenate([past, covariates[starts - 1]], axis=1)
    spans = np.stack([times[starts - context], times[starts], times[starts + horizon - 1]], axis=1)
    return features, future, first[keep], spans


def _time_step(frame) -> int | None:
    """The most common gap between consecutive times of a series (None with one point)."""
    gaps = np.concatenate(
        [np.diff(group[TIME].to_numpy()) for _, group in frame.groupby(SERIES, sort=False)]
    )
    gaps = gaps[gaps > 0]
    if not len(gaps):
        return None
    values, counts = np.unique(gaps, return_counts=True)
    return int(values[np.argmax(counts)])


def write_window_shards(
    data: DataConfig,
    shard: ShardConfig,
    context: int,
    horizon: int,
    season: int,
    raw_dir: Path,
    out_dir: Path,
    data_version: str,
) -> dict[str, Any]:
    """Split the series snapshot by time and write each split's windows as shards, with a
    manifest whose `forecast` entry holds the cutoffs and each series' statistics."""
    frame, layout = read_series(raw_dir)
    first, last = int(frame[TIME].min()), int(frame[TIME].max())
    cutoffs = split_cutoffs(
        first, last, shard.val_fraction, shard.test_fraction, data.split_dates, layout.time_kind
    )
    covariates = list(layout.covariates)
    cov_mean, cov_std = _covariate_moments(frame[frame[TIME] < cutoffs[0]], covariates)
    splits, stats = _windows_by_split(
        frame, covariates, cov_mean, cov_std, context, horizon, season, cutoffs
    )
    _check_every_split_has_windows(splits, stats, context, horizon)
    forecast = {
        "context": context,
        "horizon": horizon,
        "season": season,
        "time_kind": layout.time_kind,
        "time_column": layout.time_column,
        "series_column": layout.series_column,
        "target": layout.target,
        "covariates": covariates,
        "covariate_mean": list(cov_mean),
        "covariate_std": list(cov_std),
        "val_start": cutoffs[0],
        "test_start": cutoffs[1],
        "time_step": _time_step(frame),
        "series": [asdict(s) for s in stats],
    }
    with atomic_dir(out_dir) as staging:
        written, schema = _write_splits(splits, staging, max(1, int(shard.target_shard_mb * 2**20)))
        manifest: dict[str, Any] = {
            "version": MANIFEST_VERSION,
            "data_version": data_version,
            "schema": {f.name: str(f.type) for f in schema},
            "kind": "series",
            "feature_shape": [context + len(covariates)],
            "num_classes": None,
            "label_type": "float64",
            "feature_names": [f"{layout.target}[t-{lag}]" for lag in range(context, 0, -1)]
            + covariates,
            "feature_stats": None,
            "label_stats": None,
            "forecast": forecast,
            "splits": written,
        }
        write_json(staging / MANIFEST, manifest)
    return manifest


def _covariate_moments(train_rows: Any, covariates: list[str]) -> tuple[list, list]:
    """The covariates' mean and std over the train span (scaling from train only)."""
    if not covariates:
        return [], []
    from training.data.shards import RunningMoments

    moments = RunningMoments()
    moments.add(train_rows[covariates].to_numpy())
    return moments.result()


def _windows_by_split(
    frame: Any,
    covariates: list[str],
    cov_mean: list,
    cov_std: list,
    context: int,
    horizon: int,
    season: int,
    cutoffs: tuple[int, int],
) -> tuple[dict[str, Windows], list[SeriesStats]]:
    """Every series scaled by its train span and cut into windows, gathered per split;
    a window's label is its scaled future, then the series' mean, std and MASE scale."""
    splits = {name: Windows.empty() for name in SPLITS}
    stats: list[SeriesStats] = []
    for index, (name, group) in enumerate(frame.groupby(SERIES, sort=True)):
        times = group[TIME].to_numpy()
        values = group[TARGET].to_numpy()
        one = series_stats(str(name), values[times < cutoffs[0]], season)
        stats.append(one)
        scaled = (values - one.mean) / one.std
        if covariates:
            cov = (group[covariates].to_numpy() - cov_mean) / cov_std
        else:
            cov = np.zeros((len(group), 0))
        features, future, codes, spans = series_windows(
            times, scaled, cov, context, horizon, cutoffs
        )
        extras = np.tile([one.mean, one.std, one.mase_scale], (len(future), 1))
        labels = np.concatenate([future, extras], axis=1)
        for code, split in enumerate(SPLITS):
            chosen = codes == code
            if chosen.any():
                windows = splits[split]
                windows.features.append(features[chosen])
                windows.labels.append(labels[chosen])
                windows.series_index.append(np.full(int(chosen.sum()), index))
                windows.times.append(spans[chosen])
    return splits, stats


def _check_every_split_has_windows(
    splits: dict[str, Windows], stats: list[SeriesStats], context: int, horizon: int
) -> None:
    if splits["train"].rows == 0:
        longest = max(s.train_points for s in stats)
        raise ConfigError(
            f"no training window fits: task.context ({context}) + task.horizon ({horizon}) "
            f"= {context + horizon} points, and the longest train span (before the "
            f"validation cutoff) has {longest}; lower task.context or task.horizon, or "
            "give train more of the time span (shard.val_fraction, shard.test_fraction, "
            "data.split_dates)"
        )
    for split in SPLITS:
        if splits[split].rows == 0:
            raise DataError(
                f"split {split!r} has no whole window of task.context {context} + "
                f"task.horizon {horizon} points; give it more of the time span "
                "(shard.val_fraction, shard.test_fraction, data.split_dates) or lower "
                "task.horizon"
            )


def _write_splits(splits: dict[str, Windows], staging: Path, target_bytes: int) -> tuple[dict, Any]:
    """Each split's windows as shards under `staging` (keys run on across the splits):
    (rows and shards per split, the shards' Arrow schema)."""
    from training.data.shards import _SplitWriter

    key = 0
    written = {}
    for split in SPLITS:
        windows = splits[split]
        table = windows.table(key)
        writer = _SplitWriter(split, staging, target_bytes)
        writer.add(table)
        writer.flush()
        key += windows.rows
        written[split] = {"rows": writer.rows, "shards": writer.shards}
    return written, table.schema
