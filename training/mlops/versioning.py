"""Ask DVC's records, never recompute them: the data version is DVC's md5 of data/raw."""

from __future__ import annotations

from pathlib import Path

from training.config.loading import safe_load
from training.errors import ProjectError


def locked_md5(dvc_lock: Path, stage: str, out: str) -> str:
    """The md5 that dvc.lock records for output `out` of `stage`."""
    if not dvc_lock.is_file():
        raise ProjectError(
            f"{dvc_lock} not found: run the pipeline through DVC (`dvc repro` or "
            "`gradline run`) so the data version is recorded"
        )
    lock = safe_load(dvc_lock.read_text()) or {}
    for entry in lock.get("stages", {}).get(stage, {}).get("outs", []):
        if entry.get("path") == out:
            return entry["md5"]
    raise ProjectError(f"{dvc_lock} records no output {out!r} of stage {stage!r}; run dvc repro")


def data_version(root: Path) -> str:
    return locked_md5(root / "dvc.lock", "ingest", "data/raw")
