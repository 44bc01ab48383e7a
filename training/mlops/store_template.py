"""A project's new MLflow SQLite store, copied from a template instead of migrated again.

MLflow creates a new SQLite store by running its Alembic migrations (about 1 s of CPU on
2 cores), the first time a project trains, and in every test that makes a store. The
first store this machine creates is kept in gradline's cache (training/database_template.py),
named by MLflow's version, without its experiments: MLflow's `Default` experiment keeps
its artifacts under the project that made it, so the copy has none, and MLflow makes one
under the new project's artifact root when it opens the copy. The tables, the migration
head and the default workspace are the same for every store of one MLflow version.

Only a `sqlite:///` store whose file does not exist yet is seeded; a server's store, or
one that exists, is MLflow's alone.
"""

from __future__ import annotations

import importlib.metadata
import sqlite3
from pathlib import Path

from training.database_template import cache_dir, save_as_template, seed_from

_SQLITE = "sqlite:///"


def template_path() -> Path:
    return cache_dir() / f"mlflow-{importlib.metadata.version('mlflow')}.db"


def new_sqlite_store(tracking_uri: str) -> Path | None:
    """The file of a `sqlite:///` store that does not exist yet; None for any other."""
    if not tracking_uri.startswith(_SQLITE):
        return None
    path = Path(tracking_uri[len(_SQLITE) :].split("?", 1)[0])
    return None if path.exists() else path


def seed_store(database: Path) -> bool:
    """Give the new store `database` the template's tables; whether it did (False: no
    template yet, or the store appeared meanwhile)."""
    return seed_from(template_path(), database)


def save_store_template(database: Path) -> None:
    """Keep the store MLflow just created, less its experiments, as the template."""
    save_as_template(database, template_path(), _without_experiments)


# What only use adds to a store: one of these holding rows is no new store to copy.
_USED_TABLES = ("runs", "registered_models", "model_versions")


def _without_experiments(copy: sqlite3.Connection) -> None:
    for table in _USED_TABLES:
        if copy.execute(f"SELECT EXISTS (SELECT 1 FROM {table})").fetchone()[0]:
            raise sqlite3.DatabaseError(f"the store is in use already ({table}): no template")
    # The Default experiment (its artifact location is the project's) and its tags.
    copy.execute("DELETE FROM experiment_tags")
    copy.execute("DELETE FROM experiments")
