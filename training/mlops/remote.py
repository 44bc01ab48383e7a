"""Why a `dvc push` failed, from what DVC printed and how it exited, as a user error.

DVC reports a failed transfer as free text (`failed to transfer '<md5>' - [Errno 28] No
space left on device: ...`, `Cannot connect to host ...`) and exits 1 (some files failed)
or 255 (it stopped at the first error). The causes a user acts on differ: free space,
fix a path or a permission, bring a server back, or just run again. Each cause says
whether a retry can help, so the flow does not retry a full disk three times in vain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from training.errors import RemotePushFailed
from training.mlops.tracking import redact_uri


@dataclass(frozen=True)
class Cause:
    name: str  # shown in the message: "no space left on the remote"
    retryable: bool  # whether the same push may succeed when run again
    fix: str  # what the user does before running again; {name}: the remote's name


# First match wins: a full disk also fails later writes with other errors, so it comes
# first; the generic I/O words come last. Patterns are DVC's and the OS's own wording
# (local, SSH, HTTP and S3 remotes), matched case-insensitively.
_CAUSES: tuple[tuple[str, Cause], ...] = (
    (
        r"no space left|errno 28\b|disk quota exceeded|errno 122\b|insufficient ?storage",
        Cause("no space left on the remote", False, "free space on the remote (or grow it)"),
    ),
    (
        r"no remote specified|remote .* doesn't exist|unknown remote",
        Cause("no DVC remote configured", False, "add one with `dvc remote add -d NAME URL`"),
    ),
    (
        r"permission denied|errno 13\b|read-only file system|errno 30\b|accessdenied|"
        r"forbidden|\b403\b|\b401\b|invalidaccesskeyid|signaturedoesnotmatch",
        Cause(
            "permission denied on the remote",
            False,
            "grant write access to the remote (or fix its credentials with "
            "`dvc remote modify --local {name} ...`)",
        ),
    ),
    (
        r"not a directory|errno 20\b|no such file or directory|errno 2\b|nosuchbucket|"
        r"\b404\b",
        Cause(
            "the remote's path does not exist",
            False,
            "fix its URL with `dvc remote modify {name} url URL` (or create the folder or bucket)",
        ),
    ),
    (
        r"cannot connect|connection refused|errno 111\b|name or service not known|"
        r"temporary failure in name resolution|no route to host|network is unreachable|"
        r"timed? ?out|endpointconnectionerror|could not connect",
        Cause(
            "the remote is unreachable",
            True,
            "check that the remote's server is up and its URL right (`dvc remote list`)",
        ),
    ),
    (
        r"server disconnected|connection reset|errno 104\b|broken pipe|errno 32\b|"
        r"keyboardinterrupt|interrupted|incomplete ?read|payload is not completed",
        Cause("the push was interrupted", True, "run again"),
    ),
)
_UNKNOWN = Cause("the push failed", True, "read DVC's output below, fix what it names")
_INTERRUPTED = _CAUSES[-1][1]
_FAILED_COUNT = re.compile(r"(\d+) files? failed to (?:upload|transfer)")


def classify(output: str, exit_code: int) -> Cause:
    """The cause of a failed push from DVC's output and exit code. A push killed by a
    signal (negative code from Popen, 128+n from a shell) was interrupted, whatever it
    printed before."""
    if exit_code < 0 or exit_code in (130, 137, 143):
        return _INTERRUPTED
    errors = "\n".join(line for line in output.splitlines() if "ERROR" in line) or output
    for pattern, cause in _CAUSES:
        if re.search(pattern, errors, re.IGNORECASE):
            return cause
    return _UNKNOWN


def failed_files(output: str) -> int | None:
    """How many files DVC said did not reach the remote, when it said so."""
    found = _FAILED_COUNT.findall(output)
    return int(found[-1]) if found else None


def push_failed(
    remote: str, url: str, output: str, exit_code: int, missing: int | None
) -> RemotePushFailed:
    """The error for a failed push to `remote` at `url`: the cause, how many files did
    not reach it (`missing`, None when not known), what to do, then DVC's own words.
    Credentials in the URL are never shown."""
    cause = classify(output, exit_code)
    files = (
        f"{missing} file(s) did not reach it"
        if missing is not None
        else "some files did not reach it"
    )
    excerpt = "\n".join(_errors(output)[-5:])
    where = f"remote {remote!r} ({redact_uri(url)})" if remote else "the default remote (none set)"
    fix = cause.fix.format(name=remote or "NAME")
    return RemotePushFailed(
        f"`dvc push` to {where} failed: {cause.name}; {files}. Nothing was registered. "
        f"What to do: {fix}, then `gradline run` again: the stages are up to date, it "
        f"pushes what is missing and registers the model.\nDVC said:\n{excerpt}",
        cause=cause.name,
        retryable=cause.retryable,
        missing=missing,
    )


def _errors(output: str) -> list[str]:
    """DVC's error lines, credentials cut out: it prints the URLs it failed on."""
    lines = [line for line in output.splitlines() if "ERROR" in line]
    return [_USERINFO.sub(r"\1", line) for line in lines or output.strip().splitlines()]


_USERINFO = re.compile(r"(\w+://)[^/@\s]+@")
