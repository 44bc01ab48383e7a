"""The model card's markdown, from its facts (training.mlops.model_card.CardFacts).

Sections: what the model is, the data, results (every test metric with its bootstrap
interval beside the baseline's), how it was trained, lineage, limitations. Numbers are
shown with 4 decimals; a missing fact says what is missing rather than leaving a gap.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

from training.mlops.hardware import TAG_HARDWARE
from training.mlops.tracking import (
    TAG_DATA_VERSION,
    TAG_FLOW_RUN,
    TAG_GIT_COMMIT,
    TAG_GIT_DIRTY,
    TAG_JOB_KEY,
)

# The params that compute the model (training.config.jobspec: the train stage's sections).
JOB_SECTIONS = ("task", "model", "optim", "train", "update")
MESH = ("dp_replicate", "dp_shard", "tp", "pp")
WORST_CLASSES = 3
SPLIT_ORDER = {"train": 0, "val": 1, "test": 2}
NO_DRIFT = "no drift check recorded"
DRIFT_ROWS = 5  # the most drifted features a card lists


def number(value: Any) -> str:
    """4 decimals; n/a for NaN or a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{float(value):.4f}"


def interval(bounds: Any) -> str:
    if not bounds:
        return "n/a"
    low, high = bounds
    return f"[{number(low)}, {number(high)}]"


def _table(rows: list[tuple[str, str]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _when(ms: int | None) -> str:
    if not ms:
        return "n/a"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC")


def render(facts) -> str:
    """The whole card."""
    alias = ", ".join(facts.aliases) or "no alias"
    lines = [
        f"# Model card: {facts.model_name} v{facts.version}",
        "",
        f"**{alias}**. {facts.verdict[:1].upper()}{facts.verdict[1:]}.",
        "",
        *_what(facts),
        *_data(facts),
        *_results(facts),
        *_training(facts),
        *_lineage(facts),
        *_limitations(facts),
    ]
    return "\n".join(lines).rstrip() + "\n"


def _what(facts) -> list[str]:
    params = facts.params
    # A user's model is named by its factory (model.target), gradline's by model.name.
    target = params.get("model.target", "None")
    name = target if target != "None" else params.get("model.name", "n/a")
    shape = ", ".join(
        f"{k.removeprefix('model.')}={v}"
        for k, v in sorted(params.items())
        if k.startswith("model.") and k not in ("model.name", "model.target") and v != "None"
    )
    size = facts.details.get("parameters")
    direction = "higher" if facts.higher_is_better else "lower"
    task = facts.task
    if classes := (facts.manifest or {}).get("num_classes"):
        task += f" ({classes} classes)"
    return [
        "## What it is",
        "",
        *_table(
            [
                ("task", task),
                ("model", f"`{name}`" + (f" ({shape})" if shape else "")),
                ("parameters", f"{size:,}" if isinstance(size, int) else "n/a"),
                (
                    "registered as",
                    f"`models:/{facts.model_name}/{facts.version}` ({alias_text(facts)})",
                ),
                ("gate metric", f"{facts.gate_metric} ({direction} is better)"),
            ]
        ),
        "",
    ]


def alias_text(facts) -> str:
    return "aliases: " + (", ".join(facts.aliases) or "none")


def _data(facts) -> list[str]:
    manifest = facts.manifest
    rows: list[tuple[str, str]] = [
        ("data version", f"`{facts.tags.get(TAG_DATA_VERSION, 'n/a')}` (DVC md5 of data/raw)"),
        ("source", _source(facts.params)),
    ]
    if manifest is None:
        rows.append(("splits", "n/a (the shards here hold another data version)"))
    else:
        splits = manifest.get("splits", {})
        order = sorted(splits, key=lambda name: (SPLIT_ORDER.get(name, len(SPLIT_ORDER)), name))
        counts = " · ".join(f"{name} {splits[name].get('rows', 0):,}" for name in order)
        rows.append(("rows", counts))
        rows.append(("features", _features(manifest)))
        rows.append(("label", _label(manifest)))
    support = facts.details.get("per_class", {}).get("support")
    if support:
        counts = ", ".join(f"{i}: {int(n)}" for i, n in enumerate(support))
        rows.append(("test rows per class", counts))
    return ["## Data", "", *_table(rows), "", *_drift(facts.drift), ""]


def _source(params: dict[str, str]) -> str:
    source = params.get("data.source", "n/a")
    if source in ("parquet", "csv", "images", "text") and params.get("data.path"):
        return f"{source} from `{params['data.path']}`"
    return source


def _features(manifest: dict) -> str:
    kind = manifest.get("kind", "table")
    if kind == "tokens":
        return f"token windows, vocabulary of {manifest.get('vocab_size', 'n/a')}"
    shape = manifest.get("feature_shape") or []
    names = manifest.get("feature_names") or []
    text = f"{kind}, shape {'x'.join(str(d) for d in shape) or 'n/a'}"
    if names:
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        text += f": {shown}"
    return text


def _label(manifest: dict) -> str:
    if manifest.get("kind") == "tokens":
        return "the next token"
    if manifest.get("num_classes"):
        return f"class id 0..{manifest['num_classes'] - 1}"
    stats = manifest.get("label_stats") or {}
    if stats:
        return f"a value: train mean {number(stats.get('mean'))}, std {number(stats.get('std'))}"
    return manifest.get("label_type", "n/a")


def _drift(drift: Any) -> list[str]:
    """The hook for the ingest stage's drift check: data/ingest.json's `drift` entry
    as recorded, its scalars as rows and its lists of records as tables."""
    if drift is None:
        return ["### Drift vs the previous champion", "", NO_DRIFT]
    lines = ["### Drift vs the previous champion", ""]
    if not isinstance(drift, dict):
        return [*lines, _cell(drift)]
    if "message" in drift:  # the ingest stage's section (training.mlops.drift)
        return [*lines, str(drift["message"]), "", *_drifted_features(drift)]
    scalars = [(k, v) for k, v in drift.items() if not isinstance(v, (dict, list))]
    if scalars:
        lines += _table([(k, _cell(v)) for k, v in scalars])
    for key, value in drift.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            columns = list(dict.fromkeys(c for record in value for c in record))
            lines += ["", f"{key}:", "", "| " + " | ".join(columns) + " |"]
            lines.append("|" + "---|" * len(columns))
            lines += [
                "| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in value[:10]
            ]
        elif isinstance(value, (dict, list)):
            lines += ["", f"{key}: `{_cell(value)}`"]
    return lines


def _drifted_features(drift: dict) -> list[str]:
    """The most drifted features as a table (tables: PSI per feature, most first)."""
    features = drift.get("features")
    pairs = [f for f in features or [] if isinstance(f, (list, tuple)) and len(f) == 2]
    if not pairs:
        return []
    rows = [(f"`{name}`", _cell(psi)) for name, psi in pairs[:DRIFT_ROWS]]
    return ["| feature | PSI |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows), ""]


def _results(facts) -> list[str]:
    boot = facts.details.get("bootstrap", {})
    intervals = boot.get("intervals", {})
    tests = sorted(k for k in facts.metrics if k.startswith("test_") and "/" not in k)
    rows = [
        f"| {key} | {number(facts.metrics[key])} | {interval(intervals.get(key))} "
        f"| {number(facts.metrics.get('baseline_' + key))} "
        f"| {interval(intervals.get('baseline_' + key))} |"
        for key in tests
    ]
    test_rows = facts.details.get("test_rows")
    if intervals:
        how = (
            f"{int(boot.get('confidence', 0.95) * 100)} % intervals: percentile bootstrap, "
            f"{boot.get('replicates')} Poisson resamples of the {test_rows} test rows "
            f"(seed {boot.get('seed')}); the baseline is resampled with the same weights."
        )
    else:
        how = "No intervals: " + (boot.get("note") or "the evaluation recorded none.")
    return [
        "## Results on the test split",
        "",
        how,
        "",
        "| metric | model | 95 % interval | baseline | baseline 95 % interval |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]


def _training(facts) -> list[str]:
    params, tags, metrics, final = facts.params, facts.tags, facts.metrics, facts.final or {}
    steps = _count(final.get("step"))
    if "epoch" in metrics:
        steps += f" ({int(metrics['epoch'])} epochs)"
    rows = [
        ("job key", f"`{tags.get(TAG_JOB_KEY, 'n/a')}`"),
        ("layout", _layout(tags)),
        ("update rule", params.get("update.rule", "n/a")),
        ("optimizer", _optimizer(params)),
        ("steps", steps),
    ]
    if final.get("selected_step") is not None:  # train.select: the best validation step
        rule = params.get("train.select", "best")
        rows.append(("model from step", f"{_count(final['selected_step'])} (train.select: {rule})"))
    train_s = metrics.get("train_seconds")
    wall = (facts.end_ms - facts.start_ms) / 1000 if facts.end_ms else None
    time = f"{train_s:.2f} s in the training loop" if train_s is not None else "n/a"
    if wall is not None:
        time += f"; {wall:.1f} s the run (start-up and validation included)"
    rows.append(("time", time))
    rows.append(("hardware", tags.get(TAG_HARDWARE, "not recorded")))
    keys = [
        f"| `{k}` | {_cell(v)} |"
        for k, v in sorted(params.items())
        if k.split(".")[0] in JOB_SECTIONS
    ]
    return [
        "## How it was trained",
        "",
        *_table(rows),
        "",
        "Job keys (what computes the model; the job key hashes them with the data version):",
        "",
        "| key | value |",
        "|---|---|",
        *keys,
        "",
    ]


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else ("n/a" if value is None else str(value))


def _layout(tags: dict[str, str]) -> str:
    try:
        procs = int(tags.get("gradline.runtime.procs_per_node", "1"))
        nodes = int(tags.get("gradline.runtime.nnodes", "1"))
        mesh = {d: int(tags.get(f"gradline.parallel.{d}", "1")) for d in MESH}
    except ValueError:
        return "n/a"
    workers = procs * nodes
    fixed = math.prod(v for v in mesh.values() if v > 0)
    mesh = {d: (workers // fixed if v == -1 else v) for d, v in mesh.items()}
    shown = " ".join(f"{d}={v}" for d, v in mesh.items())
    return f"{workers} workers ({nodes} node x {procs}); mesh {shown}"


def _optimizer(params: dict[str, str]) -> str:
    name = params.get("optim.name", "n/a")
    extra = ", ".join(
        f"{k}={params[f'optim.{k}']}"
        for k in ("lr", "lr_schedule", "weight_decay")
        if f"optim.{k}" in params
    )
    return f"{name} ({extra})" if extra else name


def _lineage(facts) -> list[str]:
    tags = facts.tags
    commit = tags.get(TAG_GIT_COMMIT, "n/a")
    if tags.get(TAG_GIT_DIRTY) == "true":
        commit += " (with uncommitted changes)"
    rows = [
        ("data version", f"`{tags.get(TAG_DATA_VERSION, 'n/a')}`"),
        ("git commit", f"`{commit}`"),
        ("MLflow run", f"`{facts.run_id}` (experiment {facts.experiment_id})"),
        ("job key", f"`{tags.get(TAG_JOB_KEY, 'n/a')}`"),
        (
            "Prefect flow run",
            f"`{tags[TAG_FLOW_RUN]}`" if TAG_FLOW_RUN in tags else "not run by Prefect",
        ),
        ("trained", f"{_when(facts.start_ms)} to {_when(facts.end_ms)}"),
    ]
    return ["## Lineage", "", *_table(rows), ""]


def _limitations(facts) -> list[str]:
    lines = ["## Limitations", "", f"- Gate: {facts.verdict}."]
    test_rows = facts.details.get("test_rows")
    if test_rows is not None:
        lines.append(
            f"- Measured on {test_rows:,} test rows: the intervals above say how much the "
            "metrics could move on another sample of the same data; data unlike it "
            "(see drift) is not covered."
        )
    per_class = facts.details.get("per_class", {})
    recall, support = per_class.get("recall"), per_class.get("support")
    if recall and support:
        seen = [
            (r, i, int(n))
            for i, (r, n) in enumerate(zip(recall, support, strict=True))
            if n and r is not None and not math.isnan(r)
        ]
        worst = sorted(seen)[:WORST_CLASSES]
        shown = "; ".join(
            f"class {i}: {number(r)} ({round(r * n)} of {n} test rows)" for r, i, n in worst
        )
        lines.append(f"- Worst recall: {shown}.")
    note = facts.details.get("bootstrap", {}).get("note")
    if note:
        lines.append(f"- Intervals: {note}.")
    return lines
