"""Shard and load a synthetic data set larger than half of this machine's memory.

Ingest and shard each run in their own process; their peak resident memory is compared
with the data size, and then random batches are loaded from the shards.
The last line is key=value pairs: data_gb, mem_gb, ingest_peak_rss_gb,
shard_peak_rss_gb, shard_peak_over_data, load_batches, load_samples_per_s.
Usage: python -m benchmarks.shard_scale --folder DIR [--gb 13] [--row-bytes 1024]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import fmt


def _child(step: str, folder: Path, rows: int, row_bytes: int) -> float:
    """Run one step in a fresh process; return its peak RSS in GB."""
    code = (
        "import sys; from pathlib import Path;"
        "from training.config import DataConfig, ShardConfig;"
        "from training.data.ingest import ingest; from training.data.shards import write_shards;"
        f"f = Path({str(folder)!r});"
        f"cfg = DataConfig(source='synthetic', synthetic_rows={rows},"
        f" synthetic_shape=[{row_bytes // 4}]);"
        + (
            "ingest(cfg, f, f / 'raw', f / 'quarantine', f / 'ingest.json')"
            if step == "ingest"
            else "write_shards(ShardConfig(), f / 'raw', f / 'shards', 'scale')"
        )
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run([sys.executable, "-c", code], check=True)
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak_kb <= before:  # RUSAGE_CHILDREN keeps the largest child so far
        print(f"warning: {step} peak not above an earlier step's", file=sys.stderr)
    return peak_kb / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, required=True, help="scratch folder (big disk)")
    parser.add_argument("--gb", type=float, default=13.0)
    parser.add_argument("--row-bytes", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=2000)
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    rows = int(args.gb * 1e9 / args.row_bytes)
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    try:
        started = time.perf_counter()
        ingest_rss = _child("ingest", args.folder, rows, args.row_bytes)
        ingest_s = time.perf_counter() - started
        started = time.perf_counter()
        shard_rss = _child("shard", args.folder, rows, args.row_bytes)
        shard_s = time.perf_counter() - started
        data_gb = sum(p.stat().st_size for p in (args.folder / "shards").iterdir()) / 1e9

        from training.data.loader import RankLoader, open_reader
        from training.data.manifest import read_manifest

        shards = args.folder / "shards"
        reader = open_reader(shards, read_manifest(shards), "train")
        loader = RankLoader(reader, rank=0, world_size=1, global_batch=256, seed=0)
        started = time.perf_counter()
        seen = 0
        for i, (x, _) in enumerate(loader.batches(epoch=0)):
            seen += len(x)
            assert np.isfinite(x[:1]).all()
            if i + 1 == args.batches:
                break
        load_sps = seen / (time.perf_counter() - started)
    finally:
        shutil.rmtree(args.folder, ignore_errors=True)
    results = {
        "rows": rows,
        "data_gb": data_gb,
        "mem_gb": mem_gb,
        "ingest_s": ingest_s,
        "shard_s": shard_s,
        "ingest_peak_rss_gb": ingest_rss,
        "shard_peak_rss_gb": shard_rss,
        "shard_peak_over_data": shard_rss / data_gb,
        "load_batches": args.batches,
        "load_samples_per_s": load_sps,
    }
    print(" ".join(f"{k}={fmt(v) if isinstance(v, float) else v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
