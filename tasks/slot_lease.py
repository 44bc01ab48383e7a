"""Device slots held through a lease that outlives a Prefect outage.

A training job takes its slots of the device quota with a lease and renews it while it
trains. Prefect's own keeper gives up after three failed renewals: past a server outage
longer than the lease (60 s), the lease lapses, the server gives its slots back, and
the next run starts on devices this job is still using. This keeper never gives up: a
renewal the server refuses because the lease is gone (410) is followed by taking the
slots again; when another run has taken them meanwhile, it says so (the quota is
oversubscribed until one of the two ends) and tries again at every renewal.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Iterator
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.client.schemas.responses import ConcurrencyLimitWithLeaseResponse
from prefect.exceptions import PrefectHTTPStatusError

LOCKED, GONE = 423, 410
# Waits between tries while all the slots are taken, unless the server names its own.
RETRY_S = 1.0


class SlotLease:
    """`slots` slots of the limit `limit`, held by `holder` through a renewed lease."""

    def __init__(
        self,
        limit: str,
        slots: int,
        lease_s: float,
        holder: ConcurrencyLeaseHolder | None,
        log: logging.Logger | logging.LoggerAdapter,
        renew_every_s: float | None = None,
    ) -> None:
        self.limit, self.slots, self.lease_s, self.holder, self.log = (
            limit,
            slots,
            lease_s,
            holder,
            log,
        )
        # A third of the lease: two renewals may fail before it lapses.
        self.renew_every_s = renew_every_s or lease_s / 3
        self.lease_id: UUID | None = None
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._said_taken = False  # "another run took them" is said once per lapse

    def take_if_free(self) -> bool:
        """One request for the slots: whether they were free (and are now held)."""
        return self._try_take() is None

    def take(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the slots; TimeoutError if they stay taken."""
        deadline = time.monotonic() + timeout_s
        while (wait := self._try_take()) is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.slots} slots of {self.limit!r} still taken")
            time.sleep(min(wait, left))

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Renew (or take again) the lease while the block runs; give the slots back."""
        # The keeper runs in a copy of this context: Prefect's settings (the temporary
        # server's address among them) live in context variables.
        context = contextvars.copy_context()
        self._keeper = threading.Thread(
            target=context.run, args=(self._keep,), name="gradline-slot-lease", daemon=True
        )
        self._keeper.start()
        try:
            yield
        finally:
            with self._guard:
                self._stop.set()
                lease, self.lease_id = self.lease_id, None
            if lease is not None:
                self._release(lease)

    def _try_take(self) -> float | None:
        """One request for the slots: None when taken, else seconds to wait first."""
        with get_client(sync_client=True) as client:
            try:
                response = client.increment_concurrency_slots_with_lease(
                    names=[self.limit],
                    slots=self.slots,
                    mode="concurrency",
                    lease_duration=self.lease_s,
                    holder=self.holder,
                )
            except PrefectHTTPStatusError as exc:
                if exc.response.status_code != LOCKED:
                    raise
                return float(exc.response.headers.get("Retry-After", RETRY_S))
        granted = ConcurrencyLimitWithLeaseResponse.model_validate(response.json())
        with self._guard:
            if self._stop.is_set():  # the job ended while the request was on its way
                stale = granted.lease_id
            else:
                stale, self.lease_id = None, granted.lease_id
        if stale is not None:
            self._release(stale)
        return None

    def _keep(self) -> None:
        unreachable = False
        while not self._stop.wait(self.renew_every_s):
            try:
                self._renew_or_take_back()
                if unreachable:
                    self.log.info("Prefect answers again: device slots still held")
                unreachable = False
            except (httpx.TransportError, PrefectHTTPStatusError) as exc:
                if not unreachable:
                    self.log.warning(
                        "cannot renew the lease on %d device slots of %r (%s: %s): "
                        "training goes on; the slots are taken again when Prefect answers",
                        self.slots,
                        self.limit,
                        type(exc).__name__,
                        exc,
                    )
                unreachable = True

    def _renew_or_take_back(self) -> None:
        lease = self.lease_id
        if lease is not None:
            with get_client(sync_client=True) as client:
                try:
                    client.renew_concurrency_lease(lease_id=lease, lease_duration=self.lease_s)
                    return
                except PrefectHTTPStatusError as exc:
                    if exc.response.status_code != GONE:
                        raise
            with self._guard:
                if self.lease_id == lease:
                    self.lease_id = None
            self.log.warning(
                "the lease on %d device slots of %r lapsed (Prefect was unreachable for "
                "longer than %g s): taking them again",
                self.slots,
                self.limit,
                self.lease_s,
            )
            self._said_taken = False
        if self._try_take() is None:
            self.log.warning("device slots of %r held again", self.limit)
        elif not self._said_taken:
            self._said_taken = True
            self.log.warning(
                "another run took the device slots of %r while this job trains on them: "
                "the quota is oversubscribed until one of the two ends; asking again every "
                "%g s",
                self.limit,
                self.renew_every_s,
            )

    def _release(self, lease: UUID) -> None:
        try:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(lease)
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code not in (404, GONE):
                raise
            # Gone already: the server gave the slots back when the lease lapsed.
        except httpx.TransportError as exc:
            self.log.warning(
                "could not give back %d device slots of %r (%s): the server frees them "
                "when the lease lapses, %g s from the last renewal",
                self.slots,
                self.limit,
                exc,
                self.lease_s,
            )
