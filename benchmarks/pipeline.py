"""Where `gradline run`'s wall time goes: the default pipeline on a fresh copy of the
project, then the same command again with nothing changed.

Each repeat has its own gradline cache, empty at first (GRADLINE_CACHE_DIR: the new
Prefect homes' database template, flows/prefect_database.py):
- first_machine_wall_s: `gradline run` on a fresh copy of the project with its own
  PREFECT_HOME, as on a machine that never ran gradline: Prefect migrates a new
  database, and leaves the template;
- then a second fresh copy with a new PREFECT_HOME of its own, as any later project
  starts: `gradline run` with GRADLINE_TIMINGS set (training/timings.py), its wall time
  split as follows.

The split of that run:
- startup_s: from the command to the flow's first line (imports, the Prefect server);
- per stage: wall_s as the flow sees it (its `dvc repro`), the stage's own work, and
  overhead_s, everything else (DVC, the stage process's start-up and imports). A stage's
  own work is its function's time, except train's, which is the training loop's steps
  (train_loop_s); train's overhead is split into train.before_loop_s (DVC, the stage's
  start, the MLflow run, the workers' start), train.in_loop_not_steps_s (validation,
  checkpoints and logging at the loop's barriers) and train.after_loop_s (the workers'
  end, the model's MLflow logging, DVC);
- flow_rest_s: the flow's tasks between the stages (params, drift, push, register) and
  the way out; split into flow.<step>_s (a step's wall less the stage it ran, if any)
  and flow.exit_s (from the flow's last step to the command's exit);
- skip_wall_s: the second `gradline run`, which finds everything up to date;
- forced_wall_s: a third, `gradline run --force`, which runs every stage again on a
  Prefect home that is no longer new (its database exists): what a rerun costs once a
  machine has run gradline before.

Prints medians over the repeats (`--repeats`, 3 by default), one `key value` per line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import copy_project
from training.database_template import CACHE_DIR_ENV
from training.timings import TIMINGS_ENV

STAGES = ("ingest", "shard", "train", "evaluate")


def _env(project: Path, timings: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    env["PREFECT_HOME"] = str(project / ".prefect-home")
    env[CACHE_DIR_ENV] = str(project.parent.parent / "gradline-cache")  # the repeat's
    env[TIMINGS_ENV] = str(timings)
    return env


def _gradline_run(project: Path, timings: Path, *flags: str) -> float:
    """Wall seconds of one `gradline run`; the command's output on failure."""
    started = time.time()
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "gradline"), "run", *flags],
        cwd=project,
        env=_env(project, timings),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"gradline run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.time() - started


def _read(timings: Path) -> list[dict]:
    return [json.loads(line) for line in timings.read_text().splitlines() if line]


def split_run(records: list[dict], started: float, wall: float, loop_s: float) -> dict[str, float]:
    """One run's wall time, split as the module docstring says."""
    began = next(r["at"] for r in records if r["what"] == "flow_began")
    out = {"pipeline_wall_s": wall, "startup_s": began - started, "train_loop_s": loop_s}
    stage_walls = 0.0
    for stage in STAGES:
        walls = [r["seconds"] for r in records if r["what"] == "stage_wall" and r["stage"] == stage]
        works = [r["seconds"] for r in records if r["what"] == "stage_work" and r["stage"] == stage]
        stage_wall, work = sum(walls), sum(works)
        own = loop_s if stage == "train" else work
        out[f"{stage}.wall_s"] = stage_wall
        out[f"{stage}.work_s"] = work
        out[f"{stage}.overhead_s"] = stage_wall - own
        stage_walls += stage_wall
    out.update(_train_overhead(records, loop_s))
    out["flow_rest_s"] = wall - out["startup_s"] - stage_walls
    # flow_rest_s by the flow's steps (training/timings.StepClock), less the stage walls
    # within them, and the way out: from the flow's last step to the command's exit.
    steps = [r for r in records if r["what"] == "flow_step"]
    for record in steps:
        stage = record["step"] if record["step"] in STAGES else None
        own = out[f"{stage}.wall_s"] if stage else 0.0
        key = f"flow.{record['step']}_s"
        out[key] = out.get(key, 0.0) + record["seconds"] - own
    out["flow.exit_s"] = wall - out["startup_s"] - sum(r["seconds"] for r in steps)
    return out


def _train_overhead(records: list[dict], loop_s: float) -> dict[str, float]:
    """train.overhead_s in three parts: before the loop (DVC, the stage's start, the MLflow
    run, starting the workers), in the loop but not its steps (validation, checkpoints,
    logging at barriers) and after it (the workers' end, the model's MLflow logging, DVC)."""
    (stage,) = [r for r in records if r["what"] == "stage_wall" and r["stage"] == "train"]
    loops = [r for r in records if r["what"] == "train_loop"]
    if not loops:
        return {}
    loop = loops[-1]  # rank 0's loop of the job's last attempt
    return {
        "train.before_loop_s": loop["at"] - loop["seconds"] - (stage["at"] - stage["seconds"]),
        "train.in_loop_not_steps_s": loop["seconds"] - loop_s,
        "train.after_loop_s": stage["at"] - loop["at"],
    }


def one_repeat(base: Path) -> dict[str, float]:
    first_machine = _gradline_run(copy_project(base / "first" / "gradline"), base / "first.jsonl")
    project = copy_project(base / "later" / "gradline")
    timings = base / "timings.jsonl"
    started = time.time()
    wall = _gradline_run(project, timings)
    result = json.loads((project / "result.json").read_text())
    figures = split_run(_read(timings), started, wall, result["final"]["loop_seconds"])
    figures["first_machine_wall_s"] = first_machine
    figures["skip_wall_s"] = _gradline_run(project, base / "skip-timings.jsonl")
    status = subprocess.run(
        [str(Path(sys.executable).parent / "dvc"), "status", "--json"],
        cwd=project,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if json.loads(status):  # the DAG's promise: nothing stale after a run
        raise SystemExit(f"dvc status is not clean after the run: {status}")
    figures["forced_wall_s"] = _gradline_run(project, base / "forced-timings.jsonl", "--force")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="gradline-pipeline-") as base:
            runs.append(one_repeat(Path(base)))
        print(f"# repeat {repeat + 1}: {json.dumps({k: round(v, 2) for k, v in runs[-1].items()})}")
    for key in runs[0]:
        print(f"{key} {statistics.median(r[key] for r in runs):.2f}")


if __name__ == "__main__":
    main()
