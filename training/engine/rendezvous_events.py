"""The elastic rendezvous names each event it records after the method that records it,
found with `inspect.stack()` twice per event. Each walk asks `inspect.getmodule` for every
frame's module, and a frame whose file is no module's (`<frozen runpy>`, a `-c` script, a
`__main__`) makes it scan all of `sys.modules` again. In a train stage forked from the
stage host (flows/stage_host.py), which has DVC, MLflow, torch, pandas and scikit-learn
loaded (~4800 modules), under the flow's deep stack, a launch's events cost about a second
of wall before the workers start and half a second after they end on a slow 2-core machine
(A/B in one pipeline, GRADLINE_TIMINGS). The same name comes from the frame itself at no
cost; `use_frame_names` puts that in place.
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
