"""Exceptions a user can act on. Each message names what is wrong and how to fix it.

Each class says whether running again can help (`retryable`) and which exit code
`gradline` ends with, so an orchestrator that sees only the exit code of a stage
(through `dvc repro`) can still decide whether to retry it.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

USER_ERROR_EXIT_CODE = 2  # fix the input; a retry would fail the same way
CRASH_EXIT_CODE = 70  # EX_SOFTWARE: workers failed; a retry resumes from the checkpoint
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request, state saved; run again to resume
# Where `gradline` writes {type, message, exit_code} when it fails with a GradlineError:
# the flow reads it to show the cause and to decide on a retry.
ERROR_FILE_ENV = "GRADLINE_ERROR_FILE"


class GradlineError(Exception):
    """Base class: an error whose message is meant for the user, not a traceback."""

    exit_code = USER_ERROR_EXIT_CODE
    retryable = False


class ConfigError(GradlineError):
    """params.yaml or a --set override is invalid."""


class DataError(GradlineError):
    """Input data is missing, malformed or inconsistent with the manifest."""


class ProjectError(GradlineError):
    """The working directory is not a gradline project, or a stage output is missing."""


class TrackingError(GradlineError):
    """The MLflow tracking store or registry cannot do what was asked."""


class DriftBlocked(GradlineError):
    """New data drifted from the champion's past a threshold and orchestrate.drift is
    block: the run stopped before training. The message names what drifted and how to
    accept it; running again without accepting stops the same way."""


class RemotePushFailed(GradlineError):
    """Outputs did not reach the DVC remote, so nothing was registered. `cause` says why
    (training.mlops.remote); a full, missing or forbidden remote is not worth a retry, a
    connection that dropped is. `missing`: files that did not reach it, when known."""

    def __init__(self, message: str, cause: str, retryable: bool, missing: int | None) -> None:
        super().__init__(message)
        self.cause = cause
        self.retryable = retryable
        self.missing = missing
        # EX_TEMPFAIL tells a scheduler that sees only the exit code to try again later.
        self.exit_code = PREEMPTED_EXIT_CODE if retryable else USER_ERROR_EXIT_CODE


class OrchestratorUnreachable(GradlineError):
    """The Prefect API stopped answering mid-run, for longer than its client waits. What
    finished is kept; running again once it answers skips it and resumes training."""

    exit_code = PREEMPTED_EXIT_CODE  # try again later
    retryable = True


class TrackingUnavailable(TrackingError):
    """The tracking server did not answer in the time given. Nothing is lost: the job's
    records wait in its journal on disk until `gradline sync` ships them. Running the
    same thing again before the server is back fails the same way (exit code 2)."""


def is_retryable_exit(code: int | None) -> bool:
    """Whether a stage that ended with `code` may succeed when run again. Only the
    user-error code says no: crashes, preemptions and signals are worth a retry."""
    return code != USER_ERROR_EXIT_CODE


class StoreUnreachable(GradlineError):
    """A rank's store (the workers' process group meets there) never listened: its server
    failed or cannot be reached. The job's restart may get past it."""

    exit_code = CRASH_EXIT_CODE
    retryable = True


class DiskFull(GradlineError):
    """A write found no space left; running again fails the same way until space is freed."""


# ENOSPC and EDQUOT (a quota): no retry helps until someone frees space.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def disk_full(path: Path | str, needed: int | None = None) -> DiskFull:
    """The error for a write under `path` that does not fit: where, needed, free, what to do."""
    free = free_bytes(Path(path))
    need = f"it needs about {_size(needed)}, " if needed else ""
    return DiskFull(
        f"no space left for {path}: {need}{_size(free)} free there. Free space on that "
        "disk (or point the output elsewhere), then run again: finished outputs and "
        "checkpoints are kept, and training resumes from its latest checkpoint"
    )


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of `path` (or of its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return 0


def ensure_free(path: Path, needed: int) -> None:
    """Fail early, before a large write under `path`, when it cannot fit."""
    if free_bytes(path) < needed:
        raise disk_full(path, needed)


def as_user_error(exc: BaseException) -> GradlineError | None:
    """The GradlineError an exception means for the user, if any: out of space is one."""
    if isinstance(exc, GradlineError):
        return exc
    if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
        return disk_full(exc.filename or "the output")
    return None


def is_retryable(exc: BaseException) -> bool:
    """Whether running again may get past `exc`: not bad input, not a full disk."""
    error = as_user_error(exc)
    return error.retryable if error is not None else True


def _size(count: int) -> str:
    value, unit = float(count), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{count} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
