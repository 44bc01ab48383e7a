"""Asking the stage host (flows/stage_host.py) to run a command: the client's side.

A flow (or a test session) starts a host that imported torch, MLflow and DVC once and
names its socket in `GRADLINE_STAGE_HOST`. A command run there is a fork of the host,
ready at once, instead of a fresh interpreter that imports everything again:

- `run_in_host`: a `gradline stage ...` command (what DVC runs) hands its argv,
  environment, folder and standard streams to the host and becomes a thin stand-in for
  the fork: it passes signals on and exits as the fork exits;
- `start_in_host`: `dvc ...` for a flow task, a `HostedProcess` used as a
  `subprocess.Popen` is (pid, stdout, wait, communicate).

The request: a 4-byte length, then JSON (argv, env, cwd, sys.path, umask), with the
three standard streams passed as file descriptors alongside. The replies are lines:
`pid N` once the fork exists (or `refused WHY`), then `exit N` or `signal N`.
Only the standard library here: this runs in every stage command.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence

STAGE_HOST_ENV = "GRADLINE_STAGE_HOST"
HEADER = struct.Struct("!I")  # the request's length, before the request itself
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class HostRefused(OSError):
    """The host is gone or would not run the command: nothing ran, run it here."""


class _Connection:
    """A request sent to the host, and its replies read line by line (unbuffered
    beyond the socket, so that a wait with a timeout sees every line)."""

    def __init__(self, argv: list[str], streams: Sequence[int], env: dict, cwd: str) -> None:
        path = env.get(STAGE_HOST_ENV)
        if not path:
            raise HostRefused("no stage host is named")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pending = b""
        try:
            self.sock.connect(path)
            request = {
                "argv": argv,
                "env": env,
                "cwd": cwd,
                "path": sys.path,
                "umask": _current_umask(),
            }
            payload = json.dumps(request).encode()
            socket.send_fds(self.sock, [HEADER.pack(len(payload))], list(streams))
            self.sock.sendall(payload)
            kind, _, value = self.line().partition(" ")
            if kind != "pid":
                raise HostRefused(f"the stage host refused {argv[:2]}: {value or 'no answer'}")
            self.pid = int(value)
        except (OSError, ValueError) as exc:
            self.sock.close()
            raise HostRefused(str(exc)) from exc

    def line(self, timeout: float | None = None) -> str:
        """The next reply line ('' when the host closed without one); TimeoutError when
        none came within `timeout` seconds."""
        while b"\n" not in self.pending:
            if timeout is not None and not select.select([self.sock], [], [], timeout)[0]:
                raise TimeoutError
            chunk = self.sock.recv(4096)
            if not chunk:
                return ""
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        self.sock.close()


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# --- a stage command standing in for its fork ---------------------------------------------


def stage_in_host(argv: list[str] | None) -> int | None:
    """`gradline argv` (this process's own arguments when None), when it is a stage and a
    host is named, run there: its exit code; None otherwise (the stage runs here)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["stage"] or not os.environ.get(STAGE_HOST_ENV):
        return None
    return run_in_host(list(args))


def run_in_host(argv: list[str]) -> int | None:
    """Run `gradline argv` (a stage) in the host `GRADLINE_STAGE_HOST` names; its exit
    code, or None when no host answers (the caller runs the stage itself)."""
    try:
        conn = _Connection(argv, _standard_streams(), dict(os.environ), os.getcwd())
    except HostRefused:
        return None
    with contextlib.closing(conn):
        _forward_signals_to(conn.pid)
        kind, _, value = conn.line().partition(" ")  # the fork's end
    if kind == "signal":  # end as the stage ended, so that DVC sees what a shell would
        signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
        return 128 + int(value)
    if kind != "exit":
        print("gradline: the stage host ended before the stage did", file=sys.stderr)
        return 1
    return int(value)


def _standard_streams() -> list[int]:
    """This command's stdin, stdout and stderr, /dev/null for one it was started without."""
    fds = []
    modes = (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY)
    for stream, mode in zip((sys.stdin, sys.stdout, sys.stderr), modes, strict=True):
        try:
            fds.append(stream.fileno())
        except (AttributeError, OSError, ValueError):  # None, closed, or not a file
            fds.append(os.open(os.devnull, mode))
    return fds


def _forward_signals_to(pid: int) -> None:
    def forward(signum: int, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)


# --- a command forked for this process, used as a Popen ---------------------------------


class HostedProcess:
    """A command the host forked for this process, used as `subprocess.Popen` is: `pid`,
    `stdout`/`stderr` (text pipes when asked for), `poll`, `wait`, `communicate`, and
    `returncode` (negative: ended by that signal). The fork is the host's child, not
    ours; it is killed when this object's connection closes before it ended."""

    def __init__(self, conn: _Connection, stdout, stderr) -> None:
        self._conn, self.stdout, self.stderr = conn, stdout, stderr
        self.pid = conn.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(timeout=0)
        return None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                kind, _, value = self._conn.line(timeout).partition(" ")
            except TimeoutError:
                raise subprocess.TimeoutExpired(["dvc"], timeout) from None
            self._conn.close()
            if kind == "signal":
                self.returncode = -int(value)
            elif kind == "exit":
                self.returncode = int(value)
            else:  # the host ended first: its forks died with it
                self.returncode = -signal.SIGKILL
        return self.returncode

    def communicate(self) -> tuple[str | None, str | None]:
        """Everything the command writes to its pipes, once it has ended."""
        read: dict[str, str] = {}
        threads = [
            threading.Thread(target=lambda n=name, p=pipe: read.__setitem__(n, p.read()))
            for name, pipe in (("out", self.stdout), ("err", self.stderr))
            if pipe is not None
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._close_pipes()
        self.wait()
        return read.get("out"), read.get("err")

    def _close_pipes(self) -> None:
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> HostedProcess:
        return self

    def __exit__(self, *_: object) -> None:
        self._close_pipes()
        self.wait()


def start_in_host(
    argv: list[str], *, cwd: str, env: dict[str, str], stdout=None, stderr=None
) -> HostedProcess:
    """Start `argv` (a `dvc` command) in the host, with stdin from /dev/null and stdout
    and stderr as `subprocess.Popen` takes them (None, PIPE, STDOUT, DEVNULL); pipes are
    text. HostRefused when no host runs it: the caller starts it itself."""
    ours: list[int] = []  # the pipes' read ends, kept here
    theirs: list[int] = [os.open(os.devnull, os.O_RDONLY)]  # sent, then closed here
    try:
        out_fd = _stream_for(stdout, 1, ours, theirs)
        err_fd = out_fd if stderr == subprocess.STDOUT else _stream_for(stderr, 2, ours, theirs)
        conn = _Connection(argv, [theirs[0], out_fd, err_fd], env, cwd)
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    pipes = iter(ours)
    out = os.fdopen(next(pipes), "r") if stdout == subprocess.PIPE else None
    err = os.fdopen(next(pipes), "r") if stderr == subprocess.PIPE else None
    return HostedProcess(conn, out, err)


def _stream_for(spec, inherited: int, ours: list[int], theirs: list[int]) -> int:
    """The descriptor the fork gets for one stream (its owner's own: `theirs`)."""
    if spec == subprocess.PIPE:
        read_end, write_end = os.pipe()
        ours.append(read_end)
        theirs.append(write_end)
        return write_end
    if spec == subprocess.DEVNULL:
        theirs.append(os.open(os.devnull, os.O_WRONLY))
        return theirs[-1]
    if spec is None:
        return inherited
    raise ValueError(f"unsupported stream {spec!r}: use None, PIPE, STDOUT or DEVNULL")
