"""The elastic rendezvous names each event it records after the method that records it,
found with `inspect.stack()`: a walk of every frame that reads each frame's source file
for context, twice per event. A launch records about ten events, and under a deep call
stack (a flow's task, a test) each walk costs tens to hundreds of milliseconds of CPU: in
the test suite, about a CPU-second per launch, more than a small job's training. The
same name comes from the frame itself at no cost; `use_frame_names` puts that in place.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.rendezvous import dynamic_rendezvous


def caller_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up from this one (0: this function), as
    torch's `get_method_name(depth)` returns it from `inspect.stack()[depth]`."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a stack shallower than `depth`
        return "no_method_name"


def use_frame_names() -> None:
    """Name rendezvous events from the frame (idempotent; the events are unchanged)."""
    dynamic_rendezvous.get_method_name = caller_name
