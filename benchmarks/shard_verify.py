"""What checking each shard's sha256 on first open (training.data.integrity) costs the
loader: one job's first epoch (open the reader, read every batch) with the check, and
the same with the shards already checked (what every later open costs: no hashing).

Median of interleaved repetitions, page cache warm for both (the check reads each file
once; on a cold disk training's own first reads would pay for that I/O instead).
Prints one line per dataset, key=value: ratio = throughput with / without the check.
Usage: python -m benchmarks.shard_verify [--rows 200000] [--row-bytes 1024] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import fmt, make_synthetic_shards, timed
from training.config import DataConfig, ShardConfig
from training.data.ingest import ingest
from training.data.integrity import forget_checked
from training.data.loader import RankLoader, open_reader
from training.data.manifest import read_manifest, split_shards
from training.data.shards import write_shards


def first_epoch(shards: Path, batch: int) -> int:
    """A job's first contact with the training split: open, then one epoch."""
    manifest = read_manifest(shards)
    reader = open_reader(shards, manifest, "train")
    loader = RankLoader(reader, rank=0, world_size=1, global_batch=batch, seed=0)
    return sum(len(x) for x, _ in loader.tensors(0))


def measure(name: str, shards: Path, batch: int, repeats: int) -> dict:
    first_epoch(shards, batch)  # page cache and Arrow's one-time set-up, for both
    checked, unchecked = [], []
    for _ in range(repeats):
        forget_checked()
        elapsed, rows = timed(lambda: first_epoch(shards, batch))
        checked.append(elapsed)
        elapsed, _ = timed(lambda: first_epoch(shards, batch))  # already checked
        unchecked.append(elapsed)
    files = split_shards(shards, read_manifest(shards), "train")
    size = sum(s.path.stat().st_size for s in files)
    t_on, t_off = statistics.median(checked), statistics.median(unchecked)
    return {
        "dataset": name,
        "train_mb": size / 1e6,
        "shards": len(files),
        "rows": rows,
        "epoch_s_checked": t_on,
        "epoch_s_unchecked": t_off,
        "check_s": t_on - t_off,
        "ratio": t_off / t_on,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--row-bytes", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        # The project's default data: digits, default shard size.
        digits = base / "digits"
        ingest(DataConfig(), digits, digits / "raw", digits / "q", digits / "report.json")
        write_shards(ShardConfig(), digits / "raw", digits / "shards", "benchmark")
        big = base / "synthetic"
        _, big_shards = make_synthetic_shards(big, args.rows, args.row_bytes)
        for name, shards in (("digits", digits / "shards"), ("synthetic", big_shards)):
            result = measure(name, shards, args.batch, args.repeats)
            pairs = (f"{k}={fmt(v) if isinstance(v, float) else v}" for k, v in result.items())
            print(" ".join(pairs))


if __name__ == "__main__":
    main()
