"""Two costs of torch's elastic rendezvous that a gradline launch does not pay.

Event names. The rendezvous names each event it records after the method that records
it, found with `inspect.stack()` twice per event. Each walk asks `inspect.getmodule` for
every frame's module, and a frame whose file is no module's (`<frozen runpy>`, a `-c`
script, a `__main__`) makes it scan all of `sys.modules` again. In a train stage forked
from the stage host (flows/stage_host.py), which has DVC, MLflow, torch, pandas and
scikit-learn loaded (~4800 modules), under the flow's deep stack, a launch's events cost
about a second of wall before the workers start and half a second after they end on a
slow 2-core machine (A/B in one pipeline, GRADLINE_TIMINGS). The same name comes from
the frame itself at no cost; `use_frame_names` puts that in place.

The first round's skew. Before its first round a node sleeps a random 0 to 0.3 s, so
that many nodes do not reach the rendezvous store at once. A one-node launch has no one
to skew against: `skew_first_round(False)` leaves the pause out (0.15 s of every job's
start on average); a multi-node launch keeps it.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

_TORCH_DELAY = dynamic_rendezvous._delay


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


def _delay_without_skew(seconds: float | tuple[float, float]) -> None:
    """torch's `_delay`, but a random range (the first round's skew, the only one the
    rendezvous asks for) is no pause; a fixed delay (polling for the state) still is."""
    if not isinstance(seconds, tuple):
        _TORCH_DELAY(seconds)


def skew_first_round(skew: bool) -> None:
    """Whether this process's next rendezvous pauses at random before its first round:
    yes for a launch of several nodes, no for one node alone."""
    dynamic_rendezvous._delay = _TORCH_DELAY if skew else _delay_without_skew
