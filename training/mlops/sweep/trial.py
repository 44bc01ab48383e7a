"""One trial: its job trained in this process, pruned from its own journal.

The trial's config is a job like any other: it trains through the train stage's
lifecycle (training.mlops.jobs.run_job) into a child run of the sweep's parent run,
with its files in the trial's folder. While it trains, a watcher thread reads the job's
journal (rank 0 appends every validation's metrics there as it computes them:
training.mlops.tracking) and reports each new value of the sweep's metric to Optuna;
when the pruner says the trial is behind, the watcher asks the job to stop through its
control store, the way a preemption does, and every rank stops at the same step with a
checkpoint. The trial then ends PRUNED in Optuna and KILLED in MLflow, tagged
`gradline.sweep.state=pruned`.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from training.config import Config, jobspec
from training.data.loader import batches_per_epoch, open_reader
from training.data.manifest import read_manifest
from training.data.spec import DataSpec
from training.engine.control import Control
from training.engine.jobdir import JobDir
from training.engine.launch import Preempted, TrainingFailed, open_control
from training.errors import ConfigError, DataError
from training.mlops.children import child_request
from training.mlops.jobs import run_job
from training.mlops.sweep.plan import SweepPlan
from training.mlops.sweep.study import RESUMES
from training.mlops.tracking import client, read_journal
from training.models.registry import context_length
from training.project import Project

POLL_S = 0.2  # how often the watcher reads the journal
TAG_SWEEP = "gradline.sweep.name"
TAG_TRIAL = "gradline.sweep.trial"
TAG_STATE = "gradline.sweep.state"
TAG_STEPS = "gradline.sweep.steps"
TAG_RESUMES = "gradline.sweep.resumes"


@dataclass(frozen=True)
class TrialResult:
    state: str  # complete | pruned | failed | interrupted
    value: float | None  # the metric: final (complete) or the last reported (pruned)
    steps: int  # training steps the job ran
    planned: int  # steps it would have run to the end
    run_id: str | None
    message: str = ""


def planned_steps(cfg: Config, shards: Path) -> int:
    """Steps the job trains when nothing stops it (what the loop computes: epochs of
    whole global batches, at most train.max_steps)."""
    manifest = read_manifest(shards)
    context = context_length(cfg.model, DataSpec.from_manifest(manifest).kind)
    rows = open_reader(shards, manifest, "train", context=context).num_rows
    total = cfg.train.epochs * batches_per_epoch(rows, cfg.train.batch_size)
    return min(total, cfg.train.max_steps or total)


class TrialJob:
    """One trial's job, its watcher and its stop switch."""

    def __init__(
        self,
        plan: SweepPlan,
        trial: optuna.Trial,
        cfg: Config,
        folder: Path,
        parent_id: str,
        data_version: str,
        say: Callable[[str], None],
    ) -> None:
        self.plan, self.trial, self.cfg, self.folder = plan, trial, cfg, folder
        self.parent_id, self.say = parent_id, say
        # A private control store on loopback: trials running at once never share one.
        runtime = cfg.runtime.model_copy(update={"rdzv_endpoint": "", "rdzv_id": ""})
        self.control: Control = open_control(runtime)
        self.job_dir = JobDir(folder / jobspec.job_key(cfg, data_version))
        self.done = threading.Event()
        self.pruned_at: int | None = None
        self.reported: dict[int, float] = {}  # step -> value, as Optuna holds them
        self.steps = 0

    def stop(self) -> None:
        """Stop the job at its next control step (the sweep was asked to stop)."""
        with contextlib.suppress(RuntimeError, OSError):  # its store is gone: so is the job
            self.control.request_stop()

    def run(self) -> TrialResult:
        number = self.trial.number
        tags = {TAG_SWEEP: self.plan.sweep.name, TAG_TRIAL: str(number)}
        request = child_request(
            self.plan.root, self.cfg, self.folder, self.parent_id, f"trial-{number}", tags
        )
        watcher = threading.Thread(target=self._watch, name=f"sweep-watch-{number}", daemon=True)
        watcher.start()
        final, error = None, None
        try:
            final = run_job(request, self.control).final
        except (Preempted, TrainingFailed, ConfigError, DataError) as exc:
            error = exc  # the trial's own end; anything else stops the sweep
        finally:
            self.done.set()
            watcher.join()
        result = self._result(final, error)
        if result.run_id is not None:
            self._tag_run(result)
        return result

    # --- the watcher ------------------------------------------------------------------

    def _watch(self) -> None:
        offset = 0
        while True:
            finished = self.done.is_set()  # read once more after the job ended
            if self.job_dir.journal.is_file():
                records, offset = read_journal(self.job_dir.journal, offset)
                self._take(records, finished)
            if finished:
                return
            self.done.wait(POLL_S)

    def _take(self, records: list[dict[str, Any]], finished: bool) -> None:
        metric = self.plan.metric
        for record in records:
            if record["kind"] == "series":
                self.steps = max(self.steps, record["first"] + len(record["values"]) - 1)
            if record["kind"] != "metrics" or record.get("replace"):
                continue
            step = record["step"]
            self.steps = max(self.steps, step)
            value = record["values"].get(metric)
            # A step recomputed after a resume keeps its first value, as MLflow does; a
            # pruned trial's record ends where the pruner stopped it (as in Optuna's own
            # loop), though its job trains on to its next control step.
            if value is None or step in self.reported or self.pruned_at is not None:
                continue
            self.reported[step] = float(value)
            self.trial.report(float(value), step)
            if not finished and self.trial.should_prune():
                self.pruned_at = step
                self.say(
                    f"sweep: trial {self.trial.number} pruned at step {step} "
                    f"({metric} {value:.4g}); stopping its job"
                )
                self.stop()

    # --- the outcome ------------------------------------------------------------------

    def _result(self, final: dict[str, Any] | None, error: BaseException | None) -> TrialResult:
        planned = planned_steps(self.cfg, Project(self.plan.root).shards)
        run_id = self._run_id()
        last = self.reported[max(self.reported)] if self.reported else None
        if isinstance(error, Preempted):
            state = "pruned" if self.pruned_at is not None else "interrupted"
            return TrialResult(state, last, self.steps, planned, run_id, str(error))
        if error is not None:
            return TrialResult("failed", None, self.steps, planned, run_id, str(error))
        steps = int((final or {}).get("step", self.steps))
        value = self._selected_value(final or {}, last)
        if value is None or not math.isfinite(float(value)):
            seen = sorted(k for k in (final or {}) if k.startswith("val_"))
            message = (
                f"the job recorded no finite {self.plan.metric} (its validation metrics: "
                f"{', '.join(seen) or 'none'}); set sweep.metric to one of them"
            )
            return TrialResult("failed", None, steps, planned, run_id, message)
        return TrialResult("complete", float(value), steps, planned, run_id)

    def _selected_value(self, final: dict[str, Any], last: float | None) -> float | None:
        """The metric of the model the trial would register: at the step train.select
        chose (the best validation's, by default), else at the last step."""
        selected = final.get("selected_step")
        if selected != final.get("step") and selected in self.reported:
            return self.reported[selected]
        return final.get(self.plan.metric, last)

    def _run_id(self) -> str | None:
        run_file = self.job_dir.run_file
        return json.loads(run_file.read_text())["run_id"] if run_file.is_file() else None

    def _tag_run(self, result: TrialResult) -> None:
        from mlflow.entities import RunTag  # deferred: mlflow is imported lazily in training/

        tags = {
            TAG_SWEEP: self.plan.sweep.name,
            TAG_TRIAL: str(self.trial.number),
            TAG_STATE: result.state,
            TAG_STEPS: str(result.steps),
        }
        if (resumes := self.trial.user_attrs.get(RESUMES)) is not None:
            tags[TAG_RESUMES] = str(resumes)  # the interrupted trial whose run this goes on
        mlflow_client = client(Project(self.plan.root).tracking_uri)
        mlflow_client.log_batch(result.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        if result.state == "failed":  # a failed check before training leaves it RUNNING
            mlflow_client.set_terminated(result.run_id, status="FAILED")
