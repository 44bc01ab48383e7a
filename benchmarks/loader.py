"""Shuffled-batch throughput of the gradline loader against a bound and two baselines.

- bound: gathering the same batches from one in-memory numpy array;
- naive: the table read with pandas into a TensorDataset and a shuffling DataLoader;
- hf:    Hugging Face `datasets` over the same Parquet, random-access batches (if installed).

The last line is key=value pairs: ratio_vs_bound, ratio_vs_naive, ratio_vs_hf, ...
Usage: python -m benchmarks.loader [--rows 200000] [--row-bytes 1024] [--batch 256]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import fmt, make_synthetic_shards, timed
from training.data.loader import RankLoader, epoch_permutation, open_reader
from training.data.manifest import read_manifest


def gradline_epoch(loader: RankLoader, epoch: int) -> int:
    rows = 0
    for x, _ in loader.tensors(epoch):
        rows += len(x)
    return rows


def bound_epoch(features: np.ndarray, labels: np.ndarray, batch: int, epoch: int) -> int:
    order = epoch_permutation(len(labels), 0, epoch)
    rows = 0
    for k in range(len(labels) // batch):
        idx = order[k * batch : (k + 1) * batch]
        x, _ = torch.from_numpy(features[idx]), torch.from_numpy(labels[idx])
        rows += len(x)
    return rows


def naive_epoch(raw: Path, batch: int) -> tuple[float, int]:
    import pandas as pd
    from torch.utils.data import DataLoader, TensorDataset

    frame = pd.read_parquet(raw)
    x = torch.tensor(np.stack(frame["features"].to_numpy()), dtype=torch.float32)
    y = torch.tensor(frame["label"].to_numpy())
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True)
    return timed(lambda: sum(len(b[0]) for b in loader))


def hf_epoch(raw: Path, batch: int) -> tuple[float, int] | None:
    try:
        import datasets
    except ImportError:
        return None
    files = [str(p) for p in sorted(raw.glob("*.parquet"))]
    ds = datasets.Dataset.from_parquet(files).with_format("numpy")
    order = np.random.default_rng(0).permutation(len(ds))

    def run() -> int:
        rows = 0
        for k in range(len(ds) // batch):
            b = ds[order[k * batch : (k + 1) * batch]]
            rows += len(torch.from_numpy(np.asarray(b["features"], dtype=np.float32)))
        return rows

    return timed(run)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--row-bytes", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        raw, shards = make_synthetic_shards(Path(tmp), args.rows, args.row_bytes)
        manifest = read_manifest(shards)
        reader = open_reader(shards, manifest, "train")
        loader = RankLoader(reader, rank=0, world_size=1, global_batch=args.batch, seed=0)
        gradline_epoch(loader, 0)  # warm the page cache, as a second epoch would be
        features, labels = reader.gather(np.arange(reader.num_rows))
        # Best of several interleaved epochs: this host's memory bandwidth drifts.
        t_gradline = t_bound = float("inf")
        for epoch in range(1, 1 + args.repeats):
            elapsed, rows = timed(lambda e=epoch: gradline_epoch(loader, e))
            t_gradline = min(t_gradline, elapsed)
            elapsed, _ = timed(lambda e=epoch: bound_epoch(features, labels, args.batch, e))
            t_bound = min(t_bound, elapsed)
        t_naive, naive_rows = naive_epoch(raw, args.batch)
        hf = hf_epoch(raw, args.batch)

    row_bytes = manifest["feature_shape"][0] * 4 + 8
    sps = rows / t_gradline
    results = {
        "rows": rows,
        "row_bytes": row_bytes,
        "batch": args.batch,
        "gradline_samples_per_s": sps,
        "gradline_gb_per_s": sps * row_bytes / 1e9,
        "bound_samples_per_s": rows / t_bound,
        "naive_samples_per_s": naive_rows / t_naive,
        "hf_samples_per_s": hf[1] / hf[0] if hf else float("nan"),
        "ratio_vs_bound": t_bound / t_gradline,
        "ratio_vs_naive": sps / (naive_rows / t_naive),
        "ratio_vs_hf": sps / (hf[1] / hf[0]) if hf else float("nan"),
    }
    print(" ".join(f"{k}={fmt(v) if isinstance(v, float) else v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
