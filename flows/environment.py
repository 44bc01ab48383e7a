"""The environment every gradline command starts from: defaults that make the embedded
stack work offline (a user's own settings win), and tracking credentials kept out of URIs."""

from __future__ import annotations

import os
import urllib.parse

from training.mlops.tracking import redact_uri

LEASES_ON_DISK = "prefect.server.concurrency.lease_storage.filesystem"

OFFLINE_DEFAULTS = {
    # Telemetry calls fail (and log errors) without network.
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    # A fresh ephemeral Prefect API needs ~10 s on 2 idle cores (~12 CPU-s), the default
    # allows 20; on a 2-core host busy with other work it can take minutes.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
    # Leases on device slots kept on disk: they outlive a server restart and lapse when
    # their holder stops renewing them, so no kill or restart leaves slots taken
    # (tasks/leases.py).
    "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": LEASES_ON_DISK,
    # What the server's automations have seen is kept in its database, so an event after
    # a restart (a dead run marked Crashed) is not held back waiting for one before it.
    "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect.server.events.ordering.db",
    # A Prefect server restarting or down for a while is waited out, not fatal: the
    # client retries a lost connection with doubling waits, 2 s to 512 s (~17 minutes).
    "PREFECT_CLIENT_MAX_RETRIES": "9",
    # Flow runs tell the server they live (every 30 s, Prefect's minimum); silence marks
    # them Crashed (tasks/watchdog.py).
    "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
    # Tiny CPU workers share the cores; one intra-op thread each unless told otherwise.
    "OMP_NUM_THREADS": "1",
}


def apply_offline_defaults() -> None:
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
    move_uri_credentials(os.environ)


def move_uri_credentials(environ) -> None:
    """`MLFLOW_TRACKING_URI=http://user:pw@host` works with MLflow, but MLflow itself prints
    that URI in its "View run at" links, and gradline's stages pass it on. Move the user
    and password into MLFLOW_TRACKING_USERNAME/PASSWORD (which win over the URI's, in
    MLflow too, when both are set) and leave the URI without them, before anything runs."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        parts = urllib.parse.urlsplit(environ.get(name, ""))
        if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
            continue
        if parts.username:
            environ.setdefault("MLFLOW_TRACKING_USERNAME", urllib.parse.unquote(parts.username))
        if parts.password:
            environ.setdefault("MLFLOW_TRACKING_PASSWORD", urllib.parse.unquote(parts.password))
        environ[name] = redact_uri(environ[name])
