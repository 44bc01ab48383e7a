"""`gradline compare-updates`: one configuration trained once per update rule, side by side.

Each rule (`update.rule`: sync, local_sgd, diloco, async) is its own job: the same
config with that one key changed, trained through the train stage's own lifecycle
(training.mlops.jobs.run_job) into its own MLflow run, created before its workers
start. Those runs are children (`mlflow.parentRunId`) of one parent run, created
first, which receives what the
comparison is for: a table (per rule: samples/s and its ratio to the reference rule,
final validation loss and its difference, bytes each rank sends per step and their
ratio, training and wall-clock seconds) and three plots of validation loss against
training seconds, samples seen and bytes sent.

The reference is `sync` when it is among the rules, otherwise the first rule given.
Children never touch the pipeline's model/, result.json or the registry: each writes its
checkpoints, consolidated model and result under `checkpoints/compare/<parent run id>/`
(git-ignored with the rest of checkpoints/). A comparison that stops part-way is not
resumed: running it again starts a new parent run.

This module plans and runs the comparison on shards that are already up to date; the
CLI brings them up to date through DVC first (tasks.dvc_stages.reproduce_shards).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from training.atomic import write_json
from training.config import Config, UpdateConfig, load_config, parse_override
from training.data.manifest import read_manifest
from training.data.spec import DataSpec
from training.engine.faults import ENV as FAULT_ENV
from training.engine.faults import parse as parse_faults
from training.errors import ConfigError
from training.mlops.children import (
    child_request,
    end_parent,
    open_parent,
    refuse_data_key,
    shared_params,
)
from training.mlops.compare_report import (
    COLUMNS,
    HISTORY_KEYS,
    PLOTS,
    ChildRun,
    table_csv,
    table_markdown,
    table_rows,
    table_text,
    write_plots,
)
from training.mlops.jobs import run_job
from training.mlops.lineage import compare_url, run_url, ui_base
from training.mlops.tracking import client, metric_history
from training.models.registry import check_buildable
from training.project import Project

RULES: tuple[str, ...] = get_args(UpdateConfig.model_fields["rule"].annotation)
UPDATE_KEY = "update.rule"
TAG_RULE = "gradline.compare.rule"
TAG_FAULT = "gradline.compare.fault"
# Files the parent run receives, under this artifact folder.
ARTIFACTS = "compare"
TABLE_CSV, TABLE_MD = "updates.csv", "updates.md"


# --- the plan: everything validated before a run or a file exists ---------------------


@dataclass(frozen=True)
class ComparePlan:
    root: Path
    base: Config  # params.yaml + overrides, the update rule as the user left it
    children: dict[str, Config]  # rule -> the same config with update.rule=rule
    fault: str  # GRADLINE_FAULT for the children ("" for none)
    slow_rank: int | None
    slow_factor: float | None

    @property
    def rules(self) -> tuple[str, ...]:
        return tuple(self.children)

    @property
    def reference(self) -> str:
        return "sync" if "sync" in self.children else self.rules[0]


def parse_rules(text: str) -> tuple[str, ...]:
    rules = tuple(part.strip() for part in text.split(",") if part.strip())
    if not rules:
        raise ConfigError(f"--rules: name at least one rule of {', '.join(RULES)}")
    for rule in rules:
        if rule not in RULES:
            raise ConfigError(
                f"--rules: unknown update rule {rule!r}; choose from {', '.join(RULES)} "
                "(comma-separated, e.g. --rules sync,local_sgd)"
            )
    if len(set(rules)) != len(rules):
        raise ConfigError(f"--rules: a rule is named twice in {text!r}")
    return rules


def slow_rank_fault(slow_rank: int | None, slow_factor: float | None, world_size: int) -> str:
    """The GRADLINE_FAULT item that makes `slow_rank` compute `slow_factor` times slower."""
    if slow_rank is None:
        if slow_factor is not None:
            raise ConfigError("--slow-factor needs --slow-rank: which rank is slower")
        return ""
    if not 0 <= slow_rank < world_size:
        raise ConfigError(
            f"--slow-rank {slow_rank}: ranks are 0..{world_size - 1} "
            f"(runtime.procs_per_node={world_size} on this node)"
        )
    factor = 2.0 if slow_factor is None else slow_factor
    if not factor > 1:  # also refuses NaN
        raise ConfigError(
            f"--slow-factor {factor:g}: must be above 1 (how many times longer the slow "
            "rank's compute takes; 2 is a device half as fast)"
        )
    return f"slow:rank={slow_rank}:step=0:factor={factor:g}"


def _check_overrides(overrides: list[str]) -> None:
    for text in overrides:
        section, key, _ = parse_override(text)
        name = f"{section}.{key}"
        if name == UPDATE_KEY:
            raise ConfigError(
                f"--set {text}: each child sets {UPDATE_KEY} itself; name the rules with "
                f"--rules (e.g. --rules sync,local_sgd)"
            )
        refuse_data_key(name, f"--set {text}", "compare-updates")


def plan_comparison(
    root: Path,
    rules: tuple[str, ...],
    overrides: list[str],
    slow_rank: int | None = None,
    slow_factor: float | None = None,
) -> ComparePlan:
    """Validate the whole comparison: every child's config (a rule may not combine with
    the rest of the config: the error names the keys), the fault, the models."""
    project = Project(root)
    _check_overrides(overrides)
    base = load_config(project.params, overrides)
    children = {}
    for rule in rules:
        try:
            children[rule] = load_config(project.params, [*overrides, f"{UPDATE_KEY}={rule}"])
        except ConfigError as exc:
            raise ConfigError(f"--rules {rule}: {exc}") from None
    fault = ";".join(
        filter(
            None,
            [
                os.environ.get(FAULT_ENV, "").strip(),
                slow_rank_fault(slow_rank, slow_factor, base.runtime.procs_per_node),
            ],
        )
    )
    try:
        parse_faults(fault)
    except ValueError as exc:
        raise ConfigError(f"{FAULT_ENV}={fault!r} from the environment: {exc}") from None
    return ComparePlan(root, base, children, fault, slow_rank, slow_factor)


# --- running the children ------------------------------------------------------------


def _train_child(
    plan: ComparePlan, rule: str, parent_id: str, folder: Path, data_version: str
) -> ChildRun:
    """One real training job, through the train stage's lifecycle, into a child run."""
    project, cfg = Project(plan.root), plan.children[rule]
    tags = {TAG_RULE: rule}
    if plan.fault:
        tags[TAG_FAULT] = plan.fault
    work = folder / rule
    request = child_request(
        plan.root, cfg, work, parent_id, f"compare-{rule}", tags, faults=plan.fault
    )
    outcome = run_job(request)
    write_json(
        work / "result.json", {"run_id": outcome.run_id, "rule": rule, "final": outcome.final}
    )
    history = metric_history(project.tracking_uri, outcome.run_id, HISTORY_KEYS)
    return ChildRun(
        rule, outcome.run_id, cfg.train.batch_size, outcome.final, outcome.wall_seconds, history
    )


# --- the whole comparison -------------------------------------------------------------


@dataclass(frozen=True)
class CompareReport:
    parent_id: str
    run_url: str
    compare_url: str  # the parent beside its children in the UI's compare view
    experiment: str
    tracking_uri: str
    folder: Path
    reference: str
    fault: str
    rows: list[dict[str, Any]]
    children: dict[str, str]  # rule -> child run id

    def describe(self) -> str:
        children = ", ".join(f"{rule} {run}" for rule, run in self.children.items())
        return (
            f"gradline compare-updates complete (reference rule: {self.reference}; "
            f"fault: {self.fault or 'none'})\n"
            f"{table_text(self.rows, self.reference)}\n"
            f"  MLflow run     {self.parent_id} (experiment {self.experiment!r}), the parent of\n"
            f"                 {children}\n"
            f"                 {self.run_url}\n"
            f"  side by side   {self.compare_url}\n"
            f"  artifacts      {ARTIFACTS}/{TABLE_CSV}, {TABLE_MD}, "
            f"{', '.join(name for name, _ in PLOTS.values())}\n"
            f"  files          {self.folder}\n"
            f"  tracking store {self.tracking_uri}\n"
            f"  see them with  gradline ui  (MLflow UI on 127.0.0.1)"
        )


def _open_parent(plan: ComparePlan, data_version: str) -> str:
    # What the children share (every key of the job but the rule), and what the
    # comparison adds.
    params = shared_params(plan.base, {UPDATE_KEY})
    params |= {
        "compare.rules": ",".join(plan.rules),
        "compare.reference": plan.reference,
        f"compare.{FAULT_ENV}": plan.fault or "none",
        "compare.slow_rank": "none" if plan.slow_rank is None else str(plan.slow_rank),
        "compare.slow_factor": (
            "none" if plan.slow_rank is None else str(plan.slow_factor or 2.0)  # the default
        ),
    }
    return open_parent(plan.root, plan.base, data_version, "compare-updates", params)


def _log_results(uri: str, parent_id: str, rows: list[dict], files: list[Path]) -> None:
    from mlflow.entities import Metric  # deferred: mlflow is optional on a training machine

    mlflow_client = client(uri)
    stamp = int(time.time() * 1000)
    metrics = [
        Metric(f"{key}/{row['rule']}", float(row[key]), stamp, 0)
        for row in rows
        for key in COLUMNS
        if isinstance(row[key], float) and math.isfinite(row[key])
    ]
    mlflow_client.log_batch(parent_id, metrics=metrics)
    for path in files:
        mlflow_client.log_artifact(parent_id, str(path), ARTIFACTS)


def run_comparison(
    plan: ComparePlan, say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)
) -> CompareReport:
    """Train every rule on the project's current shards, under one parent run."""
    project = Project(plan.root)
    manifest = read_manifest(project.shards)
    data = DataSpec.from_manifest(manifest)
    for cfg in plan.children.values():  # bad input fails before any run exists
        check_buildable(cfg.model, cfg.task.type, data, cfg.layout())
    uri = project.tracking_uri
    parent_id = _open_parent(plan, manifest["data_version"])
    folder = project.checkpoints / "compare" / parent_id
    say(f"compare-updates: parent MLflow run {parent_id}; files in {folder}")
    children: list[ChildRun] = []
    try:
        for n, rule in enumerate(plan.rules, start=1):
            say(f"compare-updates: training rule {rule} ({n}/{len(plan.rules)})")
            children.append(_train_child(plan, rule, parent_id, folder, manifest["data_version"]))
        rows = table_rows(children, plan.reference)
        (folder / TABLE_CSV).write_text(table_csv(rows))
        (folder / TABLE_MD).write_text(table_markdown(rows, plan.reference))
        figures = write_plots(children, folder, plan.fault)
        _log_results(uri, parent_id, rows, [folder / TABLE_CSV, folder / TABLE_MD, *figures])
    except BaseException as exc:
        end_parent(uri, parent_id, exc)
        raise
    end_parent(uri, parent_id, None)
    experiment_id = client(uri).get_run(parent_id).info.experiment_id
    base = ui_base(uri, plan.base.orchestrate.mlflow_ui_url)
    return CompareReport(
        parent_id=parent_id,
        run_url=run_url(base, experiment_id, parent_id),
        compare_url=compare_url(
            base, experiment_id, [parent_id, *(child.run_id for child in children)]
        ),
        experiment=plan.base.registry.experiment,
        tracking_uri=uri,
        folder=folder,
        reference=plan.reference,
        fault=plan.fault,
        rows=rows,
        children={c.rule: c.run_id for c in children},
    )
