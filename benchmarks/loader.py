"""Shuffled-batch throughput of the gradline loader against a bound and two baselines.

- bound:     gathering the same batches from one in-memory numpy array;
- in_memory: gradline's own loader code with its shards copied into memory (anonymous
             memory instead of the memory-mapped files): what the code costs apart from
             reading through a file mapping;
- naive:     the table read with pandas into a TensorDataset and a shuffling DataLoader;
- hf:        Hugging Face `datasets` over the same Parquet, random-access batches (if
             installed).

Epochs of gradline, the in-memory copy and the bound are interleaved `--repeats` times
(after one warm-up epoch each: the page cache holds the shards, as from a second epoch
on) and each figure is the median. `ratio_vs_bound` is gradline over the bound;
`code_ratio` the in-memory copy over the bound (the loader's own overhead);
`mapping_ratio` gradline over the in-memory copy (the memory map's).
The last line is key=value pairs: ratio_vs_bound, code_ratio, mapping_ratio, ...
Usage: python -m benchmarks.loader [--rows 200000] [--row-bytes 1024] [--batch 256]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import fmt, make_synthetic_shards, timed
from training.data.loader import RankLoader, ShardReader, epoch_permutation, open_reader
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


def in_memory(loader: RankLoader) -> RankLoader:
    """The same loader over copies of its (already mapped) shards in anonymous memory:
    the reader's views are replaced, nothing else."""
    copy = ShardReader(loader.reader.shards)
    copy._views = {k: (np.array(x), np.array(y)) for k, (x, y) in loader.reader._views.items()}
    return RankLoader(copy, rank=0, world_size=1, global_batch=loader.global_batch, seed=0)


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
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        raw, shards = make_synthetic_shards(Path(tmp), args.rows, args.row_bytes)
        manifest = read_manifest(shards)
        reader = open_reader(shards, manifest, "train")
        loader = RankLoader(reader, rank=0, world_size=1, global_batch=args.batch, seed=0)
        gradline_epoch(loader, 0)  # warm the page cache, as a second epoch would be
        copy = in_memory(loader)
        gradline_epoch(copy, 0)
        features, labels = reader.gather(np.arange(reader.num_rows))
        bound_epoch(features, labels, args.batch, 0)
        times: dict[str, list[float]] = {"gradline": [], "in_memory": [], "bound": []}
        for epoch in range(1, 1 + args.repeats):  # interleaved: drift hits each alike
            elapsed, rows = timed(lambda e=epoch: gradline_epoch(loader, e))
            times["gradline"].append(elapsed)
            times["in_memory"].append(timed(lambda e=epoch: gradline_epoch(copy, e))[0])
            bound = timed(lambda e=epoch: bound_epoch(features, labels, args.batch, e))[0]
            times["bound"].append(bound)
        t_gradline, t_memory, t_bound = (statistics.median(times[k]) for k in times)
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
        "in_memory_samples_per_s": rows / t_memory,
        "bound_samples_per_s": rows / t_bound,
        "naive_samples_per_s": naive_rows / t_naive,
        "hf_samples_per_s": hf[1] / hf[0] if hf else float("nan"),
        "ratio_vs_bound": t_bound / t_gradline,
        "code_ratio": t_bound / t_memory,
        "mapping_ratio": t_memory / t_gradline,
        "ratio_vs_naive": sps / (naive_rows / t_naive),
        "ratio_vs_hf": sps / (hf[1] / hf[0]) if hf else float("nan"),
    }
    print(" ".join(f"{k}={fmt(v) if isinstance(v, float) else v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
