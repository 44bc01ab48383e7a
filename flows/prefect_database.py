"""A new PREFECT_HOME's database, copied from one Prefect made before instead of migrated
again.

A Prefect server on a home without a database creates it by running every Alembic
migration of Prefect's history (115 in Prefect 3.9, many rebuilding a table, each
statement a thread hop through aiosqlite): ~6 s of CPU, and 10 s or more of wall time
before the first run of a new home can begin. The result is the same file each time for
one Prefect version: its tables, the migration head, and the block types Prefect
registers at start.

So the first server this machine starts on a new home leaves a copy of that database
(training/database_template.py),
taken the moment it answers and before anything runs on it, in gradline's cache
(`~/.cache/gradline/`, or $XDG_CACHE_HOME/gradline, or $GRADLINE_CACHE_DIR), named by
Prefect's version. A later server on another new home starts from a copy of it. Prefect
still checks it at start: it runs its migrations (none left to apply) and registers its
block types, as on any database.

Only the default database is seeded: SQLite in PREFECT_HOME, no connection URL set. What
a run leaves in its own database never goes into the copy: the copy is taken before the
run's flow starts, and without the server's telemetry session (the `configuration`
table, which a fresh database does not have).
"""

from __future__ import annotations

import importlib.metadata
import sqlite3
from pathlib import Path

from flows.prefect_settings import prefect_home, prefect_setting_configured
from training.database_template import cache_dir, save_as_template, seed_from

DATABASE_URL_SETTINGS = (
    "PREFECT_API_DATABASE_CONNECTION_URL",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL",
)


def default_database() -> Path | None:
    """The SQLite file a Prefect server started here would use, when it is Prefect's
    default (no connection URL configured); None otherwise."""
    if any(prefect_setting_configured(name) for name in DATABASE_URL_SETTINGS):
        return None
    return prefect_home() / "prefect.db"


def template_path() -> Path:
    return cache_dir() / f"prefect-{importlib.metadata.version('prefect')}.db"


def seed_database(database: Path | None) -> bool:
    """Give `database`, when it does not exist yet, the template's content; whether it
    did. Never replaces a database: one that appeared meanwhile (another server on the
    same new home) is kept, since a server may already have it open."""
    return database is not None and seed_from(template_path(), database)


def seeded_or_to_create(database: Path | None) -> bool:
    """Seed `database` where it is new and a template exists; whether a server starting on
    it now will create it instead (and should leave the template once it answers)."""
    return database is not None and not database.exists() and not seed_database(database)


def save_template(database: Path) -> None:
    """Keep a copy of the just-created `database` as the template, without the server's
    telemetry session."""
    save_as_template(database, template_path(), _without_telemetry_session)


def _without_telemetry_session(copy: sqlite3.Connection) -> None:
    copy.execute("DELETE FROM configuration")
