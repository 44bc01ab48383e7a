"""Helpers shared by the benchmark scripts (not imported by gradline itself)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from pathlib import Path

from training.config import DataConfig, ShardConfig
from training.data.ingest import ingest
from training.data.shards import write_shards

REPO = Path(__file__).resolve().parents[1]
# Run outputs that a checkout may hold but a fresh clone does not.
GENERATED = {"dvc.lock", "metrics.json", "result.json", "data/ingest.json"}


def use_throwaway_signing_key() -> None:
    """Benchmarks keep their jobs in temporary folders outside any project, where only
    GRADLINE_SIGNING_KEY gives checkpoints a key (training.signing): one made for this
    process, never stored, unless one is set."""
    os.environ.setdefault("GRADLINE_SIGNING_KEY", os.urandom(32).hex())


def copy_project(root: Path) -> Path:
    """A fresh copy of the project's files (as a clone would have them) in its own git repo."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for rel in listed:
        if rel not in GENERATED and (REPO / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, root / rel)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run([*git, "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "clone"], cwd=root, check=True)
    return root


def make_synthetic_shards(
    folder: Path, rows: int, row_bytes: int, shard_mb: float = 64.0
) -> tuple[Path, Path]:
    """Synthetic rows of about `row_bytes` bytes (float32 features) through the real
    ingest and shard stages. Returns (raw_dir, shard_dir)."""
    features = max(1, row_bytes // 4)
    cfg = DataConfig(source="synthetic", synthetic_rows=rows, synthetic_shape=[features])
    raw, shards = folder / "raw", folder / "shards"
    ingest(cfg, folder, raw, folder / "quarantine", folder / "ingest.json")
    write_shards(ShardConfig(target_shard_mb=shard_mb), raw, shards, "benchmark")
    return raw, shards


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def fmt(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4g}"


def launch_local(fn, world_size: int, *args) -> dict[int, object]:
    """Run `fn(*args)` on `world_size` local ranks under torch elastic (c10d rendezvous on
    127.0.0.1, no restarts); return each rank's return value."""
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from training.engine.launch import free_port

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"bench-{uuid.uuid4().hex[:6]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        start_method="spawn",
    )
    return elastic_launch(config, fn)(*args)
