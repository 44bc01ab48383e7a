"""A forked process's own command line, as `ps`, `pgrep -f` and `pkill -f` read it.

A fork carries its parent's command line. The workers' server forked from a train stage,
and the workers and tracking helper forked from it, would all read `gradline stage
train ...`, and an operator's `pkill -TERM -f "gradline stage train"` (the documented
way to stop a job at a checkpoint) would kill them mid-step instead of asking the stage.

On Linux a process's command line is the memory its arguments were passed in (between
`arg_start` and `arg_end` of /proc/self/stat); Python keeps its own copy of them, so it
can be overwritten in place, within its length. Elsewhere, or where /proc says nothing,
the title is left as it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from pathlib import Path

# /proc/<pid>/stat's fields after the command's name, which sits in parentheses:
# field 48 (arg_start) and 49 (arg_end), counted from 1 over the whole line.
_ARG_START, _ARG_END = 48 - 3, 49 - 3


def set_process_title(title: str) -> bool:
    """Show `title` as this process's command line (cut to the original's length);
    whether it could."""
    if sys.platform != "linux":
        return False
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path("/proc/self/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        start, end = int(fields[_ARG_START]), int(fields[_ARG_END])
        if start <= 0 or end <= start:
            return False
        room = end - start
        if len(Path("/proc/self/cmdline").read_bytes()) != room:
            return False  # not the layout described above: leave it alone
        encoded = title.encode(errors="replace")[: room - 1]
        ctypes.memmove(start, encoded + bytes(room - len(encoded)), room)
        return True
    return False
