"""Where a gradline project begins: the nearest folder holding both params.yaml and
dvc.yaml. A module of its own so that the base layer (checkpoint signing) and the
project layer find the same root by the same rule."""

from __future__ import annotations

from pathlib import Path

PROJECT_MARKERS = ("params.yaml", "dvc.yaml")


def project_root_at_or_above(start: Path) -> Path | None:
    """The nearest folder at or above `start` that holds every marker, or None."""
    here = start.resolve()
    for candidate in (here, *here.parents):
        if all((candidate / marker).is_file() for marker in PROJECT_MARKERS):
            return candidate
    return None
