"""Rows per second of `gradline score`'s path against the model's torch module alone.

The model is the default workload's (digits: the 2-layer MLP of 256, 10 classes, images
8x8), logged from code and registered in a temporary MLflow store as `gradline run`
registers it. The new rows are digits-shaped tables (an id and 64 pixel columns) in
Parquet files. Two ways to predict them, interleaved `--repeats` times:

- score:  `training.mlops.scoring.score_new_rows`, what `gradline score` runs before DVC
          and the MLflow record: resolve the version, download it, hash the input, then
          read the files in record batches, validate, predict, write Parquet (the same
          code, nothing mocked);
- direct: the same torch module called on the same rows, already in memory as tensors,
          cut into the same forward batches (the pyfunc model's 1,024 rows).

`ratio` is the median over repetitions of score's rows/s over direct's (goal >= 0.8);
`stream_ratio` leaves out the fixed start (registry look-up, model download, input md5).
Both sides use `--threads` intra-op threads (the CLI's default is 1, OMP_NUM_THREADS).
The last line is key=value pairs.
Usage: python -m benchmarks.score [--rows 400000] [--files 4] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from benchmarks.common import fmt
from training.config import Config
from training.data.spec import DataSpec
from training.mlops.registry import register_version
from training.mlops.scoring import ScoreRequest, loaded_model, resolve_model, score_new_rows
from training.mlops.serving import log_pyfunc_model
from training.mlops.tracking import client, ensure_experiment
from training.models.folder import ModelSpec, save_model_dir
from training.models.registry import build_model
from training.objectives.base import PREDICT_BATCH_ROWS

NAME = "bench-digits"


def register_default_model(base: Path) -> tuple[str, Config]:
    """The default config's model (untrained: the same compute) as `NAME` v1."""
    cfg = Config.model_validate({"registry": {"model_name": NAME}})
    data = DataSpec("image", (8, 8), 10)
    uri = f"sqlite:///{base / 'mlflow.db'}"
    experiment = ensure_experiment(uri, "bench", (base / "artifacts").as_uri())
    mlflow_client = client(uri)
    run_id = mlflow_client.create_run(experiment).info.run_id
    folder = base / "model"
    model = build_model(cfg.model, cfg.task.type, data)
    save_model_dir(model, ModelSpec.create(cfg.task.type, cfg.model, data), folder)
    model_uri = log_pyfunc_model(uri, run_id, folder, cfg.generation())
    register_version(uri, NAME, model_uri)
    mlflow_client.set_registered_model_alias(NAME, "champion", "1")
    return uri, cfg


def write_rows(folder: Path, rows: int, files: int) -> np.ndarray:
    """Digits-shaped rows (pixels in 0..1) in `files` Parquet files; returns them."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 17, size=(rows, 64)).astype(np.float32) / 16.0
    folder.mkdir(parents=True)
    for part, block in enumerate(np.array_split(np.arange(rows), files)):
        columns = {f"f{i}": pixels[block, i] for i in range(64)}
        table = pa.table({"id": pa.array(block, pa.int64()), **columns})
        pq.write_table(table, folder / f"part-{part:03d}.parquet")
    return pixels


def direct(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """Seconds to call the module on every batch (outputs kept, as a caller would)."""
    start = time.perf_counter()
    with torch.no_grad():
        outputs = [model(x) for x in batches]
    elapsed = time.perf_counter() - start
    assert sum(len(o) for o in outputs) == sum(len(x) for x in batches)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-rows", type=int, default=8192, help="score.batch_rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="gradline-bench-score-") as tmp:
        base = Path(tmp)
        uri, cfg = register_default_model(base)
        pixels = write_rows(base / "new", args.rows, args.files)
        score = cfg.score.model_copy(update={"input": "new", "batch_rows": args.batch_rows})
        request = ScoreRequest.from_config(cfg.model_copy(update={"score": score}))
        with loaded_model(uri, resolve_model(uri, request.model)) as (predictor, _):
            model = predictor.model.eval()
        images = torch.from_numpy(pixels.reshape(-1, 8, 8))
        batches = [
            images[start : start + PREDICT_BATCH_ROWS]
            for start in range(0, len(images), PREDICT_BATCH_ROWS)
        ]
        direct(model, batches[:20])  # warm up both paths once
        score_new_rows(base, cfg, request, uri)
        ratios, stream_ratios, score_rps, direct_rps = [], [], [], []
        for _ in range(args.repeats):
            direct_s = direct(model, batches)
            start = time.perf_counter()
            outcome = score_new_rows(base, cfg, request, uri)
            total_s = time.perf_counter() - start
            assert outcome.rows_scored == args.rows
            ratios.append(direct_s / total_s)
            stream_ratios.append(direct_s / outcome.seconds)
            score_rps.append(args.rows / total_s)
            direct_rps.append(args.rows / direct_s)
        print(
            f"rows={args.rows} files={args.files} threads={args.threads} "
            f"score_rows_per_s={fmt(statistics.median(score_rps))} "
            f"direct_rows_per_s={fmt(statistics.median(direct_rps))} "
            f"ratio={fmt(statistics.median(ratios))} "
            f"stream_ratio={fmt(statistics.median(stream_ratios))}"
        )


if __name__ == "__main__":
    main()
