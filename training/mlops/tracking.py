"""Experiment tracking: one MLflow run per job, and rank 0's tracker that journals to it.

The engine records through its `Tracker` seam (training.engine.tracker); `MlflowSink` is
the factory a job hands its workers so that rank 0's tracker journals to the job's run.
mlflow is imported inside functions: an optional dependency, so the engine runs where
mlflow is absent (tracking off) and importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from training.atomic import pid_alive, write_json
from training.errors import ConfigError, TrackingError, TrackingUnavailable
from training.mlops.store_template import new_sqlite_store, save_store_template, seed_store

log = logging.getLogger(__name__)

TAG_DATA_VERSION = "gradline.data_version"
TAG_FLOW_RUN = "gradline.prefect_flow_run_id"
TAG_JOB_KEY = "gradline.job_key"
TAG_TEST_DIGEST = "gradline.test_digest"
TAG_GIT_COMMIT = "mlflow.source.git.commit"
TAG_GIT_DIRTY = "gradline.git_dirty"
FLOW_RUN_ENV = "GRADLINE_PREFECT_FLOW_RUN_ID"
# The tracking helper's niceness, 0 to 19 (default 19: training first).
TRACKER_NICE_ENV = "GRADLINE_TRACKER_NICE"
# Checkpoint copies waiting to ship: enough for a helper that lags behind a busy host,
# bounded for a tracking server that stays down (each holds a pruned checkpoint's bytes).
PENDING_CHECKPOINTS = 10
# How long the end of a job waits for a tracking server that does not answer before it
# leaves the records in the journal (registration waits longer: orchestrate.tracking_wait_s).
END_OUTAGE_GRACE_S = 10.0


def redact_uri(uri: str) -> str:
    """`uri` without the user name and password it may carry (`http://user:pw@host` ->
    `http://host`): for anything printed or recorded. MLflow reads credentials from
    MLFLOW_TRACKING_USERNAME/PASSWORD too, but a URI with them in it also works, so every
    place that shows the tracking URI passes it through here."""
    parts = urllib.parse.urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def default_artifact_location(root: Path, tracking_uri: str) -> str | None:
    """Artifacts beside the local store; a remote server picks its own location."""
    if tracking_uri.startswith("sqlite:///") and "MLFLOW_TRACKING_URI" not in os.environ:
        return (root / "mlflow" / "artifacts").resolve().as_uri()
    return None


def git_commit(root: Path) -> tuple[str, bool] | None:
    """(commit, dirty) of the project checkout, or None outside git."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit, bool(status.strip())


@contextlib.contextmanager
def store_errors(tracking_uri: str):
    """Turn a failing tracking store (server down, wrong URI) into a message, not a trace."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        raise TrackingError(
            f"the MLflow tracking store at {redact_uri(tracking_uri)} failed: {exc.message}. "
            "Check MLFLOW_TRACKING_URI and that the server is running."
        ) from exc


# What MLflow's fluent API reads, and copies into os.environ for child processes.
FLUENT_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_ID")


@contextlib.contextmanager
def fluent_state_restored():
    """MLflow's process-wide URIs and their environment variables as they were before the
    block. `mlflow.set_tracking_uri` also writes MLFLOW_TRACKING_URI into os.environ, so a
    store set and left would leak into every later call of this process and into its
    children (another project's store, a server that has since stopped)."""
    saved = {name: os.environ.get(name) for name in FLUENT_VARIABLES}
    try:
        yield
    finally:
        mlflow = sys.modules.get("mlflow")  # never imported: nothing of it to put back
        if mlflow is not None:
            # None: back to resolving from the environment, restored next.
            mlflow.set_tracking_uri(None)
            mlflow.set_registry_uri(None)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def fluent_store(tracking_uri: str):
    """MLflow's fluent API (mlflow.log_*, Model.log, models:/ URIs) pointed at one store,
    registry included, for the block only."""
    import mlflow

    with fluent_state_restored():
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(tracking_uri)
        yield


DEFAULT_EXPERIMENT_ID = "0"  # MLflow's `Default`, which every store has


def client(tracking_uri: str):
    """A client of one store, registry included (never the process-wide registry URI,
    which another store may have set). A new SQLite store starts as a copy of the
    machine's template, or leaves one once MLflow has made it (mlops/store_template.py)."""
    from mlflow.tracking import MlflowClient

    new_store = new_sqlite_store(tracking_uri)
    made_here = new_store is not None and not seed_store(new_store)
    mlflow_client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    if made_here:
        mlflow_client.get_experiment(DEFAULT_EXPERIMENT_ID)  # MLflow makes the store now
        save_store_template(new_store)
    return mlflow_client


def metric_history(
    tracking_uri: str, run_id: str, keys: tuple[str, ...]
) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) pairs in step order, as the run holds them."""
    mlflow_client = client(tracking_uri)
    return {
        key: sorted((m.step, m.value) for m in mlflow_client.get_metric_history(run_id, key))
        for key in keys
    }


# What the MLflow UI's experiment-kind selector writes for a model-training experiment
# (mlflow/server/js: "mlflow.experimentKind" = "custom_model_development"; the other
# kind is "genai_development"). MLflow 3 versions that read it open such an experiment
# on its runs rather than its traces; see lineage.MODEL_TRAINING_VIEW for the rest.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"


def ensure_experiment(tracking_uri: str, name: str, artifact_location: str | None) -> str:
    """The id of experiment `name`, created if missing, marked as model training (an
    experiment made before gradline marked them is marked on first use; one the user
    marked otherwise in the UI keeps that)."""
    mlflow_client = client(tracking_uri)
    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is None:
        return mlflow_client.create_experiment(
            name,
            artifact_location=artifact_location,
            tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND},
        )
    if EXPERIMENT_KIND_TAG not in experiment.tags:
        mlflow_client.set_experiment_tag(
            experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND
        )
    return experiment.experiment_id


class MlflowTracker:
    """Rank 0's writer into an existing run: a journal file plus a helper process.

    The loop appends each record as a JSON line to `<job>/tracking.jsonl` (a buffered
    write, microseconds) and moves on. A low-priority helper process ships the journal
    to MLflow, whose SQLite store costs ~0.3 ms of Python per metric: in the training
    process that work would hold the GIL for milliseconds at a time.

    The journal makes tracking survive failures: when rank 0 is killed, records it
    wrote are on disk, and the next attempt's helper ships them. Records the run
    already holds (a restarted job recomputes steps after its checkpoint, identically)
    are skipped: one value per metric and step. A file lock keeps one shipper per job.
    """

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        journal: Path,
        keep_pending: int = PENDING_CHECKPOINTS,
    ) -> None:
        journal.parent.mkdir(parents=True, exist_ok=True)
        self._keep_pending = keep_pending  # checkpoint copies waiting to ship
        niceness = helper_niceness()  # a bad setting fails here, before any process starts
        self._path, self._uri = journal, tracking_uri
        self._journal = journal.open("a", encoding="utf-8")
        context = multiprocessing.get_context(_helper_start_method())
        # When the server stopped answering (time.time()), 0 while it answers: the helper
        # sets it, close() reads it to decide whether waiting for the helper can help.
        self._outage_since = context.Value("d", 0.0)
        # Released once the writer's `end` is in the journal: the helper, idle between
        # polls, ships the last records at once instead of after its next poll. A
        # semaphore, not an Event: releasing one never waits on the helper, where an
        # Event's set() waits for a helper caught inside wait() and would hang for good
        # on a helper killed there.
        self._ended = context.Semaphore(0)
        begins = self._journal.tell()  # where this writer's records start
        self._process = context.Process(
            target=_tracking_process,
            args=(tracking_uri, run_id, str(journal), os.getpid(), begins, self._outage_since),
            kwargs={"ended": self._ended},
            name="gradline-tracker",
            daemon=True,
        )
        self._process.start()
        _deprioritize(self._process.pid, niceness)

    def _append(self, record: dict) -> None:
        self._journal.write(json.dumps(record) + "\n")
        self._journal.flush()  # in the OS's hands now: survives this process being killed

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._append({"kind": "metrics", "step": step, "time": _now_ms(), "values": metrics})

    def log_series(self, key: str, first_step: int, values: list[float]) -> None:
        """One value per step from `first_step` on, as one record."""
        record = {"kind": "series", "key": key, "first": first_step, "values": values}
        self._append({**record, "time": _now_ms()})

    def set_tag(self, key: str, value: str) -> None:
        self._append({"kind": "tag", "key": key, "value": value})

    def log_text(self, text: str, artifact_file: str) -> None:
        """A text artifact of the run (e.g. sampled continuations at a validation)."""
        self._append({"kind": "text", "path": artifact_file, "text": text})

    def log_checkpoint(self, path: Path, step: int, metrics: dict[str, float]) -> None:
        """Record a checkpoint folder and the metrics of its step under checkpoints/step-N/.

        Called on rank 0 once the checkpoint is complete. Hard links of its files in a
        hidden sibling folder keep them for the helper even if a later save prunes the
        checkpoint first.
        """
        pending = link_checkpoint(path, self._keep_pending)
        self._append(
            {
                "kind": "checkpoint",
                "path": str(pending),
                "name": path.name,
                "step": step,
                "values": metrics,
            }
        )

    def finish(self) -> None:
        """The writer's `end` into the journal, and the helper woken to ship the rest at
        once; returns without waiting (close() waits). Once only."""
        if self._journal.closed:
            return
        self._append({"kind": "end", "writer": os.getpid()})
        self._journal.close()
        self._ended.release()

    def close(self, timeout_s: float = 600.0, outage_grace_s: float = END_OUTAGE_GRACE_S) -> None:
        """Wait until everything journaled is in the tracking store, unless the server has
        not answered for `outage_grace_s`: then the records stay in the journal and the
        job ends without them (its model and checkpoints never wait on tracking);
        registration, or `gradline sync`, ships them once the server is back."""
        self.finish()
        started = time.monotonic()
        while self._process.is_alive() and time.monotonic() - started < timeout_s:
            self._process.join(0.5)
            # Still down after the grace (not merely back while the helper sleeps
            # between tries, up to 30 s): waiting longer here cannot help.
            in_outage = self._outage_since.value and self._process.is_alive()
            past_grace = time.monotonic() - started > outage_grace_s
            if in_outage and past_grace and not tracking_reachable(self._uri):
                self._leave_in_journal(
                    "MLflow tracking server still unreachable as the job ends: %d records "
                    "stay in the journal %s; registration ships them when the server is "
                    "back (or run `gradline sync`)"
                )
                return
        if self._process.is_alive():  # behind, not failed: a host busy with other work
            self._leave_in_journal(
                f"the MLflow tracking helper had not shipped everything {timeout_s:g} s after "
                "training ended (a host whose CPUs other work fills: it runs at niceness "
                f"{TRACKER_NICE_ENV}, default 19): %d records stay in the journal %s; the "
                "job's end ships them when the server answers, else registration or "
                "`gradline sync` does"
            )
            return
        if self._process.exitcode != 0:
            raise TrackingError(
                f"the MLflow tracking helper failed (exit code {self._process.exitcode}); "
                "see its error above. Training results are on disk; the run may lack metrics"
            )

    def _leave_in_journal(self, why: str) -> None:
        """Stop the helper and say `why` the journal keeps records (a message with two
        %-fields: how many records, and the journal)."""
        # Safe at any moment: what the helper shipped is saved as an offset only after the
        # server took it, and the next shipper reads back what landed (one value per step).
        self._process.terminate()
        self._process.join(2)
        if self._process.is_alive():  # stopped (SIGSTOP), or starved by a busy host
            self._process.kill()
            self._process.join(30)
        log.warning(why, pending_records(self._path), self._path)


def link_checkpoint(path: Path, keep: int = PENDING_CHECKPOINTS) -> Path:
    """Hard-link the files of checkpoint folder `path` into `.mlflow-<name>/` beside it
    (same file system, no copy); the shipper logs that folder and then removes it.

    While the tracking server is down nothing ships, and the links would keep every
    pruned checkpoint's bytes on disk: only the newest `keep` pending folders stay (the
    shipper skips a record whose folder is gone; the run's metrics are all kept)."""
    for leftover in path.parent.glob(".mlflow-pruned-*"):  # of a writer killed mid-prune
        shutil.rmtree(leftover, ignore_errors=True)
    pending = path.with_name(f".mlflow-{path.name}")
    _discard(pending)  # this step saved again (a retried attempt): the new files win
    pending.mkdir()
    for file in path.iterdir():
        if file.is_file():
            os.link(file, pending / file.name)
    waiting = sorted(path.parent.glob(".mlflow-step-*"))  # zero-padded: oldest first
    for old in waiting[: max(0, len(waiting) - keep)]:
        _discard(old)
    return pending


# The writer and the shipper each take a pending folder by renaming it, which is atomic:
# exactly one of them gets it, and the other never touches it. Deleting in place would
# not do: an rmtree under way keeps unlinking files of a folder renamed from under it,
# and a copy of that folder failed half-way (a missing sha256.json), taking the job down.


def _discard(folder: Path) -> None:
    """The writer drops a pending folder, unless the shipper claimed it first."""
    name = folder.name.removeprefix(".mlflow-")
    doomed = folder.with_name(f".mlflow-pruned-{name}-{time.time_ns()}")
    try:
        folder.rename(doomed)
    except FileNotFoundError:
        return  # claimed (or never made)
    shutil.rmtree(doomed, ignore_errors=True)


def claim_pending(pending: Path) -> Path | None:
    """The shipper takes a pending checkpoint folder before shipping it, or None when
    the writer dropped it first (the shipper then skips that record). A folder claimed by
    a killed shipper is shipped by the next one; the writer's folder of the same name (the
    step saved again since) is left to its own, later record."""
    claimed = pending.with_name(pending.name.replace(".mlflow-", ".mlflow-shipping-", 1))
    if not claimed.exists():
        with contextlib.suppress(FileNotFoundError):
            pending.rename(claimed)
    return claimed if claimed.exists() else None


def _helper_start_method() -> str:
    """How the helper starts: a clean interpreter (`spawn`), with nothing of the rank's
    CUDA or communication state, which imports MLflow itself (~2 s of CPU, competing with
    training). Where this process has MLflow's store imported already (a worker forked
    from the stage host's preloaded modules) and has no such state yet (no other thread,
    CUDA not initialized: the worker makes its tracker first thing), a fork is as clean
    and ready at once."""
    import threading

    if "mlflow.store.tracking.sqlalchemy_store" not in sys.modules:
        return "spawn"
    torch = sys.modules.get("torch")
    cuda_started = torch is not None and torch.cuda.is_initialized()
    return "fork" if threading.active_count() == 1 and not cuda_started else "spawn"


def helper_niceness() -> int:
    """The helper's niceness: 19 (the lowest priority) unless `GRADLINE_TRACKER_NICE`
    says otherwise. At 19 the helper yields to every other process on the host, not only
    to training: beside unrelated work that fills the CPUs it barely runs, and metrics
    reach the MLflow UI only once that work pauses."""
    value = os.environ.get(TRACKER_NICE_ENV, "19")
    try:
        niceness = int(value)
    except ValueError:
        niceness = -1
    if not 0 <= niceness <= 19:
        raise ConfigError(
            f"{TRACKER_NICE_ENV}={value!r} is not a niceness: set a whole number from 0 "
            "(the training's own priority) to 19 (the lowest, the default), or unset it"
        )
    return niceness


def _deprioritize(pid: int, niceness: int) -> None:
    """Training first. Set from the parent right after start, so the helper's own
    start-up (imports) runs at that priority too. On a saturated host the helper falls
    behind and catches up when training ends (close() waits for it). Never above the
    parent's own priority."""
    with contextlib.suppress(AttributeError, OSError):  # not permitted: normal priority
        os.setpriority(os.PRIO_PROCESS, pid, max(niceness, os.getpriority(os.PRIO_PROCESS, 0)))


# A journal record kind that tracking does not know, shipped by the caller's function
# (the deferred model: logging it needs torch and the serving code).
Action = Callable[[dict], None]


def _ship(
    mlflow_client,
    run_id: str,
    records: list[dict],
    logged_until: dict[str, int],
    actions: dict[str, Action] | None = None,
) -> None:
    from mlflow.entities import Metric, RunTag

    def last_logged(key: str) -> int:
        if key not in logged_until:
            history = mlflow_client.get_metric_history(run_id, key)
            logged_until[key] = max((m.step for m in history), default=-1)
        return logged_until[key]

    def add(key: str, value: float, stamp: int, step: int) -> None:
        if step > last_logged(key):
            metrics.append(Metric(key, float(value), stamp, step))
            logged_until[key] = step

    held: dict[str, set[tuple[int, float]]] = {}  # read once per key

    def replace(key: str, value: float, stamp: int, step: int) -> None:
        # An evaluation may give a step a new value (evaluated again); the same value
        # already there is this record shipped before.
        if key not in held:
            held[key] = {(m.step, m.value) for m in mlflow_client.get_metric_history(run_id, key)}
        if (step, float(value)) not in held[key]:
            metrics.append(Metric(key, float(value), stamp, step))

    metrics, tags, status = [], [], None
    for record in records:
        kind = record["kind"]
        if kind in ("metrics", "series"):
            put = replace if record.get("replace") else add
            for key, value, stamp, step in _values(record):
                put(key, value, stamp, step)
        elif kind == "tag":
            tags.append(RunTag(record["key"], record["value"]))
        elif kind == "text":
            mlflow_client.log_text(run_id, record["text"], record["path"])
        elif kind == "checkpoint" and (claimed := claim_pending(Path(record["path"]))):
            folder = f"checkpoints/step-{record['step']:08d}"
            mlflow_client.log_artifacts(run_id, str(claimed), folder)
            payload = {"step": record["step"], **record["values"]}
            mlflow_client.log_dict(run_id, payload, f"{folder}/metrics.json")
            # Gone once shipped: a later shipper (after a restart) skips this record.
            shutil.rmtree(claimed, ignore_errors=True)
        elif kind == "artifacts" and Path(record["path"]).exists():
            mlflow_client.log_artifacts(run_id, record["path"], record["artifact_path"])
            shutil.rmtree(record["path"], ignore_errors=True)
        elif kind == "status":
            status = record["status"]  # last: the run ends once it holds everything
        elif actions and kind in actions:
            actions[kind](record)
    for start in range(0, len(metrics), 1000):  # MLflow's batch limit
        mlflow_client.log_batch(run_id, metrics=metrics[start : start + 1000])
    if tags:
        mlflow_client.log_batch(run_id, tags=tags)
    if status is not None:
        mlflow_client.set_terminated(run_id, status=status)


def _values(record: dict):
    """(key, value, time, step) of each metric value in a metrics or series record."""
    if record["kind"] == "metrics":
        for key, value in record["values"].items():
            yield key, value, record["time"], record["step"]
    else:
        for step, value in enumerate(record["values"], start=record["first"]):
            yield record["key"], value, record["time"], step


def journal_history(journal: Path, keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) pairs as the run holds them once the journal has
    shipped (`metric_history` without the server): a step recomputed after a restart
    keeps its first value, as the shipper does."""
    history: dict[str, list[tuple[int, float]]] = {key: [] for key in keys}
    records, _ = read_journal(journal, 0)
    for record in records:
        if record["kind"] not in ("metrics", "series") or record.get("replace"):
            continue
        for key, value, _, step in _values(record):
            if key in history and step > (history[key][-1][0] if history[key] else -1):
                history[key].append((step, float(value)))
    return history


def _ship_through_outages(
    mlflow_client,
    run_id: str,
    records: list[dict],
    logged_until: dict[str, int],
    *,
    deadline: float | None = None,
    outage_since=None,
    actions: dict[str, Action] | None = None,
) -> None:
    """`_ship`, waiting out a tracking server that is down, restarting or failing (5xx):
    training never waits for it (the journal holds the records), and once it answers
    again each value lands once: what landed before the error is read back from the
    server instead of being trusted from memory. Past `deadline` (time.monotonic()) it
    gives up with TrackingUnavailable; `outage_since` (a shared value) tells the job's
    end since when the server has not answered."""
    from mlflow.exceptions import MlflowException  # mlflow is optional: see the docstring

    delay = 1.0
    while True:
        try:
            _ship(mlflow_client, run_id, records, logged_until, actions)
            if outage_since is not None:
                outage_since.value = 0.0
            return
        except MlflowException as exc:
            if not is_unreachable(exc):  # a refusal, not a transport failure
                raise
            logged_until.clear()
            if outage_since is not None and not outage_since.value:
                outage_since.value = time.time()
            cause = str(exc).splitlines()[0][:300]
            if deadline is not None and time.monotonic() + delay > deadline:
                message = f"the MLflow tracking server does not answer ({cause})"
                raise TrackingUnavailable(message) from exc
            log.warning(
                "MLflow tracking server unreachable (%s); the journal keeps the records and "
                "they ship when it is back (next try in %.0f s); training goes on",
                cause,
                delay,
            )
            time.sleep(delay)
            delay = min(delay * 2, _OUTAGE_RETRY_MAX_S)


_OUTAGE_RETRY_MAX_S = 30.0


def is_unreachable(exc: Exception) -> bool:
    """Whether an MlflowException is the server not answering (down, restarting, 5xx after
    retries), as opposed to the server refusing the request."""
    return str(exc).startswith("API request to")


@contextlib.contextmanager
def fail_fast_requests():
    """MLflow's HTTP requests fail in seconds here instead of after its own minutes of
    silent retries, so the caller can say what it waits for (and stop waiting)."""
    settings = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
    before = {name: os.environ.get(name) for name in settings}
    for name, value in settings.items():
        os.environ.setdefault(name, value)  # the user's own settings win
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)


def tracking_reachable(tracking_uri: str, timeout_s: float = 5.0) -> bool:
    """Whether the tracking server answers its health check now (a local store always
    does). One quick request, where an MLflow call would retry for minutes."""
    if not tracking_uri.startswith(("http://", "https://")):
        return True
    parts = urllib.parse.urlsplit(tracking_uri)
    health = urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/health"))
    try:
        with urllib.request.urlopen(health, timeout=timeout_s):
            return True
    except OSError:  # refused, timed out, or an HTTP error (URLError/HTTPError are OSErrors)
        return False


def _shipped_file(journal: Path) -> Path:
    return journal.with_name(journal.name + ".shipped")


def shipped_offset(journal: Path, run_id: str | None = None) -> int:
    """Bytes of the journal the tracking store holds (saved after each shipped chunk) in
    run `run_id` (default: the run they were shipped to). For another run, none: a copy
    of a job resumed into a new run gives that run the whole journal, not just what its
    first run had not received yet."""
    try:
        shipped = json.loads(_shipped_file(journal).read_text())
    except FileNotFoundError:
        return 0
    if run_id is not None and shipped.get("run_id", run_id) != run_id:
        return 0
    return shipped["offset"]


def _save_shipped(journal: Path, run_id: str, offset: int) -> None:
    write_json(_shipped_file(journal), {"run_id": run_id, "offset": offset})


def read_journal(journal: Path, offset: int) -> tuple[list[dict], int]:
    """The complete records after `offset`, and the offset after them (a torn last line,
    still being written, waits for the next read)."""
    with open(journal, encoding="utf-8") as handle:
        handle.seek(offset)
        chunk = handle.read()
    complete = chunk[: chunk.rfind("\n") + 1]
    records = [json.loads(line) for line in complete.splitlines() if line]
    return records, offset + len(complete.encode("utf-8"))


def pending_records(journal: Path) -> int:
    """Records of the journal not in the tracking store yet (0 without a journal)."""
    if not journal.is_file():
        return 0
    return len(read_journal(journal, shipped_offset(journal))[0])


def append_records(journal: Path, records: list[dict]) -> None:
    """Records added to a job's journal after its training ended (its helper is gone)."""
    with journal.open("a", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


@contextlib.contextmanager
def shipper_lock(journal: Path):
    """One shipper per journal: a helper left over from a killed attempt finishes first."""
    with open(journal.with_name(journal.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def checkpoint_copies(records: list[dict]) -> int:
    """Checkpoint copies among journal records still waiting on disk to ship."""
    return sum(r["kind"] == "checkpoint" and Path(r["path"]).exists() for r in records)


@dataclass(frozen=True)
class Shipped:
    records: int
    checkpoints: int  # checkpoint copies among them (shipped as artifacts)


def ship_pending(
    tracking_uri: str,
    run_id: str,
    journal: Path,
    *,
    deadline: float | None = None,
    actions: dict[str, Action] | None = None,
) -> Shipped:
    """Ship what the journal holds past its shipped offset, the way the job's helper
    does (each value once), and move the offset on: for a job whose helper left records
    behind (the server was down as training ended)."""
    with shipper_lock(journal), fail_fast_requests():
        offset = shipped_offset(journal, run_id)
        records, end = read_journal(journal, offset)
        if not records:
            return Shipped(0, 0)
        copies = checkpoint_copies(records)
        mlflow_client = client(tracking_uri)
        _ship_through_outages(
            mlflow_client, run_id, records, {}, deadline=deadline, actions=actions
        )
        _save_shipped(journal, run_id, end)
        return Shipped(len(records), copies)


def ship_records(tracking_uri: str, run_id: str, records: list[dict]) -> None:
    """Journal-shaped records shipped straight away, with no journal (nothing kept if it
    fails: for a run whose job folder is not on this machine)."""
    _ship(client(tracking_uri), run_id, records, {})


def _tracking_process(
    tracking_uri: str,
    run_id: str,
    journal: str,
    writer_pid: int,
    writer_begins: int,
    outage_since=None,
    ended=None,
) -> None:
    """Ship the journal to MLflow until its writer (whose records start at byte
    `writer_begins`) says `end` or dies. Between polls of an idle journal it waits for
    `ended` (a semaphore the writer releases after its `end`), at most half a second."""
    # Fail fast per request and let `_ship_through_outages` say what it waits for,
    # instead of MLflow's own minutes of silent retries.
    path = Path(journal)
    with shipper_lock(path), fail_fast_requests():
        mlflow_client = client(tracking_uri)
        logged_until: dict[str, int] = {}
        offset = shipped_offset(path, run_id)
        # A helper left over from a killed attempt, which held the lock until now, ships
        # whatever the journal holds: this writer's records too, its `end` among them if
        # the writer finished first. Waiting for that `end` again would never return.
        done = _ended_within(path, writer_begins, offset, writer_pid)
        while not done:
            records, end = read_journal(path, offset)
            done = any(r["kind"] == "end" and r["writer"] == writer_pid for r in records)
            if records:
                _ship_through_outages(
                    mlflow_client, run_id, records, logged_until, outage_since=outage_since
                )
                _save_shipped(path, run_id, end)
            elif not pid_alive(writer_pid):
                return  # the writer was killed: all it wrote is shipped
            elif ended is None:
                time.sleep(0.5)
            else:
                # Released once, after the end is written: taking it, the next read
                # finds the end and the loop ends, so no wake-up is lost.
                ended.acquire(timeout=0.5)
            offset = end


def _ended_within(journal: Path, start: int, stop: int, writer_pid: int) -> bool:
    """Whether the journal's bytes [start, stop) hold `writer_pid`'s `end` record."""
    if stop <= start:
        return False
    with open(journal, "rb") as handle:
        handle.seek(start)
        lines = handle.read(stop - start).decode("utf-8").splitlines()
    records = (json.loads(line) for line in lines if line)
    return any(r["kind"] == "end" and r.get("writer") == writer_pid for r in records)


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class MlflowSink:
    """The job's run, as its workers' tracker factory (training.engine.tracker): rank 0
    journals to `run_id` in the store at `tracking_uri`."""

    tracking_uri: str
    run_id: str
    keep_pending: int = PENDING_CHECKPOINTS  # checkpoint copies waiting to ship

    def open(self, journal: Path) -> MlflowTracker:
        return MlflowTracker(self.tracking_uri, self.run_id, journal, self.keep_pending)
