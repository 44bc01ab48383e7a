"""Which Prefect API this process talks to: a server that stays (PREFECT_API_URL set by
the user) or the temporary one a `gradline run` started for itself
(flows/temporary_server.py), which also sets PREFECT_API_URL and says so here."""

from __future__ import annotations

import os

TEMPORARY_SERVER_ENV = "GRADLINE_TEMPORARY_PREFECT"


def lasting_api_url() -> str:
    """The URL of a Prefect server that outlives this command; empty on a temporary
    server (Prefect's own or gradline's)."""
    from prefect.settings import get_current_settings

    if os.environ.get(TEMPORARY_SERVER_ENV):
        return ""
    return get_current_settings().api.url or ""
