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

The block types a server registers as it starts depend only on Prefect's version and the
installed Prefect collections (it imports each collection to find its block types). The
template is named by both, and a database seeded from it, or one a temporary server has
since registered them in, is marked with them (a file beside it). A temporary server on a
database so marked skips the registration: ~1 s of CPU per start, ~2 s where a
collection such as prefect-kubernetes is installed, for rows that are there already.
Another Prefect version or collection set misses the mark, and that server registers
them again (and the mark follows).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import sqlite3
from dataclasses import dataclass
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


# What a Prefect server is told so as to leave its block types as they are: not registered
# at start, nor the collections imported to compare them with its memo of the last time.
SKIP_BLOCK_REGISTRATION = {
    "PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
    "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false",
}


@functools.cache  # what is installed does not change under a command (~10 ms a read)
def block_types_key() -> str:
    """What decides the block types a Prefect server registers: Prefect's version and each
    installed collection (its entry point and distribution), read from the packages'
    metadata without importing them."""
    collections = sorted(
        f"{point.name}={point.dist.name if point.dist else ''} "
        f"{point.dist.version if point.dist else ''}"
        for point in importlib.metadata.entry_points(group="prefect.collections")
    )
    return "\n".join([f"prefect {importlib.metadata.version('prefect')}", *collections]) + "\n"


def template_path() -> Path:
    digest = hashlib.sha256(block_types_key().encode()).hexdigest()[:12]
    return cache_dir() / f"prefect-{importlib.metadata.version('prefect')}-{digest}.db"


def seed_database(database: Path | None) -> bool:
    """Give `database`, when it does not exist yet, the template's content (and its mark:
    the block types are there); whether it did. Never replaces a database: one that
    appeared meanwhile (another server on the same new home) is kept, since a server may
    already have it open."""
    if database is None or not seed_from(template_path(), database):
        return False
    mark_block_types_registered(database)
    return True


def block_types_mark(database: Path) -> Path:
    return database.with_name(database.name + ".block-types")


def mark_block_types_registered(database: Path) -> None:
    """Note that `database` holds the block types of this Prefect and its collections (a
    server registered them in it, or it was seeded from a template that has them). A mark
    that cannot be written only costs the next server the registration."""
    mark = block_types_mark(database)
    staged = mark.with_name(f".{mark.name}.{os.getpid()}.part")
    try:
        staged.write_text(block_types_key())
        os.replace(staged, mark)
    except OSError:
        staged.unlink(missing_ok=True)


def block_registration_settings(database: Path | None) -> dict[str, str]:
    """The settings for a server about to start on `database`: none where it must
    register the block types (a database it creates, or one not marked with this Prefect
    and its collections) or the user set either; else those that skip it."""
    if database is None or any(name in os.environ for name in SKIP_BLOCK_REGISTRATION):
        return {}
    mark = block_types_mark(database)
    if not database.exists() or not mark.is_file() or mark.read_text() != block_types_key():
        return {}
    return dict(SKIP_BLOCK_REGISTRATION)


@dataclass
class ServerDatabase:
    """PREFECT_HOME's database made ready for a Prefect server about to start on it, and
    what is left to do once that server answers."""

    path: Path | None
    settings: dict[str, str]  # for the server's environment (block_registration_settings)
    creates: bool  # the server makes it: kept as the template once it answers
    registers: bool  # the server registers the block types: marked so once it answers

    @classmethod
    def prepare(cls, path: Path | None) -> ServerDatabase:
        creates = seeded_or_to_create(path)
        settings = block_registration_settings(path)
        return cls(path, settings, creates, registers=path is not None and not settings)

    def server_answers(self) -> None:
        """The server answers: migrated, its block types registered, nothing run yet."""
        if self.creates and self.path is not None:
            save_template(self.path)
        if self.registers and self.path is not None:
            mark_block_types_registered(self.path)
        self.creates = self.registers = False


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
