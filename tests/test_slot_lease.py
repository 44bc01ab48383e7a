"""A job's device slots stay held across a Prefect server outage longer than their lease,
and come back to the quota when the job ends: against a real Prefect server stopped
for longer than the lease and started again (its repossessor frees lapsed leases)."""

from __future__ import annotations

import logging
import time

import pytest
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from tasks.slot_lease import SlotLease
from tests.servers import running_prefect_server, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
LEASE_S = 60  # the server's shortest lease


@pytest.fixture
def prefect_server(tmp_path):
    yield from running_prefect_server(tmp_path)


def _rival_gets_the_slot(limit: str) -> bool:
    """Whether another run asking for the one slot gets it within a few seconds."""
    rival = SlotLease(limit, 1, LEASE_S, None, logging.getLogger("rival"))
    try:
        rival.take(timeout_s=3)
    except TimeoutError:
        return False
    rival._release(rival.lease_id)
    return True


def test_slots_stay_held_through_an_outage_longer_than_the_lease(prefect_server, caplog) -> None:
    server, limit = prefect_server, "gradline-outage-devices"
    caplog.set_level(logging.INFO, logger="job")
    # Few client retries: the keeper's renewals fail fast during the outage, as they
    # would after a long one with the defaults.
    with temporary_settings({PREFECT_API_URL: server.api, PREFECT_CLIENT_MAX_RETRIES: 1}):
        with server.client() as client:
            client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=limit, limit=1)
            )
        job = SlotLease(limit, 1, LEASE_S, None, logging.getLogger("job"), renew_every_s=5)
        job.take(timeout_s=10)
        with job.kept():
            assert not _rival_gets_the_slot(limit)
            server.stop()
            time.sleep(LEASE_S + 10)  # the lease lapses while nobody can renew it
            server.start()
            # The server's repossessor frees lapsed leases every 15 s; the keeper renews
            # every 5 s. Whichever comes first, the job must end up holding its slot.
            time.sleep(30)
            wait_for("the job holds its slot", lambda: job.lease_id is not None, 60)
            assert not _rival_gets_the_slot(limit), caplog.text
        # The job ended: its slot is free at once, not after a lease lapses.
        assert _rival_gets_the_slot(limit)
    assert "cannot renew the lease on 1 device slots" in caplog.text
    # Renewed once the server answered, or (revoked first) taken again: said either way.
    assert "device slots still held" in caplog.text or "held again" in caplog.text
