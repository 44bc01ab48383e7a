"""Defaults that make the embedded stack work offline; a user's own settings win."""

from __future__ import annotations

import os

OFFLINE_DEFAULTS = {
    # Telemetry calls fail (and log errors) without network.
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    # A fresh ephemeral Prefect API needs ~10 s on 2 cores; the default allows 20.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # Tiny CPU workers share the cores; one intra-op thread each unless told otherwise.
    "OMP_NUM_THREADS": "1",
}


def apply_offline_defaults() -> None:
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
