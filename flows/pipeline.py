"""The pipeline as a Prefect flow; its body reads like the data flow in the docs.

params -> (nothing changed? push, skip) -> ingest -> drift -> push data -> shard -> [device quota]
train -> evaluate -> push -> register -> summary. On failure the summary names the step
and the cause. A model version is registered only once everything it was made from
(data, shards, model) is on the DVC remote, so any clone can `dvc pull` it.
With `orchestrate.train_pool` set, train runs on that Prefect work pool instead (the
GPU machine's own quota), and its outputs come back through the DVC remote.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Completed

from flows.stage_host import stage_host
from flows.train_pool import check_train_pool, train_on_pool
from tasks.drift import check_drift
from tasks.dvc_stages import push_all, push_data, run_stage, stale_stages
from tasks.notify import notify_champion, notify_failure
from tasks.quota import check_quota, device_slots
from tasks.registry import (
    RunSummary,
    find_up_to_date_run,
    prepare_registration,
    publish_failure,
    publish_summary,
    register_model,
)
from tasks.warm_imports import wait_for_background_imports
from tasks.watchdog import ensure_watchdogs
from training.config import Config, load_config, write_overrides
from training.engine.signing import job_secret
from training.errors import GradlineError
from training.lock import project_lock
from training.project import Project, find_project_root
from training.timings import StepClock, record_timing


@task(name="apply-params", task_run_name="apply-params")
def apply_params(root: str, overrides: list[str]) -> Config:
    """Validate params.yaml + overrides and record the overrides in params.yaml. A job
    the device quota can never run, or a train pool with no train deployment, is refused
    here, before anything is written."""
    params = Project(Path(root)).params
    cfg = load_config(params, overrides)
    if cfg.runtime.node_range[1] > 1:  # every node needs the job's secret: say so now
        job_secret(multi_node=True)
    if cfg.orchestrate.train_pool:  # the pool's machine checks its own device quota
        check_train_pool(cfg.orchestrate.train_pool)
    else:
        check_quota(cfg)
    # The server marks this run Crashed if it dies without a word, and alerts on it.
    ensure_watchdogs(cfg.orchestrate.notify)
    return write_overrides(params, overrides)


@flow(name="gradline")
def pipeline(
    overrides: list[str] | None = None,
    force: bool = False,
    root: str | None = None,
    accept_drift: bool = False,
) -> RunSummary:
    """Run the stages DVC finds stale, train under the device quota, register, summarize.

    overrides: params.yaml values as `section.key=value`, validated like `gradline run --set`.
    force: run every stage even when data, params and code are unchanged.
    accept_drift: train on new data that drifted from the champion's although
    orchestrate.drift is block (remembered for this data version).
    """
    root = str(Path(root).resolve()) if root else str(find_project_root())
    try:
        # One writer per project: a second run (a deployment's, a terminal's) waits here.
        # The stages fork from a host that imported torch and MLflow once (unless the
        # command that started this flow already started one).
        with project_lock(Path(root), say=get_run_logger().info), stage_host():
            return _run_steps(root, list(overrides or []), force, accept_drift)
    except (TerminationSignal, KeyboardInterrupt) as stop:
        # A signal or a cancel from Prefect: the running stage was stopped with it
        # (training saved a checkpoint), so this run is cancelled, not crashed.
        message = f"stopped ({type(stop).__name__}); run again to resume where it stopped"
        get_run_logger().warning(message)
        return Cancelled(message=message)


def _run_steps(root: str, overrides: list[str], force: bool, accept_drift: bool) -> RunSummary:
    record_timing(what="flow_began")
    step = StepClock("params")
    try:
        cfg = apply_params(root, overrides)
        if not force:
            step.at("check-up-to-date")
            if latest := find_up_to_date_run(root, cfg):
                # Registered implies pushed, but the remote may have changed since (a new
                # URL, a store wiped): a push that finds it all there costs under a second.
                step.at("push")
                push_all(root)
                publish_summary(latest)
                step.at("done")
                return Completed(name="Skipped", message=latest.headline, data=latest)
        step.at("ingest")
        prepare_registration()  # and MLflow, for registration
        run_stage(cfg, root, "ingest", force)
        step.at("drift")  # new data against the champion's: warn, or stop before training
        check_drift(root, cfg, accept_drift)
        step.at("push-data")
        push_data(root)
        step.at("shard")
        run_stage(cfg, root, "shard", force)
        step.at("train")
        # What the flow imports in the background ends before training, not during it: a
        # thread of this process taking a core from a worker slows every rank's steps.
        wait_for_background_imports()
        # Devices are held only when training will run: DVC skips an up-to-date stage.
        will_train = force or stale_stages(Path(root), "train")
        if will_train and cfg.orchestrate.train_pool:
            train_on_pool(cfg, root, force)
        else:
            with device_slots(cfg) if will_train else contextlib.nullcontext():
                run_stage(cfg, root, "train", force)
        step.at("evaluate")
        run_stage(cfg, root, "evaluate", force)
        step.at("push")  # every output on the remote before a version points at them
        push_all(root)
        step.at("register")
        summary = register_model(root, cfg)
    except Exception as exc:
        publish_failure(step.current, exc)
        if notify := _notify_target(root):
            notify_failure(notify, root, step.current, exc)
        raise
    step.at("summary")
    publish_summary(summary)
    if cfg.orchestrate.notify and "champion" in summary.alias.split(","):
        notify_champion(cfg.orchestrate.notify, root, summary)
    step.at("done")
    return summary


def _notify_target(root: str) -> str:
    """orchestrate.notify as params.yaml holds it (with the run's overrides once they are
    written); empty when even params.yaml cannot be read: nowhere to send to."""
    try:
        return Project(Path(root)).config().orchestrate.notify
    except GradlineError:
        return ""
