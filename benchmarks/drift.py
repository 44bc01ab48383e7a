"""Time the drift check on a synthetic table of about 1 GB (float32 features).

The table goes through the real ingest stage, then each measured step runs in a fresh
process (its peak resident memory is its own), `--repeats` times, interleaved, and the
median is kept:
- profile: what ingest adds when there is no champion yet (training.data.profile: a
  pass that samples rows for the deciles, a pass that counts every row on them);
- drift: what it adds when there is one: the same, with the new data counted on the
  champion's bins in the first pass, then PSI per feature and label;
- compare: the drift computation alone: one pass counting the table on the reference's
  bins, then PSI.
The cost does not depend on the values, so the table is compared with its own profile.
Memory should not grow with the table: compare peak_rss_gb across --gb.
The last line is key=value pairs: data_gb, rows, features, profile_s, drift_s,
drift_rows_per_s, compare_s, compare_rows_per_s, compare_gb_per_s, psi_s, peak_rss_gb
(the largest of the steps), imported_rss_gb (a step's process before it reads).
Usage: python -m benchmarks.drift [--folder DIR] [--gb 1] [--row-bytes 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import fmt

# Runs in a fresh process: one step, timed, with that process's peak RSS.
_STEP = """
import json, resource, sys, time
from pathlib import Path
import numpy as np
from training.data.drift import compare
from training.data.profile import BinCounter, ClassCounter, profile_raw, raw_table_files, read_table

raw, step, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
imported_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
reference_file = raw.parent / "reference.json"
reference = json.loads(reference_file.read_text()) if step != "profile" else None
started = time.perf_counter()
if step == "compare":
    edges = [np.asarray(e) for e in reference["features"]["edges"]]
    features, classes = BinCounter(edges), ClassCounter()
    for batch in read_table(raw_table_files(raw), len(edges), ["features", "label"]):
        features.add(batch.features)
        classes.add(batch.labels)
    counted = {"rows": features.rows, "features": {"counts": features.counts()},
               "label": {"classes": classes.counts()}}
    rows = features.rows
else:
    profile, counted = profile_raw(raw, reference)
    rows = profile["rows"]
    if step == "profile":
        reference_file.write_text(json.dumps(profile))
counted_at = time.perf_counter()
drift = compare(reference, counted) if reference is not None else None
done = time.perf_counter()
out.write_text(json.dumps({
    "seconds": done - started, "psi_s": done - counted_at, "rows": rows,
    "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    "imported_rss_gb": imported_gb,
}))
"""

STEPS = ("profile", "drift", "compare")


def _ingest(folder: Path, rows: int, features: int) -> Path:
    code = (
        "import sys; from pathlib import Path;"
        "from training.config import DataConfig; from training.data.ingest import ingest;"
        f"f = Path({str(folder)!r});"
        f"cfg = DataConfig(source='synthetic', synthetic_rows={rows}, "
        f"synthetic_shape=[{features}]);"
        "ingest(cfg, f, f / 'raw', f / 'quarantine', f / 'ingest.json')"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    return folder / "raw"


def _step(raw: Path, step: str) -> dict:
    out = raw.parent / f"{step}.json"
    subprocess.run([sys.executable, "-c", _STEP, str(raw), step, str(out)], check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, help="scratch folder (default: a temp dir)")
    parser.add_argument("--gb", type=float, default=1.0, help="feature bytes of the table")
    parser.add_argument("--row-bytes", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    features = max(1, args.row_bytes // 4)
    rows = int(args.gb * 1e9 / (features * 4))
    runs: dict[str, list[dict]] = {step: [] for step in STEPS}
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        raw = _ingest(Path(tmp), rows, features)
        parquet_gb = sum(p.stat().st_size for p in raw.glob("*.parquet")) / 1e9
        for _ in range(args.repeats):  # interleaved: a noisy host slows every step alike
            for step in STEPS:
                runs[step].append(_step(raw, step))

    def median(step: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[step])

    data_gb = rows * features * 4 / 1e9
    seconds = {step: median(step, "seconds") for step in STEPS}
    peak = max(run["peak_rss_gb"] for step in STEPS for run in runs[step])
    imported = median("compare", "imported_rss_gb")
    print(
        f"{rows} rows x {features} float32 features ({data_gb:.2f} GB of features, "
        f"{parquet_gb:.2f} GB of Parquet); medians of {args.repeats}"
    )
    for step, says in (
        ("profile", "profile (no champion)"),
        ("drift", "profile + drift (champion)"),
        ("compare", "drift alone"),
    ):
        print(
            f"{says:28s} {seconds[step]:7.2f} s  {rows / seconds[step]:>12,.0f} rows/s  "
            f"{data_gb / seconds[step]:.2f} GB/s  peak RSS "
            f"{max(run['peak_rss_gb'] for run in runs[step]):.2f} GB"
        )
    print(f"PSI of {features} features and the label: {median('compare', 'psi_s') * 1e3:.1f} ms")
    print(f"a step's process before it reads anything: {imported:.2f} GB")
    figures = {
        "data_gb": data_gb,
        "rows": rows,
        "features": features,
        "profile_s": seconds["profile"],
        "drift_s": seconds["drift"],
        "drift_rows_per_s": rows / seconds["drift"],
        "compare_s": seconds["compare"],
        "compare_rows_per_s": rows / seconds["compare"],
        "compare_gb_per_s": data_gb / seconds["compare"],
        "psi_s": median("compare", "psi_s"),
        "peak_rss_gb": peak,
        "imported_rss_gb": imported,
    }
    print(" ".join(f"{k}={fmt(float(v))}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
