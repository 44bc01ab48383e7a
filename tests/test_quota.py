"""The device quota (tasks/quota.py) against a real Prefect server: free slots are taken
with one request, and only slots that are taken start the clean-up of dead runs' leases
(on a temporary server, a second of imports and a read of every lease)."""

from __future__ import annotations

import logging
import secrets

import pytest
from prefect import flow
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

from tasks import quota
from tasks.slot_lease import SlotLease
from tests.servers import SharedPrefect
from training.config.loading import validate

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_free_slots_skip_the_clean_up_and_taken_ones_run_it_before_waiting(
    monkeypatch, tmp_path
) -> None:
    limit = f"gradline-quota-{secrets.token_hex(4)}"
    cfg = validate(
        {
            "orchestrate": {"device_limit": limit, "device_slots": 1, "quota_wait_s": 1},
            "runtime": {"procs_per_node": 1},
        },
        "the test",
    )
    clean_ups = []
    monkeypatch.setattr(quota, "reclaim_lapsed_slots", lambda: clean_ups.append(1) or 0)

    @flow
    def train_with_the_slots() -> int:
        with quota.device_slots(cfg) as held:
            return held

    # The flows run in this process: their Prefect home is the test's, not the user's.
    settings = {PREFECT_API_URL: SharedPrefect.api(), PREFECT_HOME: tmp_path / "prefect"}
    with temporary_settings(settings):
        assert train_with_the_slots() == 1
        assert clean_ups == []  # the slot was free: taken at once
        rival = SlotLease(limit, 1, 600, None, logging.getLogger("rival"))  # outlasts the test
        assert rival.take_if_free()  # the flow gave its slot back
        try:
            with pytest.raises(quota.QuotaWaitExpired, match=limit):
                train_with_the_slots()
            assert clean_ups  # taken: dead runs' leases are looked for before waiting
        finally:
            rival._release(rival.lease_id)
