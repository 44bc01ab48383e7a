"""`gradline sweep`: trials of one Optuna study, each a child run of one parent run.

The driver runs in one process: its main thread owns the signals and waits, and up to
`plan.at_once` trial threads each ask the study for a trial, train it (training.mlops.
sweep.trial) and tell the study how it ended, until the budget is spent (sweep.trials
trials, sweep.wall_time_s seconds, both counted across runs of the sweep). Trials pay
the job's own start-up (workers, tracking helper) but not the pipeline's: the data is
brought up to date once, before the sweep (the CLI runs `dvc repro shard`), and every
trial reads the same shards, so every child run carries the same data version.

A stop (SIGINT or SIGTERM; under `gradline sweep` the supervisor turns Ctrl-C into a
SIGTERM) asks every running trial's job to stop at its next control step: each saves a
checkpoint and exits, its trial ends as interrupted (FAIL in Optuna, KILLED in MLflow),
and running the sweep again trains it on from that checkpoint in the same run.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from training.data.manifest import read_manifest
from training.engine.launch import Preempted
from training.errors import PREEMPTED_EXIT_CODE, ConfigError, GradlineError
from training.mlops.children import end_parent, open_parent, shared_params
from training.mlops.lineage import compare_url, run_url, ui_base
from training.mlops.runs import log_runtime
from training.mlops.sweep.plan import SweepPlan, space_json, trial_config
from training.mlops.sweep.report import (
    ARTIFACTS,
    MESSAGE,
    PLANNED,
    PLOTS,
    RUN_ID,
    STEPS,
    TABLE_CSV,
    TABLE_MD,
    Totals,
    table_text,
    totals,
    write_report,
)
from training.mlops.sweep.study import (
    FOLDER,
    PARENT_RUN,
    SECONDS,
    best_trial,
    counted,
    distributions,
    folder_name,
    mark_interrupted,
    open_study,
    recover,
)
from training.mlops.sweep.trial import TrialJob, TrialResult
from training.mlops.tracking import client
from training.project import Project

TAG_SWEEP = "gradline.sweep.name"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
MAX_INVALID_IN_A_ROW = 10  # drawn configs that do not validate before the sweep gives up


class SweepInterrupted(GradlineError):
    """A stop request ended the sweep; its interrupted trials resume on the next run."""

    exit_code = PREEMPTED_EXIT_CODE
    retryable = True


@dataclass(frozen=True)
class SweepReport:
    plan: SweepPlan
    parent_id: str
    run_url: str
    compare_url: str  # the parent beside its trials in the UI's compare view
    rows: list[dict[str, Any]]
    best: dict[str, Any] | None  # the best complete trial's row
    budget_left: str  # "" when the budget is spent

    @property
    def totals(self) -> Totals:
        return totals(self.rows)

    @property
    def artifacts(self) -> list[str]:
        names = [TABLE_CSV, TABLE_MD, *PLOTS.values()]
        return [name for name in names if (self.plan.folder / name).is_file()]

    def describe(self) -> str:
        plan, total = self.plan, self.totals
        best = "no complete trial yet"
        if self.best is not None:
            keys = ", ".join(f"{k}={self.best[k]!r}" for k in plan.space)
            best = (
                f"trial {self.best['trial']}: {plan.metric} {self.best[plan.metric]:.4g} ({keys})"
            )
        state = f"budget left: {self.budget_left}" if self.budget_left else "budget spent"
        return (
            f"gradline sweep {plan.sweep.name!r}: {total.trials} trials ({total.complete} "
            f"complete, {total.pruned} pruned, {total.failed} failed); {state}\n"
            f"{table_text(self.rows)}\n"
            f"  best           {best}\n"
            f"  pruning        {total.steps_run} of {total.steps_planned} planned trial-steps "
            f"run ({total.pruning_saved:.0%} saved)\n"
            f"  MLflow run     {self.parent_id} (the parent of every trial's run)\n"
            f"                 {self.run_url}\n"
            f"  side by side   {self.compare_url}\n"
            f"  artifacts      {ARTIFACTS}/{', '.join(self.artifacts)}\n"
            f"  study          {plan.folder / 'optuna.db'} (run `gradline sweep` again to go on)\n"
            f"  next           gradline sweep --apply  (the best trial's keys into params.yaml)"
        )


class Driver:
    """The trial threads of one run of the sweep, and what they share."""

    def __init__(
        self,
        plan: SweepPlan,
        study: optuna.Study,
        parent_id: str,
        data_version: str,
        say: Callable[[str], None],
    ) -> None:
        self.plan, self.study, self.parent_id = plan, study, parent_id
        self.data_version, self.say = data_version, say
        self.lock = threading.Lock()  # the study's budget and attributes, `running`
        self.stopping = threading.Event()
        self.running: dict[int, TrialJob] = {}
        self.errors: list[BaseException] = []
        self.interrupted: list[int] = []
        self.started = time.monotonic()
        self.spent_before = float(study.user_attrs.get(SECONDS, 0.0))

    # --- the budget ---------------------------------------------------------------------

    def seconds_spent(self) -> float:
        return self.spent_before + time.monotonic() - self.started

    def budget_left(self) -> str:
        """What is left of the budget, in words; "" when it is spent."""
        sweep, left = self.plan.sweep, []
        if sweep.trials is not None:
            trials = sweep.trials - counted(self.study)
            if trials <= 0:
                return ""
            left.append(f"{trials} trials")
        if sweep.wall_time_s is not None:
            seconds = sweep.wall_time_s - self.seconds_spent()
            if seconds <= 0:
                return ""
            left.append(f"{seconds:.0f} s")
        return ", ".join(left)

    # --- the trial threads --------------------------------------------------------------

    def stop(self, signum: int | None = None) -> None:
        if signum is not None and not self.stopping.is_set():
            self.say(
                f"sweep: {signal.Signals(signum).name}: stopping the running trials at their "
                "next control step (their checkpoints are kept)"
            )
        self.stopping.set()
        with self.lock:
            jobs = list(self.running.values())
        for job in jobs:
            job.stop()

    def _next(self) -> TrialJob | None:
        """The next trial and its job, or None when the budget is spent or a stop came.
        A drawn combination that does not validate fails as a trial of its own."""
        for _ in range(MAX_INVALID_IN_A_ROW):
            with self.lock:
                if self.stopping.is_set() or not self.budget_left():
                    return None
                trial = self.study.ask(distributions(self.plan))
                folder = trial.user_attrs.get(FOLDER) or folder_name(trial.number)
                trial.set_user_attr(FOLDER, folder)
                try:
                    cfg = trial_config(self.plan.base, trial.params)
                except ConfigError as exc:
                    self._tell(trial, TrialResult("failed", None, 0, 0, None, str(exc)))
                    self.say(f"sweep: trial {trial.number} failed: {exc}")
                    continue
                job = TrialJob(
                    self.plan, trial, cfg, self.plan.checkpoints / folder, self.parent_id,
                    self.data_version, self.say,
                )  # fmt: skip
                self.running[trial.number] = job
            self.say(f"sweep: trial {trial.number} starts: {_keys(trial.params)}")
            return job
        raise ConfigError(
            f"{MAX_INVALID_IN_A_ROW} trials in a row drew keys whose config does not "
            "validate (see the trials' messages above): narrow sweep.space"
        )

    def _worker(self) -> None:
        try:
            while (job := self._next()) is not None:
                if self.stopping.is_set():  # a stop came between the ask and the start
                    job.stop()
                result = job.run()
                with self.lock:
                    self.running.pop(job.trial.number, None)
                    self._tell(job.trial, result)
                self._say_result(job.trial.number, result)
        except BaseException as exc:  # a failure that is not the trial's: stop the sweep
            self.errors.append(exc)
            self.stop()

    def _tell(self, trial: optuna.Trial, result: TrialResult) -> None:
        attrs = {STEPS: result.steps, PLANNED: result.planned, RUN_ID: result.run_id or ""}
        if result.message:
            attrs[MESSAGE] = result.message[:2000]
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if result.state == "complete":
            self.study.tell(trial, result.value)
        elif result.state == "pruned":
            self.study.tell(trial, state=TrialState.PRUNED)
        else:
            if result.state == "interrupted":
                mark_interrupted(self.study, trial.number)
                self.interrupted.append(trial.number)
            self.study.tell(trial, state=TrialState.FAIL)
        self.study.set_user_attr(SECONDS, self.seconds_spent())

    def _say_result(self, number: int, result: TrialResult) -> None:
        value = "" if result.value is None else f", {self.plan.metric} {result.value:.4g}"
        detail = f": {result.message.splitlines()[0]}" if result.state == "failed" else ""
        self.say(
            f"sweep: trial {number} {result.state} after {result.steps} of "
            f"{result.planned} steps{value}{detail}"
        )

    def run(self) -> None:
        _quiet_thread_launch_warning()
        threads = [
            threading.Thread(target=self._worker, name=f"sweep-trials-{n}")
            for n in range(self.plan.at_once)
        ]
        with _signals_stop(self.stop):
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():  # short joins: the main thread takes the signals
                    thread.join(0.5)
        self.study.set_user_attr(SECONDS, self.seconds_spent())


def _keys(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v!r}" for k, v in params.items()
    )


def _quiet_thread_launch_warning() -> None:
    """torch's elastic agent warns that, started off the main thread, it cannot take the
    stop signals. Here the driver takes them and stops each job through its control
    store, and workers die with the driver's process (training.engine.worker): not a risk."""
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _ChildThreadWarning) for f in logger.filters):
        logger.addFilter(_ChildThreadWarning())


class _ChildThreadWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "running on a child thread" not in record.getMessage()


@contextlib.contextmanager
def _signals_stop(stop: Callable[[int], None]) -> Iterator[None]:
    """SIGINT and SIGTERM stop the sweep (the trials' jobs checkpoint first)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, lambda signum, _frame: stop(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _parent(plan: SweepPlan, study: optuna.Study, data_version: str) -> str:
    """The study's parent run: opened on the first run of the sweep, running again on
    every later one (a tracking store without it gets a new one)."""
    from mlflow.exceptions import MlflowException  # deferred: mlflow is optional here

    uri = Project(plan.root).tracking_uri
    mlflow_client = client(uri)
    if parent_id := study.user_attrs.get(PARENT_RUN):
        with contextlib.suppress(MlflowException):
            mlflow_client.get_run(parent_id)
            mlflow_client.update_run(parent_id, status="RUNNING")
            log_runtime(mlflow_client, parent_id, plan.base)  # this run's sweep settings
            return parent_id
    params = shared_params(plan.base, set(plan.space))
    params |= {
        "sweep.space": space_json(plan),
        "sweep.metric": plan.metric,
        "sweep.direction": plan.direction,
    }
    name = plan.sweep.name
    parent_id = open_parent(
        plan.root, plan.base, data_version, f"sweep-{name}", params, {TAG_SWEEP: name}
    )
    study.set_user_attr(PARENT_RUN, parent_id)
    return parent_id


def run_sweep(
    plan: SweepPlan, say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)
) -> SweepReport:
    """Run the sweep's trials on the project's current shards, up to its budget."""
    project = Project(plan.root)
    data_version = read_manifest(project.shards)["data_version"]
    study = open_study(plan, data_version)
    resumed = recover(study)
    parent_id = _parent(plan, study, data_version)
    uri = project.tracking_uri
    driver = Driver(plan, study, parent_id, data_version, say)
    say(
        f"sweep {plan.sweep.name!r}: parent MLflow run {parent_id}; {plan.at_once} trial(s) "
        f"at once ({plan.slots} device slots, {plan.base.runtime.procs_per_node} per trial); "
        f"budget left: {driver.budget_left() or 'none'}"
        + (f"; resuming interrupted trial(s) {resumed}" if resumed else "")
    )
    error: BaseException | None = None
    try:
        driver.run()
        if driver.errors:
            raise driver.errors[0]
        if driver.interrupted:
            error = Preempted("stopped on request")
    except BaseException as exc:
        error = exc
        raise
    finally:
        rows = write_report(uri, parent_id, plan, study)
        end_parent(uri, parent_id, error)
    best = best_trial(study)
    base = ui_base(uri, plan.base.orchestrate.mlflow_ui_url)
    experiment_id = client(uri).get_run(parent_id).info.experiment_id
    trial_runs = [row["run_id"] for row in rows if row.get("run_id")]
    report = SweepReport(
        plan=plan,
        parent_id=parent_id,
        run_url=run_url(base, experiment_id, parent_id),
        compare_url=compare_url(base, experiment_id, [parent_id, *trial_runs]),
        rows=rows,
        best=next((r for r in rows if best and r["trial"] == best.number), None),
        budget_left=driver.budget_left(),
    )
    if driver.interrupted:
        raise SweepInterrupted(
            f"sweep {plan.sweep.name!r} stopped on request; trial(s) "
            f"{', '.join(map(str, driver.interrupted))} interrupted with their checkpoints "
            f"kept. Run `gradline sweep` again to train them on and continue the study "
            f"({report.totals.trials} trials so far).\n{report.describe()}"
        )
    return report
