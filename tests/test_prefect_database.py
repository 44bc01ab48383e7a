"""A new PREFECT_HOME's database comes from the template the first new home's server
left (flows/prefect_database.py): never over an existing database, never for a database
Prefect is told to keep elsewhere, never with a run's rows; and a server on a seeded
home answers and keeps what it is given."""

from __future__ import annotations

import importlib.metadata
import json
import sqlite3
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows import prefect_database
from flows.prefect_database import (
    SKIP_BLOCK_REGISTRATION,
    block_registration_settings,
    block_types_key,
    block_types_mark,
    default_database,
    mark_block_types_registered,
    save_template,
    seed_database,
    template_path,
)
from flows.temporary_server import TemporaryServer
from tasks.prefect_api import TEMPORARY_SERVER_ENV
from training.database_template import CACHE_DIR_ENV


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Iterator[Path]:
    """An empty gradline cache and an empty PREFECT_HOME, nothing configured; the
    installed collections read afresh (a test may pretend to install one)."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    for name in ("PREFECT_API_URL", TEMPORARY_SERVER_ENV, *prefect_database.DATABASE_URL_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    block_types_key.cache_clear()
    yield tmp_path / "cache"
    block_types_key.cache_clear()


def _database(path: Path, configuration: bool = True) -> Path:
    """A small SQLite database with a telemetry session, as a started server leaves."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE alembic_version (version_num TEXT)")
        db.execute("INSERT INTO alembic_version VALUES ('head')")
        db.execute("CREATE TABLE configuration (key TEXT, value TEXT)")
        if configuration:
            db.execute("INSERT INTO configuration VALUES ('TELEMETRY_SESSION', '{}')")
    return path


def _rows(path: Path, table: str) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return db.execute(f"SELECT * FROM {table}").fetchall()


def test_the_template_keeps_the_schema_and_not_the_telemetry_session(own_cache) -> None:
    save_template(_database(own_cache.parent / "made" / "prefect.db"))
    template = template_path()
    assert template.parent == own_cache and template.name.startswith("prefect-3.")
    assert _rows(template, "alembic_version") == [("head",)]
    assert _rows(template, "configuration") == []
    assert list(own_cache.iterdir()) == [template]  # nothing half-written beside it


def test_a_template_that_cannot_be_read_is_not_kept(own_cache) -> None:
    broken = own_cache.parent / "broken.db"
    broken.write_bytes(b"not a database" * 100)
    save_template(broken)
    assert not template_path().exists()
    assert list(own_cache.iterdir()) == []


def test_a_new_home_is_seeded_an_existing_database_never_replaced(own_cache) -> None:
    database = default_database()
    assert database == own_cache.parent / "home" / "prefect.db"
    assert not seed_database(database) and not database.exists()  # no template yet
    save_template(_database(own_cache.parent / "made" / "prefect.db"))
    assert seed_database(database)
    assert _rows(database, "alembic_version") == [("head",)]
    assert sorted(p.name for p in database.parent.iterdir()) == [
        "prefect.db",
        "prefect.db.block-types",  # its block types are there (the template's)
    ]

    other = _database(own_cache.parent / "other" / "prefect.db", configuration=True)
    before = other.read_bytes()
    assert not seed_database(other)
    assert other.read_bytes() == before


def test_block_types_are_registered_wherever_they_may_be_missing(own_cache, monkeypatch) -> None:
    database = default_database()
    assert block_registration_settings(database) == {}  # none yet: the server makes it
    save_template(_database(own_cache.parent / "made" / "prefect.db"))
    assert seed_database(database)  # from the template: marked with its block types
    assert block_registration_settings(database) == SKIP_BLOCK_REGISTRATION
    block_types_mark(database).write_text("prefect 3.0.0\n")  # another Prefect made them
    assert block_registration_settings(database) == {}
    mark_block_types_registered(database)  # as a server that registered them leaves it
    assert block_registration_settings(database) == SKIP_BLOCK_REGISTRATION
    monkeypatch.setenv("PREFECT_SERVER_REGISTER_BLOCKS_ON_START", "true")
    assert block_registration_settings(database) == {}  # the user's own say wins

    # A collection installed since (its entry point): another key, another template, and
    # the databases marked before register again.
    template = template_path()
    installed = importlib.metadata.entry_points(group="prefect.collections")
    extra = importlib.metadata.EntryPoint("prefect_extra", "prefect_extra", "prefect.collections")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [*installed, extra])
    block_types_key.cache_clear()  # as a new command would read them
    monkeypatch.delenv("PREFECT_SERVER_REGISTER_BLOCKS_ON_START")
    assert template_path() != template and template_path().parent == template.parent
    assert block_registration_settings(database) == {}


@pytest.mark.parametrize(
    ("where", "text"),
    [
        ("env", ""),
        ("prefect.toml", '[server.database]\nconnection_url = "postgresql+asyncpg://db/p"\n'),
        ("pyproject.toml", '[tool.prefect.server.database]\nconnection_url = "sqlite:///x"\n'),
    ],
)
def test_a_database_configured_elsewhere_is_left_alone(own_cache, monkeypatch, where, text):
    if where == "env":
        monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", "sqlite+aiosqlite:///x.db")
    else:
        Path(where).write_text(text)
    assert default_database() is None
    assert not seed_database(default_database())


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_first_new_home_leaves_the_template_and_the_next_starts_from_it(
    own_cache, tmp_path, monkeypatch
) -> None:
    first = _started(tmp_path / "first-home", monkeypatch)
    try:
        assert not first.database.creates  # made, and kept as the template
    finally:
        first.stop()
    template = template_path()
    made = tmp_path / "first-home" / "prefect.db"
    assert _rows(template, "alembic_version") == _rows(made, "alembic_version")
    assert len(_rows(template, "block_type")) == len(_rows(made, "block_type")) > 0
    assert _rows(template, "configuration") == []

    # The first server registered the block types (and left Prefect's memo of them):
    # its database is marked with what they depend on.
    assert (tmp_path / "first-home" / "memo_store.toml").is_file()
    assert _mark(made) == block_types_key()

    second_home = tmp_path / "second-home"
    monkeypatch.setenv("PREFECT_HOME", str(second_home))
    assert seed_database(default_database())
    assert _mark(second_home / "prefect.db") == block_types_key()
    second = _started(second_home, monkeypatch)
    try:
        # Started without registering them (no memo: the collections were not even
        # imported to compare), and every block type a run uses is there.
        assert second.database.settings == SKIP_BLOCK_REGISTRATION
        assert not (second_home / "memo_store.toml").exists()
        slugs = {t["slug"] for t in _post(second.api_url + "/block_types/filter", {})}
        assert {"webhook", "secret"} <= slugs and len(slugs) == len(_rows(made, "block_type"))
        flow = _post(second.api_url + "/flows/", {"name": "seeded-home"})
        assert _post(second.api_url + "/flows/filter", {})[0]["id"] == flow["id"]
    finally:
        second.stop()
    assert [name for (name,) in _names(second_home / "prefect.db")] == ["seeded-home"]
    assert _names(template) == []  # what ran on a seeded home stays there


def _mark(database: Path) -> str:
    return block_types_mark(database).read_text()


def _started(home: Path, monkeypatch) -> TemporaryServer:
    monkeypatch.setenv("PREFECT_HOME", str(home))
    server = TemporaryServer()
    server.start()
    server.wait_until_ready()
    return server


def _names(database: Path) -> list[tuple]:
    with sqlite3.connect(database) as db:
        return db.execute("SELECT name FROM flow").fetchall()


def _post(url: str, body: dict):
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())
