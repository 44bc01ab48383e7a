"""Exceptions a user can act on. Each message names what is wrong and how to fix it.

Each class says whether running again can help (`retryable`) and which exit code
`gradline` ends with, so an orchestrator that sees only the exit code of a stage
(through `dvc repro`) can still decide whether to retry it.
"""

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


def is_retryable_exit(code: int | None) -> bool:
    """Whether a stage that ended with `code` may succeed when run again. Only the
    user-error code says no: crashes, preemptions and signals are worth a retry."""
    return code != USER_ERROR_EXIT_CODE
