"""Time the drift check on a synthetic table of about 1 GB (float32 features).

The table goes through the real ingest stage, then each measured step runs in a fresh
process (its peak resident memory is its own): the profile alone (what ingest adds when
there is no champion yet: a sampling pass and a counting pass), and the profile with the
drift check against a reference profile (what it adds when there is one: the new data is
counted on the reference's bins in the first pass, then PSI per feature). Memory should
not grow with the table: compare peak_rss_gb across --gb.
The last line is key=value pairs: data_gb, rows, features, profile_s, profile_rows_per_s,
drift_s, drift_rows_per_s, drift_gb_per_s, drift_extra_s (counting on the reference's
bins), compare_s (PSI itself), profile_peak_rss_gb, drift_peak_rss_gb. The cost does
not depend on the values, so the table is compared with its own profile.
Usage: python -m benchmarks.drift [--folder DIR] [--gb 1] [--row-bytes 1024]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import fmt

# Runs in a fresh process: one step, timed, with that process's peak RSS.
_STEP = """
import json, resource, sys, time
from pathlib import Path
from training.data.drift import compare
from training.data.profile import profile_raw

raw, step, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
reference = json.loads(out.with_name("reference.json").read_text()) if step == "drift" else None
started = time.perf_counter()
profile, counted = profile_raw(raw, reference)
profiled = time.perf_counter()
drift = compare(reference, counted) if reference is not None else None
done = time.perf_counter()
if step == "profile":
    out.with_name("reference.json").write_text(json.dumps(profile))
peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
out.write_text(json.dumps({
    "seconds": done - started, "compare_s": done - profiled, "rows": profile["rows"],
    "peak_rss_gb": peak_gb, "psi_max": drift["psi_max"] if drift else None,
}))
"""


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
    args = parser.parse_args()
    features = max(1, args.row_bytes // 4)
    rows = int(args.gb * 1e9 / (features * 4))
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        raw = _ingest(Path(tmp), rows, features)
        data_gb = sum(p.stat().st_size for p in raw.glob("*.parquet")) / 1e9
        profile = _step(raw, "profile")
        drift = _step(raw, "drift")
    feature_gb = rows * features * 4 / 1e9
    print(
        f"{rows} rows x {features} float32 features ({feature_gb:.2f} GB of features, "
        f"{data_gb:.2f} GB of Parquet)"
    )
    print(
        f"profile only:        {profile['seconds']:.2f} s  "
        f"{profile['rows'] / profile['seconds']:,.0f} rows/s  "
        f"peak RSS {profile['peak_rss_gb']:.2f} GB"
    )
    print(
        f"profile + drift:     {drift['seconds']:.2f} s  "
        f"{drift['rows'] / drift['seconds']:,.0f} rows/s  "
        f"({feature_gb / drift['seconds']:.2f} GB/s of features; PSI of {features} features "
        f"{drift['compare_s'] * 1000:.1f} ms; max PSI {drift['psi_max']:.2g} against itself)  "
        f"peak RSS {drift['peak_rss_gb']:.2f} GB"
    )
    figures = {
        "data_gb": feature_gb,
        "rows": rows,
        "features": features,
        "profile_s": profile["seconds"],
        "profile_rows_per_s": profile["rows"] / profile["seconds"],
        "drift_s": drift["seconds"],
        "drift_rows_per_s": drift["rows"] / drift["seconds"],
        "drift_gb_per_s": feature_gb / drift["seconds"],
        "drift_extra_s": drift["seconds"] - profile["seconds"],
        "compare_s": drift["compare_s"],
        "profile_peak_rss_gb": profile["peak_rss_gb"],
        "drift_peak_rss_gb": drift["peak_rss_gb"],
    }
    print(" ".join(f"{k}={fmt(float(v))}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
