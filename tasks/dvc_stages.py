"""Tasks that drive DVC: each stage runs through `dvc repro`, so dvc.lock records it.

A stage's output streams into the task's log as it runs (plain lines in the Prefect UI;
on a terminal, the stage's own progress bars go straight to it). When a stage fails,
`gradline stage` leaves a small error record naming the exception and its exit code, so
the task knows whether a retry can help without parsing DVC's messages. `run_dvc` runs
the stages and the data transfers; outside a flow (`gradline compare-updates`)
their output goes to stderr instead of a task log. `dvc_output` runs the quick ones whose
output is read (`status --json`, a `pull`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml
from prefect import get_run_logger, task
from prefect.runtime import flow_run

from training.atomic import atomic_file
from training.config import Config
from training.config.loading import safe_load
from training.errors import (
    ERROR_FILE_ENV,
    PREEMPTED_EXIT_CODE,
    GradlineError,
    is_retryable,
    is_retryable_exit,
)
from training.host_client import HostedProcess, start_in_host
from training.mlops.dvc_cli import DvcCommandFailed, dvc_process, dvc_status
from training.mlops.remote import failed_files, push_failed
from training.mlops.tracking import FLOW_RUN_ENV
from training.mlops.versioning import data_version
from training.tempdirs import owned_temporary_directory
from training.timings import timed_span

# DVC's hints about git and pushing: the flow acts on them itself.
_HINTS = ("git add", "To track the changes", "To enable auto staging", "autostage", "dvc push")


class StageFailed(GradlineError):
    """A DVC command failed; `retryable` says whether running it again can help.
    `output`: the end of what the command printed."""

    def __init__(
        self, message: str, exit_code: int | None, retryable: bool, output: str = ""
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code if exit_code is not None else 1
        self.retryable = retryable
        self.output = output


def _env(record_as: str = "") -> dict[str, str]:
    env = dict(os.environ)
    # Stage commands call `gradline`: find it beside this interpreter even if the
    # virtual environment is not activated.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    # A stage run on a work pool for another flow run is recorded as that flow run's.
    if run_id := record_as or flow_run.id:
        env[FLOW_RUN_ENV] = str(run_id)
    return env


def dvc_output(root: Path, *args: str) -> str:
    """Run a quick DVC command and return its stdout (for `status --json` and the like)."""
    proc = dvc_process(root, *args, env=_env())
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise StageFailed(
            f"`dvc {' '.join(args)}` failed ({proc.returncode}):\n{err[-4000:]}",
            proc.returncode,
            retryable=True,
        )
    return out


def _stage_failure(command: str, code: int, record_file: Path, tail: str) -> StageFailed:
    if record_file.is_file():
        record = json.loads(record_file.read_text())
        return StageFailed(
            f"`{command}` failed: {record['type']}: {record['message']}",
            record["exit_code"],
            is_retryable_exit(record["exit_code"]),
        )
    # No record: the stage crashed outside gradline's handling, or DVC itself failed.
    return StageFailed(f"`{command}` failed ({code}):\n{tail}", code, True, output=tail)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_dvc(
    root: Path,
    *args: str,
    record_as: str = "",
    echo: Callable[[str], None] | None = None,
    keep_stderr: bool = False,
) -> str:
    """Run a DVC command, streaming its output into the task log (or to `echo`: outside a
    flow, stderr); return that output. record_as: the flow run the stage's MLflow run is
    tagged with (default: this one). keep_stderr: read stderr even on a terminal (a
    failed push is classified from DVC's error lines)."""
    # On a terminal the stage's stderr (progress bars, errors) goes straight to it.
    stderr = None if sys.stderr.isatty() and not keep_stderr else subprocess.STDOUT

    def start(env: dict[str, str]) -> subprocess.Popen | HostedProcess:
        return dvc_process(root, *args, env=env, stdout=subprocess.PIPE, stderr=stderr)

    return _run_streamed(start, f"dvc {' '.join(args)}", _env(record_as), echo)


def run_hosted_stage(root: Path, *args: str, echo: Callable[[str], None] | None = None) -> str:
    """`gradline stage args` forked from the flow's stage host, which has imported what
    the stage needs (MLflow, torch) so that this process does not; streamed and failing as
    `run_dvc` does. HostRefused when no host runs it: the caller runs the step itself."""

    def start(env: dict[str, str]) -> HostedProcess:
        return start_in_host(
            ["stage", *args],
            cwd=str(root),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    return _run_streamed(start, f"gradline stage {args[0]}", _env(), echo)  # named, no paths


def _run_streamed(
    start: Callable[[dict[str, str]], subprocess.Popen | HostedProcess],
    command: str,
    env: dict[str, str],
    echo: Callable[[str], None] | None,
) -> str:
    """Run what `start(env)` starts, its output streamed to `echo` (default: the task's
    log); its output, or StageFailed with the error record the stage left."""
    echo = echo or get_run_logger().info
    tail: deque[str] = deque(maxlen=60)
    with owned_temporary_directory("gradline-stage-") as tmp:
        record_file = Path(tmp) / "error.json"
        env[ERROR_FILE_ENV] = str(record_file)
        with start(env) as proc:
            assert proc.stdout is not None
            try:
                _stream(proc.stdout, tail, echo)
            except BaseException:  # a stop (a signal, a cancel): the stage tree goes too
                stop_stage(proc, tail, echo)
                raise
        if proc.returncode != 0:
            raise _stage_failure(command, proc.returncode, record_file, "\n".join(tail))
    return "\n".join(tail)


def _stream(stdout, tail: deque[str], echo: Callable[[str], None]) -> None:
    for raw in stdout:
        line = raw.rstrip()
        tail.append(line)
        if line and not any(h in line for h in _HINTS):
            echo(line)


def stop_stage(
    proc: subprocess.Popen | HostedProcess,
    tail: deque[str],
    echo: Callable[[str], None],
    grace_s: float = 90,
) -> None:
    """Stop a running `dvc repro` and everything under it within `grace_s`.

    Its `gradline stage` process gets SIGTERM: training takes its exit-75 path
    (checkpoint, then exit) and the other stages end at once. Their output keeps
    streaming meanwhile (a full pipe would block them); after `grace_s`, or when dvc has
    ended, whatever is left of the tree is killed.
    """
    try:
        dvc = psutil.Process(proc.pid)
        tree = [dvc, *dvc.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    stages = _outermost_stages(tree)
    for target in stages or tree[:1]:  # no stage started yet: stop dvc itself
        with contextlib.suppress(psutil.Error):
            target.terminate()
    deadline = threading.Timer(grace_s, _kill, (tree,))
    deadline.start()
    try:
        _stream(proc.stdout, tail, echo)
        proc.wait()
    finally:
        deadline.cancel()
        _kill(tree)


def _outermost_stages(tree: list[psutil.Process]) -> list[psutil.Process]:
    """The `gradline stage` processes of the tree that no other one started. A stage
    started without the stage host forks its workers' server, and so its workers, from
    itself (training/engine/worker_start.py); the server writes a command line of its
    own over the stage's, where it can (Linux). Where it cannot, they would match too:
    the stop request goes to the stage, which stops them at a checkpoint."""
    stages = [p for p in tree if _is_stage(p)]
    pids = {p.pid for p in stages}
    return [p for p in stages if _parent_pid(p) not in pids]


def _parent_pid(process: psutil.Process) -> int | None:
    with contextlib.suppress(psutil.Error):
        return process.ppid()
    return None


def _is_stage(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        cmdline = process.cmdline()
        return "stage" in cmdline and any(Path(a).name == "gradline" for a in cmdline)
    return False


def _kill(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):  # psutil refuses a pid reused since
            process.kill()


class RetryBudget:
    """A stage's retries, two budgets as Ray Train keeps them: preemptions (exit 75: the
    job saved and stopped, as on a spot reclaim) are expected and many; crashes few. Bad
    input and a full disk get none: the same run would fail the same way."""

    def __init__(self, crashes: int, preemptions: int) -> None:
        self.left = {"crash": crashes, "preemption": preemptions}

    @property
    def most(self) -> int:
        return sum(self.left.values())

    def spend(self, state) -> bool:
        """Spend one retry of the failed state's kind, if any is left."""
        kind = failure_kind(state.result(raise_on_failure=False))
        if kind is None or self.left[kind] == 0:
            return False
        self.left[kind] -= 1
        return True

    @property
    def condition(self):
        """Prefect's retry condition. A plain function: Prefect treats any other callable
        (a bound method too) as "never retry"."""

        def retry_if_budget_left(task, task_run, state) -> bool:
            return self.spend(state)

        return retry_if_budget_left


def failure_kind(exc: BaseException) -> str | None:
    """ "preemption", "crash", or None when no retry can help."""
    if not is_retryable(exc):
        return None
    if getattr(exc, "exit_code", None) == PREEMPTED_EXIT_CODE:
        return "preemption"
    return "crash"


@task(name="dvc-repro", task_run_name="dvc-repro")
def reproduce_stage(root: str, stage: str, force: bool = False, record_as: str = "") -> bool:
    """Run one stage if DVC finds it stale (or always, forced); True when it ran."""
    args = ["repro", "--single-item", stage]
    if force:
        args.append("--force")
    output = run_dvc(Path(root), *args, record_as=record_as)
    return "didn't change, skipping" not in output


def run_stage(cfg: Config, root: str, name: str, force: bool, record_as: str = "") -> bool:
    """The stage as a task named after it, retried on crashes and preemptions, each within
    its own budget (never on bad input or a full disk)."""
    budget = RetryBudget(cfg.orchestrate.stage_retries, cfg.orchestrate.preemption_retries)
    stage = reproduce_stage.with_options(
        name=name,
        task_run_name=name,
        retries=budget.most,
        retry_delay_seconds=cfg.orchestrate.retry_delay_s,
        retry_condition_fn=budget.condition,
    )
    with timed_span("stage_wall", stage=name):
        return stage(root, name, force, record_as)


def retry_unless_lasting(task, task_run, state) -> bool:
    """Prefect's retry condition for pushes: a dropped connection may pass next time, a
    full, missing or forbidden remote will not (a plain function: see RetryBudget)."""
    return is_retryable(state.result(raise_on_failure=False))


# Each push task: two retries, for what a retry can fix.
PUSH_RETRIES = dict(retries=2, retry_delay_seconds=2, retry_condition_fn=retry_unless_lasting)


def push_to_remote(root: Path, *targets: str, echo: Callable[[str], None] | None = None) -> None:
    """`dvc push` of the targets' cached outputs (every stage's when none) to the default
    remote; a failure is a RemotePushFailed naming the remote, the cause and the fix.
    `echo`: where DVC's output goes (default: the task's log)."""
    try:
        run_dvc(root, "push", *targets, keep_stderr=True, echo=echo)
    except StageFailed as failed:
        remote, url = default_remote(root)
        # DVC counts the files that failed; when it stopped at the first error, ask it.
        missing = failed_files(failed.output)
        if missing is None:
            missing = _count_missing(root, targets)
        raise push_failed(remote, url, failed.output, failed.exit_code, missing) from None


def default_remote(root: Path) -> tuple[str, str]:
    """(name, URL) of the project's default DVC remote, as all config levels merge them
    (a --local URL wins); ("", "") when there is none."""
    # `dvc config` reads the merged levels; `dvc remote list` wraps long URLs.
    name = dvc_output(root, "remote", "default").strip()
    if not name:
        return "", ""
    return name, dvc_output(root, "config", f"remote.{name}.url").strip()


def _count_missing(root: Path, targets: tuple[str, ...]) -> int | None:
    """How many cached outputs the remote lacks (`dvc status --cloud`), when it can be
    asked at all (a remote that failed the push may fail this too)."""
    try:
        return len(json.loads(dvc_output(root, "status", "--cloud", "--json", *targets) or "{}"))
    except (StageFailed, json.JSONDecodeError):
        return None


@task(
    name="dvc-push-data",
    task_run_name="dvc-push-data",
    **PUSH_RETRIES,
)
def push_data(root: str) -> str:
    """Push the ingested snapshot to the DVC remote; return its data version (md5)."""
    push_to_remote(Path(root), "ingest")
    return data_version(Path(root))


@task(
    name="dvc-push",
    task_run_name="dvc-push-{stage}",
    **PUSH_RETRIES,
)
def push_outputs(root: str, stage: str) -> None:
    """Push a stage's cached outputs (as dvc.lock records them) to the DVC remote."""
    push_to_remote(Path(root), stage)


@task(
    name="push",
    task_run_name="push",
    **PUSH_RETRIES,
)
def push_all(root: str) -> None:
    """Push every cached output dvc.lock records (data, shards, model) to the default
    remote. The flow registers a model version only after this: a version whose files
    are not on the remote could not be pulled anywhere else."""
    push_to_remote(Path(root))


@task(name="dvc-pull", task_run_name="dvc-pull-{stage}", retries=2, retry_delay_seconds=2)
def pull_outputs(root: str, stage: str) -> None:
    """Fetch a stage's outputs (as dvc.lock records them) from the DVC remote, check out."""
    run_dvc(Path(root), "pull", stage)


def lock_entry(root: Path, stage: str) -> dict[str, Any]:
    """The stage's entry in dvc.lock: the hashes of its deps, params and outputs."""
    lock = root / "dvc.lock"
    stages = (safe_load(lock.read_text()) or {}).get("stages", {}) if lock.is_file() else {}
    if stage not in stages:
        raise StageFailed(f"{lock} has no entry for stage {stage!r}: it never ran here", 1, False)
    return stages[stage]


def write_lock_entry(root: Path, stage: str, entry: dict[str, Any]) -> None:
    """Record a stage run elsewhere in this checkout's dvc.lock, as `dvc repro` would."""
    lock = root / "dvc.lock"
    document = (safe_load(lock.read_text()) if lock.is_file() else None) or {}
    document.setdefault("schema", "2.0")
    document.setdefault("stages", {})[stage] = entry
    with atomic_file(lock, "w") as handle:
        yaml.safe_dump(document, handle, sort_keys=False)


def reproduce_shards(root: Path) -> None:
    """`dvc repro shard` (ingest first if stale) outside a flow, its output on stderr
    (stdout is the caller's): data/shards as params.yaml makes it."""
    run_dvc(root, "repro", "shard", echo=_to_stderr)


def stale_stages(root: Path, *targets: str) -> dict:
    """training.mlops.dvc_cli.dvc_status, failing as a (retryable) stage failure."""
    try:
        return dvc_status(root, *targets)
    except DvcCommandFailed as exc:
        raise StageFailed(str(exc), exc.exit_code, retryable=True) from exc
