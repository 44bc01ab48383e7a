"""`gradline sweep` on the default workload (params.yaml as shipped: digits, the MLP, 30
epochs, 2 workers), in a fresh copy of the project, through the real CLI.

- best_vs_default_val:   the best trial's val_accuracy / trial 0's (trial 0 trains
                         params.yaml's own values: the default config, same data, same
                         steps), and the same on the test split (both models scored by the
                         evaluate stage's TestData): best_vs_default_test
- steps_run_fraction:    trial-steps run / trial-steps the same trials would have run to
                         the end (pruning_saved = 1 - that), default sampler and pruner
With --unpruned, the share at an equal best metric: the random sampler (seeded, so both
sweeps draw the same keys trial by trial) with the median pruner and with none; the
unpruned sweep's steps are what the trials would have run, and the two best values say
whether pruning lost the best trial:
- paired_steps_run_fraction, paired_best_pruned, paired_best_unpruned

Each trial costs a job's start-up (workers, tracking helper: several seconds on 2 cores)
plus 570 steps. About 10 minutes for 16 trials on 2 quiet cores, twice that with
--unpruned. The last line is key=value pairs.
Usage: python -m benchmarks.sweep [--trials 16] [--unpruned] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import copy_project, fmt


def sweep(root: Path, *sets: str) -> float:
    """`gradline sweep --set ...` in `root`; its wall seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    env["PREFECT_HOME"] = str(root / ".prefect-home")
    args = [arg for value in sets for arg in ("--set", value)]
    started = time.perf_counter()
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "gradline"), "sweep", *args],
        cwd=root, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"gradline sweep failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    print(proc.stdout, flush=True)
    return time.perf_counter() - started


def study_figures(root: Path, name: str) -> dict:
    import optuna
    from optuna.trial import TrialState

    from training.mlops.sweep.plan import storage_url

    study = optuna.load_study(study_name=name, storage=storage_url(root, name))
    ended = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    run = sum(t.user_attrs["steps"] for t in ended)
    planned = sum(t.user_attrs["planned_steps"] for t in ended)
    baseline = next((t for t in study.trials if t.user_attrs.get("baseline")), None)
    return {
        "study": study,
        "best": study.best_trial,
        "baseline": baseline,
        "steps_run": run,
        "steps_planned": planned,
        "pruned": sum(t.state == TrialState.PRUNED for t in ended),
        "trials": len(ended),
    }


def test_accuracy(root: Path, name: str, trial) -> float:
    from training.evaluation import TestData
    from training.models.folder import load_model_dir
    from training.project import Project

    project = Project(root)
    model, _ = load_model_dir(
        project.checkpoints / "sweeps" / name / trial.user_attrs["folder"] / "model"
    )
    cfg = project.config()
    return (
        TestData.open(cfg, project.shards)
        .score(model, cfg.evaluate.batch_size)
        .metrics["test_accuracy"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--unpruned", action="store_true", help="also the paired random sweeps")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it")
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="gradline-sweep-bench-"))
    root = copy_project(base / "project")
    results: dict[str, str] = {}
    try:
        seconds = sweep(root, f"sweep.trials={args.trials}")
        found = study_figures(root, "sweep")
        best, baseline = found["best"], found["baseline"]
        results |= {
            "trials": str(found["trials"]),
            "pruned": str(found["pruned"]),
            "sweep_seconds": fmt(seconds),
            "default_val": fmt(baseline.value),
            "best_val": fmt(best.value),
            "best_vs_default_val": fmt(best.value / baseline.value),
            "default_test": fmt(test_accuracy(root, "sweep", baseline)),
            "best_test": fmt(test_accuracy(root, "sweep", best)),
            "steps_run": str(found["steps_run"]),
            "steps_planned": str(found["steps_planned"]),
            "steps_run_fraction": fmt(found["steps_run"] / found["steps_planned"]),
            "best_params": ",".join(f"{k}={v:.4g}" for k, v in best.params.items()),
        }
        results["best_vs_default_test"] = fmt(
            float(results["best_test"]) / float(results["default_test"])
        )
        if args.unpruned:
            pair = {}
            for pruner in ("median", "none"):
                name = f"random-{pruner}"
                sets = (f"sweep.name={name}", "sweep.sampler=random", f"sweep.pruner={pruner}")
                sweep(root, f"sweep.trials={args.trials}", *sets)
                pair[pruner] = study_figures(root, name)
            results |= {
                "paired_best_pruned": fmt(pair["median"]["best"].value),
                "paired_best_unpruned": fmt(pair["none"]["best"].value),
                "paired_steps_run_fraction": fmt(
                    pair["median"]["steps_run"] / pair["none"]["steps_run"]
                ),
                "paired_pruned": str(pair["median"]["pruned"]),
            }
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    print(" ".join(f"{k}={v}" for k, v in results.items()))


if __name__ == "__main__":
    main()
