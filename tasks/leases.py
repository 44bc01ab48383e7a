"""Device-slot leases that cannot leak.

A run holds its device slots through a Prefect concurrency lease that it renews while it
lives. gradline keeps leases on disk (`PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE` set to
Prefect's filesystem storage in flows/environment.py), so they outlive a restart of the
server, and a lease whose holder stopped renewing it (killed, its machine gone) lapses:
a full Prefect server's repossessor service then gives its slots back.

The temporary server a `gradline run` starts when PREFECT_API_URL is unset runs no
repossessor, yet every temporary server shares one database: a killed run's slots
would stay taken there for good. `reclaim_lapsed_slots` does the repossessor's work for
it, with Prefect's own revocation, when a run finds the slots it needs taken (free
slots are taken at once: the clean-up imports Prefect's server package, about a second).
"""

from __future__ import annotations

from uuid import UUID

from prefect.settings import get_current_settings
from prefect.utilities.asyncutils import run_coro_as_sync

from tasks.prefect_api import lasting_api_url


def local_leases() -> bool:
    """Whether this process reads the same lease storage as the server: the temporary
    server's, or a server on this machine sharing PREFECT_HOME (`gradline ui`)."""
    return get_current_settings().server.concurrency.lease_storage.endswith(".filesystem")


def reclaim_lapsed_slots() -> int:
    """Give back the slots of every lapsed lease; how many leases were revoked.

    Only for the temporary server: a full server's repossessor already does this, and
    revoking twice would give the same slots back twice.
    """
    if not _reclaims_here():
        return 0
    return run_coro_as_sync(_revoke_lapsed())


def _reclaims_here() -> bool:
    """A temporary server (no repossessor) whose leases this process can read."""
    return not lasting_api_url() and local_leases()


async def _revoke_lapsed() -> int:
    # Deferred: the server package is heavy and only a temporary server needs this.
    from prefect.server.concurrency.lease_storage import get_concurrency_lease_storage
    from prefect.server.database import provide_database_interface
    from prefect.server.services.repossessor import revoke_expired_lease

    storage = get_concurrency_lease_storage()
    lapsed = await storage.read_expired_lease_ids()
    for lease_id in lapsed:
        await revoke_expired_lease(lease_id, db=provide_database_interface(), lease_storage=storage)
    return len(lapsed)


def holders(limit_id: UUID) -> list[str]:
    """Who holds slots of the limit: 'flow_run <id>' per live lease, when this process
    can read the server's leases; empty when it cannot (a remote server)."""
    if not local_leases():
        return []

    async def read() -> list[str]:
        from prefect.server.concurrency.lease_storage import get_concurrency_lease_storage

        found = await get_concurrency_lease_storage().list_holders_for_limit(limit_id)
        return [f"{holder.type} {holder.id}" for _, holder in found]

    return run_coro_as_sync(read())
