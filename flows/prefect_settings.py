"""Prefect settings read without importing Prefect, which alone costs about a second:
what a command needs to know before it starts (or does not start) a server."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

# Where prefect.toml and pyproject's [tool.prefect] keep a setting named by its
# environment variable (the two database names are aliases of one setting).
_TOML_KEYS = {
    "PREFECT_API_URL": ("api", "url"),
    "PREFECT_SERVER_DATABASE_CONNECTION_URL": ("server", "database", "connection_url"),
    "PREFECT_API_DATABASE_CONNECTION_URL": ("server", "database", "connection_url"),
}


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()


def prefect_setting_configured(name: str) -> bool:
    """Whether Prefect's setting `name` (PREFECT_API_URL, ...) is set: in the environment,
    the active profile, a prefect.toml, pyproject's [tool.prefect] or a .env here."""
    if os.environ.get(name):
        return True
    default_profiles = prefect_home() / "profiles.toml"
    profiles = _toml(Path(os.environ.get("PREFECT_PROFILES_PATH", default_profiles)).expanduser())
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral")
    if profiles.get("profiles", {}).get(active, {}).get(name):
        return True
    keys = _TOML_KEYS[name]
    if _nested(_toml(Path("prefect.toml")), keys):
        return True
    if _nested(_toml(Path("pyproject.toml")), ("tool", "prefect", *keys)):
        return True
    dotenv = Path(".env")
    return dotenv.is_file() and name in dotenv.read_text(errors="replace")


def _nested(table: dict, keys: tuple[str, ...]) -> object:
    for key in keys:
        table = table.get(key) if isinstance(table, dict) else None
    return table


def _toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}
