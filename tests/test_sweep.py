"""`gradline sweep`: the space checked before anything runs, the study's memory between
runs (fingerprint, budget, interrupted trials), `--apply`; and, end to end on digits,
trials as children of one parent with a bad trial pruned from its journal, `--apply`
then `gradline run` registering the best trial's keys, and a Ctrl-C that interrupts a
trial which the next run trains on in the same MLflow run."""

from __future__ import annotations

import csv
import io
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
import yaml
from optuna.trial import TrialState

from training.config import update_params_file
from training.errors import ConfigError
from training.mlops.sweep import apply_best, plan_sweep
from training.mlops.sweep.plan import trial_config
from training.mlops.sweep.report import totals, trial_rows, write_plots
from training.mlops.sweep.study import (
    FOLDER,
    INTERRUPTED,
    RESUMES,
    counted,
    distributions,
    open_study,
    recover,
)

from .conftest import REPO, _client, _env, _gradline, assert_drawn, copy_project


def _devices() -> int:
    return 2


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder with the repository's params.yaml: planning reads nothing else, and the
    study lands here, not in the checkout."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    return tmp_path


def _space(text: str) -> str:
    return f"sweep.space={{{text}}}"


# --- the plan: bad input named before anything runs --------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [_space("data.max_rows: {type: int, low: 10, high: 20}")],
            r"data\.max_rows decides the data",
        ),
        (["data.max_rows=10"], r"--set data\.max_rows=10: .*ingest/shard"),
        (
            [_space("runtime.log_every_steps: {type: int, low: 1, high: 9}")],
            r"does not change the model",
        ),
        (
            [_space("optim.lrr: {type: log, low: 0.1, high: 0.5}")],
            r"sweep\.space\.optim\.lrr: not a key.*optim\.lr,",
        ),
        (
            [_space("model.hidden: {type: log, low: 8, high: 64}")],
            r"model\.hidden is a whole number",
        ),
        (
            [_space("train.batch_size: {type: choice, choices: [64, 7]}")],
            r"(?s)train\.batch_size=7: .*multiple of",
        ),
        ([_space("optim.lr: {type: log, low: 0, high: 0.1}")], r"type log needs low above 0"),
        (
            [_space("optim.lr: {type: uniform, low: 0.1, high: 0.1}")],
            r"low \(0\.1\) must be below high",
        ),
        ([_space("model.hidden: {type: choice, choices: [64, 64]}")], r"name a value twice"),
        ([_space("model.hidden: {type: int, low: 8}")], r"takes `low` and `high`"),
        ([_space("lr: {type: log, low: 0.1, high: 0.5}")], r"not of the form section\.key"),
        (["sweep.space={}"], r"sweep\.space is empty"),
        (["sweep.trials=null"], r"a sweep needs a budget"),
        (["sweep.metric=accuracy"], r"start with val_"),
        (["sweep.metric=val_loss"], r"set sweep\.direction: maximize or minimize for val_loss"),
        (["runtime.procs_per_node=4"], r"needs 4 device slots but the quota has 2"),
        (
            ["runtime.nnodes=2", "runtime.rdzv_endpoint=10.0.0.1:29400", "runtime.rdzv_id=j"],
            r"runtime\.nnodes=2: a sweep runs its trials on this machine",
        ),
    ],
)
def test_bad_sweeps_are_refused_naming_the_key(project, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_sweep(project, overrides, _devices)
    assert not (project / "sweeps").exists()  # nothing written


def test_the_plan_reads_the_task_metric_and_the_quota(project) -> None:
    plan = plan_sweep(project, [], _devices)
    assert (plan.metric, plan.direction) == ("val_accuracy", "maximize")
    # Two slots (the devices here), two workers per trial: one trial at a time.
    assert (plan.slots, plan.at_once) == (2, 1)
    calls = []

    def count() -> int:
        calls.append(1)
        return 8

    plan = plan_sweep(project, ["runtime.procs_per_node=1"], count)
    assert (plan.slots, plan.at_once) == (8, 8) and calls == [1]
    plan = plan_sweep(project, ["runtime.procs_per_node=1", "sweep.max_parallel=3"], count)
    assert plan.at_once == 3
    # orchestrate.device_slots sizes the quota: the machine is not asked.
    plan = plan_sweep(project, ["orchestrate.device_slots=5", "runtime.procs_per_node=2"], count)
    assert (plan.slots, plan.at_once) == (5, 2) and calls == [1, 1]
    # The task's own metric and direction: regression minimizes val_rmse.
    update_params_file(
        project / "params.yaml", {"task": {"type": "regression"}, "data": {"source": "diabetes"}}
    )
    plan = plan_sweep(project, [], _devices)
    assert (plan.metric, plan.direction) == ("val_rmse", "minimize")
    plan = plan_sweep(project, ["sweep.metric=val_r2", "sweep.direction=maximize"], _devices)
    assert (plan.metric, plan.direction) == ("val_r2", "maximize")


def test_a_trial_config_is_params_yaml_with_its_keys_set(project) -> None:
    plan = plan_sweep(project, [], _devices)
    cfg = trial_config(plan.base, {"optim.lr": 0.0123, "model.hidden": 128})
    assert cfg.optim.lr == 0.0123 and cfg.model.options["hidden"] == 128
    assert cfg.train == plan.base.train
    with pytest.raises(ConfigError, match=r"train\.batch_size=3"):
        trial_config(plan.base, {"train.batch_size": 3})
    # 1e-5 is a number to every reader of params.yaml (YAML 1.2), in a list of choices too.
    plan = plan_sweep(
        project, [_space("optim.lr: {type: choice, choices: [1e-5, 2E-2]}")], _devices
    )
    assert plan.space["optim.lr"].choices == [1e-05, 0.02]
    assert all(type(c) is float for c in plan.space["optim.lr"].choices)


# --- the study between runs ---------------------------------------------------------------


def _tiny_plan(project: Path, *extra: str):
    space = _space(
        "optim.lr: {type: log, low: 0.001, high: 0.1}, model.hidden: {type: int, low: 8, high: 64}"
    )
    return plan_sweep(project, [space, "sweep.trials=3", *extra], _devices)  # fmt: skip


def test_a_study_continues_only_under_the_same_fingerprint(project) -> None:
    study = open_study(_tiny_plan(project), "md5-a")
    # params.yaml's own values (lr 0.005, hidden 256) are not all in the space: no
    # baseline trial; with hidden in range they are, and trial 0 trains them.
    assert not study.get_trials(states=(TrialState.WAITING,))
    again = open_study(_tiny_plan(project), "md5-a")
    assert again.user_attrs == study.user_attrs
    with pytest.raises(ConfigError, match=r"data version md5-a -> now md5-b.*set sweep\.name"):
        open_study(_tiny_plan(project), "md5-b")
    with pytest.raises(ConfigError, match=r"optim\.warmup_steps 20 -> now 5"):
        open_study(_tiny_plan(project, "optim.warmup_steps=5"), "md5-a")
    with pytest.raises(ConfigError, match=r"sweep\.space\.model\.hidden"):
        space = _space("optim.lr: {type: log, low: 0.001, high: 0.1}")
        open_study(plan_sweep(project, [space, "sweep.trials=3"], _devices), "md5-a")
    # Another name is another study; the budget is no part of the fingerprint.
    plan = _tiny_plan(project, "sweep.name=other", "model.hidden=32")
    other = open_study(plan, "md5-b")
    assert len(other.get_trials(states=(TrialState.WAITING,))) == 1
    baseline = other.ask(distributions(plan))
    assert baseline.params == {"optim.lr": 0.005, "model.hidden": 32}
    assert baseline.user_attrs["baseline"] is True
    open_study(_tiny_plan(project, "sweep.trials=10"), "md5-a")


def test_interrupted_trials_are_trained_again_and_not_counted_twice(project) -> None:
    plan = _tiny_plan(project)
    study = open_study(plan, "md5")
    done = study.ask(distributions(plan))
    study.tell(done, 0.5)
    killed = study.ask(distributions(plan))  # left RUNNING by a sweep killed outright
    killed.set_user_attr(FOLDER, "trial-0001")
    assert counted(study) == 2
    assert recover(study) == [1]
    assert study.user_attrs[INTERRUPTED] == [1]
    assert study.trials[1].state == TrialState.FAIL
    assert counted(study) == 1  # the interrupted one counts through its resume
    again = study.ask(distributions(plan))
    assert again.params == killed.params
    assert again.user_attrs[RESUMES] == 1 and again.user_attrs[FOLDER] == "trial-0001"
    assert counted(study) == 2
    study.tell(again, 0.7)
    assert recover(study) == []  # taken up once only
    assert counted(study) == 2


def test_the_report_counts_steps_and_draws_the_plots(project, tmp_path) -> None:
    plan = _tiny_plan(project)
    study = open_study(plan, "md5")
    for value, steps, state in ((0.9, 100, None), (0.7, 100, None), (0.1, 20, TrialState.PRUNED)):
        trial = study.ask(distributions(plan))
        trial.set_user_attr("steps", steps)
        trial.set_user_attr("planned_steps", 100)
        trial.report(value, 10)
        study.tell(trial, None if state else value, state=state)
    rows = trial_rows(study, plan)
    assert [r["state"] for r in rows] == ["complete", "complete", "pruned"]
    total = totals(rows)
    assert (total.steps_run, total.steps_planned) == (220, 300)
    assert total.pruning_saved == pytest.approx(80 / 300)
    paths = write_plots(study, tmp_path, plan.metric)
    assert [p.name for p in paths] == [
        "metric_by_trial.png", "param_importances.png", "parallel_coordinates.png"
    ]  # fmt: skip
    for path in paths:
        assert_drawn(path)


def test_apply_writes_the_best_keys_keeping_comments(project) -> None:
    with pytest.raises(ConfigError, match="no sweep named 'sweep'"):
        apply_best(project)
    plan = _tiny_plan(project)
    study = open_study(plan, "md5")
    with pytest.raises(ConfigError, match="no complete trial yet"):
        apply_best(project)
    for lr, hidden, value in ((0.01, 16, 0.8), (0.02, 48, 0.9), (0.05, 8, 0.85)):
        study.enqueue_trial({"optim.lr": lr, "model.hidden": hidden})
        study.tell(study.ask(distributions(plan)), value)
    before = (project / "params.yaml").read_text()
    message = apply_best(project)
    assert "trial 1, val_accuracy 0.9" in message and "optim.lr=0.02" in message
    after = (project / "params.yaml").read_text()
    params = yaml.safe_load(after)
    assert params["optim"]["lr"] == 0.02 and params["model"]["hidden"] == 48
    # Those two lines changed, nothing else; every comment is kept.
    lines = zip(before.splitlines(), after.splitlines(), strict=True)
    assert [b for a, b in lines if a != b] == ["  hidden: 48", "  lr: 0.02"]
    assert [x for x in before.splitlines() if "#" in x] == [
        x for x in after.splitlines() if "#" in x
    ]
    # params.yaml's other job keys now differ from the trials': said, not hidden.
    update_params_file(project / "params.yaml", {"train": {"epochs": 3}})
    assert "train.epochs: trials 30, params.yaml 3" in apply_best(project)


# --- end to end ---------------------------------------------------------------------------


def _study(root: Path, name: str = "sweep") -> optuna.Study:
    storage = f"sqlite:///{root / 'sweeps' / name / 'optuna.db'}"
    return optuna.load_study(study_name=name, storage=storage)


# Tiny digits jobs that still train long enough for a stop to land mid-job: 150 steps of
# 16 rows, validated every 10 steps, the stop checked every 2. One worker per trial.
TINY = {
    "data": {"max_rows": 300},
    "optim": {"lr": 0.0005},
    "model": {"hidden": 64},
    "train": {"max_steps": 150, "batch_size": 16},
    "runtime": {
        "procs_per_node": 1,
        "log_every_steps": 10,
        "eval_every_steps": 10,
        "control_every_steps": 2,
        "checkpoint_every_steps": 1000,
        "max_restarts": 0,
        "collective_timeout_s": 60,
    },
}


def _sweep_settings(**extra) -> dict:
    # Trial 0 trains params.yaml's own values (lr 0.0005, hidden 64); the random
    # sampler's seed 38 then draws lr 0.02 (better) and lr 1e-5 (hopeless: pruned at its
    # first validations, against the median of the complete trials).
    return {
        "space": {
            "optim.lr": {"type": "choice", "choices": [0.00001, 0.0005, 0.02]},
            "model.hidden": {"type": "choice", "choices": [32, 64]},
        },
        "sampler": "random",
        "seed": 38,
        "pruner": "median",
        "min_trials": 1,
        "warmup_steps": 0,
        "trials": 3,
        "max_parallel": 1,
        **extra,
    }


@pytest.mark.e2e
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_sweep_prunes_children_of_one_parent_and_apply_then_run_registers_the_best(tmp_path):
    project = copy_project(tmp_path / "gradline")
    update_params_file(project / "params.yaml", {**TINY, "sweep": _sweep_settings()})
    proc = _gradline(project, "sweep")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gradline sweep 'sweep': 3 trials" in proc.stdout

    study = _study(project)
    trials = study.trials
    assert [t.params["optim.lr"] for t in trials] == [0.0005, 0.02, 0.00001], (
        "the seeded sampler drew other values than this test was designed for"
    )
    states = {t.params["optim.lr"]: t.state for t in trials}
    assert states[0.00001] == TrialState.PRUNED, proc.stderr[-3000:]
    assert states[0.0005] == states[0.02] == TrialState.COMPLETE
    bad = next(t for t in trials if t.state == TrialState.PRUNED)
    assert bad.user_attrs["steps"] < bad.user_attrs["planned_steps"] == 150
    best = study.best_trial
    assert best.params == {"optim.lr": 0.02, "model.hidden": 32}  # not params.yaml's

    client = _client(project)
    experiment = client.get_experiment_by_name("gradline")
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r is not parent]
    assert len(children) == 3 and parent.info.status == "FINISHED"
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    raw_md5 = next(o["md5"] for o in lock["stages"]["ingest"]["outs"] if o["path"] == "data/raw")
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["gradline.data_version"] == raw_md5  # the data, once
    by_run = {c.info.run_id: c for c in children}
    pruned = by_run[bad.user_attrs["run_id"]]
    assert pruned.info.status == "KILLED"
    assert pruned.data.tags["gradline.sweep.state"] == "pruned"
    assert pruned.data.params["optim.lr"] == "1e-05"
    winner = by_run[best.user_attrs["run_id"]]
    assert winner.info.status == "FINISHED"
    assert winner.data.metrics["val_accuracy"] == pytest.approx(best.value)
    # The parent: the best trial, the table and the plots.
    assert parent.data.metrics["best_val_accuracy"] == pytest.approx(best.value)
    assert parent.data.tags["gradline.sweep.best.optim.lr"] == "0.02"
    assert parent.data.metrics["trials_pruned"] == 1
    table = client.download_artifacts(parent.info.run_id, "sweep/trials.csv", str(tmp_path))
    rows = list(csv.DictReader(io.StringIO(Path(table).read_text())))
    assert [r["state"] for r in rows] == ["complete", "complete", "pruned"]
    assert [r["run_id"] for r in rows] == [t.user_attrs["run_id"] for t in trials]
    for name in ("metric_by_trial", "param_importances", "parallel_coordinates"):
        png = client.download_artifacts(parent.info.run_id, f"sweep/{name}.png", str(tmp_path))
        assert_drawn(Path(png))
    assert not (project / "model").exists() and not client.search_registered_models()

    # Again: the budget is spent, nothing trains.
    again = _gradline(project, "sweep")
    assert again.returncode == 0 and "budget spent" in again.stdout
    assert len(_study(project).trials) == 3

    applied = _gradline(project, "sweep", "--apply")
    assert applied.returncode == 0, applied.stderr
    params = yaml.safe_load((project / "params.yaml").read_text())
    assert (params["optim"]["lr"], params["model"]["hidden"]) == (0.02, 32)
    run = _gradline(project, "run")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run_id = yaml.safe_load((project / "result.json").read_text())["run_id"]
    (version,) = client.search_model_versions(f"name='gradline-digits' and run_id='{run_id}'")
    registered = client.get_run(version.run_id)
    for key in best.params:
        assert registered.data.params[key] == winner.data.params[key], key
    assert registered.data.tags["gradline.data_version"] == raw_md5


@pytest.mark.e2e
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_ctrl_c_interrupts_a_trial_and_the_next_run_trains_it_on(tmp_path):
    project = copy_project(tmp_path / "gradline")
    tiny = {**TINY, "train": {"max_steps": None, "batch_size": 16}}  # 30 epochs: 390 steps
    update_params_file(project / "params.yaml", {**tiny, "sweep": _sweep_settings(trials=1)})
    command = [str(Path(sys.executable).parent / "gradline"), "sweep"]
    sweep = subprocess.Popen(
        command, cwd=project, env=_env(project), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 300
    journals = project / "checkpoints" / "sweeps" / "sweep" / "trial-0000"
    while time.monotonic() < deadline and sweep.poll() is None:
        found = list(journals.glob("*/tracking.jsonl"))
        if found and '"val_accuracy"' in found[0].read_text():
            break
        time.sleep(0.2)
    assert sweep.poll() is None, sweep.communicate()[1][-3000:]
    sweep.send_signal(signal.SIGINT)  # Ctrl-C reaches the supervisor
    _, err = sweep.communicate(timeout=240)
    assert sweep.returncode == 128 + signal.SIGINT, err.decode()[-3000:]
    assert "interrupted with their checkpoints kept" in err.decode()

    # Nothing of the sweep is left running.
    def left() -> list[psutil.Process]:
        procs = []
        for proc in psutil.process_iter(["cwd", "status"]):
            if proc.info["cwd"] == str(project) and proc.info["status"] != "zombie":
                procs.append(proc)
        return procs

    deadline = time.monotonic() + 60  # a loaded host reaps slowly; a leak stays for good
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), [p.cmdline() for p in left()]

    (trial,) = _study(project).trials
    assert trial.state == TrialState.FAIL
    assert _study(project).user_attrs["interrupted"] == [0]
    client = _client(project)
    run_id = trial.user_attrs["run_id"]
    stopped = client.get_run(run_id)
    assert stopped.info.status == "KILLED"
    assert stopped.data.tags["gradline.sweep.state"] == "interrupted"
    job = next(journals.glob("*/run.json")).parent
    assert list(job.glob("step-*")) and not (job / "COMPLETE").exists()  # checkpoint kept
    assert 0 < trial.user_attrs["steps"] < 390

    proc = _gradline(project, "sweep")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resuming interrupted trial(s) [0]" in proc.stderr
    _, second = _study(project).trials
    assert second.state == TrialState.COMPLETE and second.user_attrs["resumes"] == 0
    assert second.user_attrs["run_id"] == run_id  # the same MLflow run goes on
    assert second.user_attrs["steps"] == second.user_attrs["planned_steps"] == 390
    resumed = client.get_run(run_id)
    assert resumed.info.status == "FINISHED"
    assert resumed.data.tags["gradline.sweep.state"] == "complete"
    assert int(resumed.data.tags["gradline.resumed_from"]) > 0  # from its checkpoint
    (parent,) = client.search_runs(
        [resumed.info.experiment_id], "tags.mlflow.runName = 'sweep-sweep'"
    )
    assert parent.info.status == "FINISHED"
    assert resumed.data.tags["mlflow.parentRunId"] == parent.info.run_id
