"""A project's new MLflow SQLite store is a copy of the template the machine's first new
store left (training/mlops/store_template.py): with MLflow's tables and migration head,
never another project's experiments, never over an existing store."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from training.database_template import CACHE_DIR_ENV
from training.mlops.store_template import new_sqlite_store, save_store_template, template_path
from training.mlops.tracking import client, ensure_experiment

CREATING = "Creating initial MLflow database tables"


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _rows(path: Path, query: str) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return db.execute(query).fetchall()


def _new_project(tmp_path: Path, name: str, monkeypatch) -> tuple[str, Path]:
    """A project folder (the working directory, where MLflow roots `Default`'s artifacts)
    and its store's URI."""
    project = tmp_path / name
    project.mkdir()
    monkeypatch.chdir(project)
    return f"sqlite:///{project / 'mlflow' / 'mlflow.db'}", project


def test_a_second_new_store_is_the_template_with_its_own_default_experiment(
    own_cache, tmp_path, monkeypatch, capfd
) -> None:
    first_uri, first = _new_project(tmp_path, "first", monkeypatch)
    ensure_experiment(first_uri, "gradline", (first / "artifacts").as_uri())
    assert CREATING in capfd.readouterr().err  # MLflow migrated the first one (its log)
    template = template_path()
    assert template.parent == own_cache and template.name.startswith("mlflow-3.")
    assert _rows(template, "SELECT * FROM experiments") == []  # no project's experiment
    head = _rows(template, "SELECT version_num FROM alembic_version")
    assert head == _rows(first / "mlflow" / "mlflow.db", "SELECT version_num FROM alembic_version")

    second_uri, second = _new_project(tmp_path, "second", monkeypatch)
    experiment = ensure_experiment(second_uri, "gradline", (second / "artifacts").as_uri())
    assert CREATING not in capfd.readouterr().err  # a copy: nothing migrated
    mlflow = client(second_uri)
    default = mlflow.get_experiment("0")
    assert default.artifact_location.startswith(str(second))  # its own, not first's
    assert [e.name for e in mlflow.search_experiments()] == ["gradline", "Default"]
    run = mlflow.create_run(experiment).info.run_id
    mlflow.log_metric(run, "loss", 0.5, step=1)
    assert [m.value for m in mlflow.get_metric_history(run, "loss")] == [0.5]
    assert experiment == "1"  # as in a store MLflow made itself: the first after Default


def test_an_existing_store_or_another_kind_is_left_to_mlflow(own_cache, tmp_path) -> None:
    existing = tmp_path / "kept.db"
    with sqlite3.connect(existing) as db:
        db.execute("CREATE TABLE mine (x INTEGER)")
    assert new_sqlite_store(f"sqlite:///{existing}") is None
    assert new_sqlite_store("http://127.0.0.1:5000") is None
    assert new_sqlite_store(f"file://{tmp_path / 'mlruns'}") is None
    assert new_sqlite_store(f"sqlite:///{tmp_path / 'new.db'}?timeout=5") == tmp_path / "new.db"


def test_a_store_in_use_already_never_becomes_the_template(
    own_cache, tmp_path, monkeypatch
) -> None:
    """A store that someone wrote a run into before it was kept (another process, at
    once) is no template: its run would come with every copy."""
    uri, project = _new_project(tmp_path, "busy", monkeypatch)
    mlflow = client(uri)
    template_path().unlink()  # as if another process had made this store
    mlflow.create_run("0")
    save_store_template(project / "mlflow" / "mlflow.db")
    assert not template_path().exists()
