"""What gradline leaves out of torch's elastic rendezvous (training/engine/rendezvous_costs.py):
the events keep their names when they are taken from the frame instead of from
`inspect.stack()`, and a one-node launch skips the first round's random pause while a
multi-node one keeps it."""

from __future__ import annotations

import inspect
import time

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from training.engine.rendezvous_costs import caller_name, skew_first_round, use_frame_names

TORCH_GET_METHOD_NAME = dynamic_rendezvous.get_method_name


def _record(name_of):
    """Stands for a rendezvous' `_record`: names the method that called it."""
    return name_of()


def next_rendezvous(name_of):
    return _record(name_of)


def test_the_frame_gives_the_name_inspect_stack_gives() -> None:
    original = inspect.getsource(TORCH_GET_METHOD_NAME)
    assert "inspect.stack()" in original or TORCH_GET_METHOD_NAME is caller_name
    if TORCH_GET_METHOD_NAME is not caller_name:
        assert next_rendezvous(TORCH_GET_METHOD_NAME) == "next_rendezvous"
    assert next_rendezvous(caller_name) == "next_rendezvous"
    assert caller_name(0) == "caller_name" and caller_name(1) == inspect.stack()[0].function
    assert caller_name(10_000) == "no_method_name"


def test_launching_names_events_from_frames() -> None:
    use_frame_names()
    assert dynamic_rendezvous.get_method_name is caller_name
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    events: list[str] = []

    def record(name, **_):
        events.append(name)

    real = dynamic_rendezvous.construct_and_record_rdzv_event
    dynamic_rendezvous.construct_and_record_rdzv_event = record
    try:
        fake = type("Fake", (handler,), {"__init__": lambda self: None})()
        fake._settings = type("S", (), {"run_id": "job"})()
        fake._this_node = type("N", (), {"addr": "host", "pid": 1, "local_id": 0})()

        def shutdown_like(self):
            self._record(message="closing")

        shutdown_like(fake)
    finally:
        dynamic_rendezvous.construct_and_record_rdzv_event = real
    assert events == ["Fake.shutdown_like"]


def test_one_node_skips_the_first_rounds_random_pause_and_many_nodes_keep_it(monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)  # torch's _delay sleeps through time
    try:
        skew_first_round(False)
        dynamic_rendezvous._delay(seconds=(0.2, 0.3))  # the first round's skew
        dynamic_rendezvous._delay(seconds=1)  # polling for the state: still waits
        assert slept == [1]
        skew_first_round(True)
        dynamic_rendezvous._delay(seconds=(0.2, 0.3))
        assert len(slept) == 2 and 0.2 <= slept[1] <= 0.3
    finally:
        skew_first_round(True)


def test_the_first_round_is_the_only_random_pause_torch_asks_for() -> None:
    """The patch assumes torch's rendezvous asks `_delay` for a random range only before
    its first round: a torch that asks elsewhere would lose that pause too."""
    source = inspect.getsource(dynamic_rendezvous)
    assert source.count("_delay(seconds=(") == 1
    assert "if self._state_holder.state.round == 0:\n                _delay(seconds=(0, 0.3))" in (
        source
    )
