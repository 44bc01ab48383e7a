"""Whether `gradline run` has a Prefect server to record a skip in, read without Prefect:
an unchanged rerun with none answers before one would start."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.cli import prefect_api_configured


@pytest.fixture
def bare(tmp_path, monkeypatch) -> Path:
    """No Prefect setting anywhere: an empty PREFECT_HOME, a folder with no files."""
    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_nothing_configured_means_a_temporary_server(bare) -> None:
    assert not prefect_api_configured()


def test_the_environment_points_at_a_server(bare, monkeypatch) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert prefect_api_configured()


def test_the_active_profile_points_at_a_server(bare, monkeypatch) -> None:
    home = bare / "home"
    home.mkdir()
    (home / "profiles.toml").write_text(
        'active = "team"\n[profiles.team]\nPREFECT_API_URL = "http://127.0.0.1:4200/api"\n'
        "[profiles.local]\n"
    )
    assert prefect_api_configured()
    monkeypatch.setenv("PREFECT_PROFILE", "local")  # another profile, with no server
    assert not prefect_api_configured()


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("prefect.toml", '[api]\nurl = "http://127.0.0.1:4200/api"\n'),
        ("pyproject.toml", '[tool.prefect.api]\nurl = "http://127.0.0.1:4200/api"\n'),
        (".env", "PREFECT_API_URL=http://127.0.0.1:4200/api\n"),
    ],
)
def test_project_files_point_at_a_server(bare, name, text) -> None:
    (bare / name).write_text(text)
    assert prefect_api_configured()


def test_a_broken_profiles_file_is_no_server(bare) -> None:
    (bare / "home").mkdir()
    (bare / "home" / "profiles.toml").write_text("not = [toml")
    assert not prefect_api_configured()
