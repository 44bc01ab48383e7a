"""New SQLite databases copied from a template instead of migrated again.

Prefect's server and MLflow's store each build a new SQLite database by running their
whole migration history: seconds of CPU for a file that is the same every time for one
version of the tool. The first database a machine gets is kept (without what belongs to
its project) in gradline's cache, and later new databases start as copies of it; the
tool still checks the copy as it checks any database it opens (the migration head).
flows/prefect_database.py and training/mlops/store_template.py say what each keeps.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_DIR_ENV = "GRADLINE_CACHE_DIR"


def cache_dir() -> Path:
    """gradline's per-user cache: GRADLINE_CACHE_DIR, else gradline/ in the user's cache."""
    if configured := os.environ.get(CACHE_DIR_ENV):
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gradline"


def seed_from(template: Path, database: Path) -> bool:
    """Give `database`, when it does not exist yet, the template's content; whether it
    did. Never replaces a database: one that appeared meanwhile (another process
    creating it) is kept, since it may be open already."""
    if database.exists() or not template.is_file():
        return False
    database.parent.mkdir(parents=True, exist_ok=True)
    staged = _staged_copy(template, database.parent)
    try:
        os.link(staged, database)  # fails, changing nothing, if the database exists now
    except FileExistsError:
        return False
    finally:
        staged.unlink()
    return True


def save_as_template(
    database: Path, template: Path, scrub: Callable[[sqlite3.Connection], None]
) -> None:
    """Keep a copy of the just-created `database`, less what `scrub` deletes from it, as
    `template` (whole or not at all); a template that cannot be written only costs the
    next new database its migrations."""
    if template.is_file():
        return
    with contextlib.suppress(OSError, sqlite3.Error):
        template.parent.mkdir(parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(dir=template.parent, suffix=".part")
        os.close(descriptor)
        staged = Path(name)
        try:
            # SQLite's backup: a consistent copy of a database a process has open.
            with (
                contextlib.closing(sqlite3.connect(database)) as source,
                contextlib.closing(sqlite3.connect(staged)) as copy,
            ):
                source.backup(copy)
                scrub(copy)
                copy.commit()
                copy.execute("VACUUM")  # without the pages the backup left free
                if copy.execute("PRAGMA quick_check").fetchone() != ("ok",):
                    return
            os.replace(staged, template)
        finally:
            staged.unlink(missing_ok=True)


def _staged_copy(template: Path, folder: Path) -> Path:
    """A private copy of `template` in `folder` (the database's own file system, so that
    it can become the database with a link)."""
    staged = folder / f".db-template-{secrets.token_hex(8)}.part"
    # Made as the tool would make the database itself: the user's umask decides its mode.
    descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(descriptor, "wb") as out, template.open("rb") as source:
        while chunk := source.read(1 << 20):
            out.write(chunk)
    return staged
