"""Ready-made workloads: `gradline example NAME` writes one into params.yaml.

An example sets every key of the sections that say what is computed (data, task, model,
optim, train, update: unmentioned keys go back to their defaults, so switching examples
leaves nothing behind) plus the registered model's name, so different tasks never compete in
one registry gate. How the job runs (runtime) stays the user's, but for the keys an
example needs (e.g. a language model validates every few hundred steps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.config import Config, load_config, update_params_file
from training.errors import ConfigError

# Sections an example owns whole; `shard` keeps the user's split fractions.
OWNED = ("data", "task", "model", "optim", "train", "update")
# Keys of `parallel` an example owns: a sharded one sets them, every other puts them back
# (they apply to a model with embedding tables only). The mesh stays the user's.
EMBEDDING_KEYS = ("embedding_sharding", "embedding_budget_mb")

EXAMPLES: dict[str, dict[str, Any]] = {
    "digits-mlp": {
        "about": "8x8 digit images (scikit-learn, bundled), a two-layer MLP: the default",
        "data": {"source": "digits"},
        "task": {"type": "classification"},
        "model": {"name": "mlp", "hidden": 256, "depth": 2, "dropout": 0.2},
        "optim": {"lr": 0.005},
        "train": {"epochs": 30, "batch_size": 64},
        "registry": {"model_name": "gradline-digits"},
    },
    "digits-cnn": {
        "about": "the same digits as images, a small ResNet-style CNN (>= 0.98 accuracy)",
        "data": {"source": "digits"},
        "task": {"type": "classification"},
        "model": {"name": "cnn", "channels": 16, "blocks": 2, "stages": 2, "dropout": 0.0},
        "optim": {"lr": 0.005, "weight_decay": 0.05},
        "train": {"epochs": 30, "batch_size": 64},
        "registry": {"model_name": "gradline-digits-cnn"},
    },
    "diabetes-regression": {
        "about": "scikit-learn's bundled diabetes table (442 rows), an MLP regressor",
        "data": {"source": "diabetes"},
        "task": {"type": "regression"},
        # 309 training rows: a wide layer held back by heavy dropout and a small step.
        "model": {"name": "mlp", "hidden": 64, "depth": 1, "dropout": 0.5},
        "optim": {"lr": 0.001, "weight_decay": 0.01, "warmup_steps": 10},
        "train": {"epochs": 100, "batch_size": 32},
        "registry": {"model_name": "gradline-diabetes"},
    },
    "clicks-dlrm": {
        "about": "generated click logs (power-law users and items), a DLRM: beats item "
        "popularity and hashed-id logistic regression on AUC",
        "data": {
            "source": "clicks",
            "clicks_rows": 200_000,
            "clicks_users": 2000,
            "clicks_items": 1000,
        },
        "task": {"type": "click"},
        "model": {"name": "dlrm", "embedding_dim": 32, "bottom": [32], "top": [64, 32]},
        # Embedding rows of rare ids see few updates: a step ~4x the MLPs' (0.003 needs
        # three epochs for what 0.02 learns in one), and the best validation AUC kept:
        # the tables overfit after one or two epochs.
        "optim": {"lr": 0.02, "weight_decay": 0.0, "warmup_steps": 20},
        "train": {"epochs": 2, "batch_size": 512},
        "registry": {"model_name": "gradline-clicks-dlrm"},
    },
    "stdlib-gpt": {
        "about": "a small GPT on the running Python's standard library source (bytes)",
        "data": {"source": "stdlib", "max_bytes": 4_000_000, "tokenizer": "bytes"},
        "task": {"type": "language_modeling"},
        "model": {
            "name": "gpt",
            "layers": 4,
            "heads": 4,
            "width": 128,
            "context": 128,
            "dropout": 0.0,
            "tied_embeddings": True,
        },
        "optim": {"lr": 0.002, "warmup_steps": 100, "weight_decay": 0.01},
        # A budget in steps, not epochs: the same training time with either tokenizer
        # (bpe packs ~3.5 bytes a token, so an epoch has ~3.5x fewer windows).
        "train": {"epochs": 10, "max_steps": 650, "batch_size": 32},
        "runtime": {"eval_every_steps": 500, "log_every_steps": 50},
        "registry": {"model_name": "gradline-stdlib-gpt"},
    },
    "co2-forecast": {
        "about": "weekly Mauna Loa CO2 1958-2001 (statsmodels, bundled): a causal TCN "
        "forecasting 13 weeks from 2 years, against seasonal naive",
        "data": {"source": "co2"},
        # Two years of weekly context, a quarter ahead, a yearly season.
        "task": {"type": "forecasting", "context": 104, "horizon": 13, "season": 52},
        "model": {"name": "tcn", "channels": 16, "layers": 4, "kernel_size": 3, "dropout": 0.0},
        "optim": {"lr": 0.003, "warmup_steps": 10, "weight_decay": 0.0001},
        "train": {"epochs": 15, "batch_size": 64},
        "registry": {"model_name": "gradline-co2"},
    },
}

# The same workload as clicks-dlrm (so the same model and figures), its tables over one
# rank's budget: unsharded they need 1.1 MB (weights + AdamW state) on every rank;
# row-wise over runtime.procs_per_node=2 workers each holds 0.56 MB.
EXAMPLES["clicks-dlrm-sharded"] = {
    **EXAMPLES["clicks-dlrm"],
    "about": "clicks-dlrm with tables over one rank's parallel.embedding_budget_mb: "
    "trains only because they are sharded row-wise over the workers",
    "parallel": {"embedding_sharding": "row", "embedding_budget_mb": 0.75},
    "registry": {"model_name": "gradline-clicks-dlrm-sharded"},
}


def describe() -> str:
    width = max(map(len, EXAMPLES))
    return "\n".join(f"{name:<{width}}  {ex['about']}" for name, ex in EXAMPLES.items())


def example_changes(name: str) -> dict[str, dict[str, Any]]:
    """Section -> key -> value that the example writes: the owned sections whole."""
    if name not in EXAMPLES:
        raise ConfigError(
            f"no example named {name!r}; examples: {', '.join(EXAMPLES)} "
            "(`gradline example --list` describes them)"
        )
    example = EXAMPLES[name]
    defaults = Config().model_dump()
    changes = {}
    for section in OWNED:
        base = {} if section == "model" else defaults[section]
        changes[section] = {**base, **example.get(section, {})}
    for section in ("runtime", "registry"):
        if section in example:
            changes[section] = dict(example[section])
    embedding = {key: defaults["parallel"][key] for key in EMBEDDING_KEYS}
    changes["parallel"] = {**embedding, **example.get("parallel", {})}
    return changes


def apply_example(params_path: Path, name: str) -> Config:
    """Validate the example against params.yaml's other sections, then write it."""
    changes = example_changes(name)
    raw = load_config(params_path).model_dump()
    for section, values in changes.items():
        raw[section] = values if section in OWNED else {**raw[section], **values}
    try:
        config = Config.model_validate(raw)
    except ValueError as exc:
        raise ConfigError(f"example {name} does not validate with params.yaml: {exc}") from exc
    update_params_file(params_path, changes, replace=frozenset({"model"}))
    return config
