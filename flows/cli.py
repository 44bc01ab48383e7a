"""`gradline`: run the pipeline, run one DVC stage, or open the UIs.

Imports are deferred into each command so `gradline stage ...` (what dvc.yaml calls)
starts without loading Prefect.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from flows.environment import apply_offline_defaults
from training.errors import GradlineError


def _cmd_run(args: argparse.Namespace) -> int:
    from training.config import load_config
    from training.paths import ProjectPaths, find_project_root

    root = find_project_root()
    # Validate before Prefect starts or anything is written: fail in a second, not ten.
    load_config(ProjectPaths(root).params, args.set)
    from flows.pipeline import pipeline

    summary = pipeline(overrides=args.set, root=str(root))
    print(summary.describe())
    return 0


def _cmd_stage(args: argparse.Namespace) -> int:
    from training import stages
    from training.paths import find_project_root

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    root = find_project_root()
    if args.name == "ingest":
        stages.ingest_stage(root, Path(args.out), Path(args.quarantine), Path(args.report))
    elif args.name == "shard":
        stages.shard_stage(root, Path(args.raw), Path(args.out))
    elif args.name == "train":
        stages.train_stage(
            root, Path(args.shards), Path(args.model), Path(args.checkpoints), Path(args.result)
        )
    elif args.name == "evaluate":
        stages.evaluate_stage(
            root,
            Path(args.model),
            Path(args.shards),
            Path(args.result),
            Path(args.metrics),
            Path(args.plots),
        )
    return 0


def _cmd_ui(args: argparse.Namespace) -> int:
    from flows.ui import serve_uis
    from training.paths import find_project_root

    return serve_uis(find_project_root(), args.mlflow_port, args.prefect_port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradline", description="Orchestrated, tracked, reproducible training."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the whole pipeline as a Prefect flow")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a params.yaml value; recorded in params.yaml (repeatable)",
    )
    run.set_defaults(func=_cmd_run)

    stage = sub.add_parser("stage", help="run one DVC stage (what dvc.yaml calls)")
    stage_sub = stage.add_subparsers(dest="name", required=True)
    ingest = stage_sub.add_parser("ingest")
    for flag in ("--out", "--quarantine", "--report"):
        ingest.add_argument(flag, required=True)
    shard = stage_sub.add_parser("shard")
    shard.add_argument("--raw", required=True)
    shard.add_argument("--out", required=True)
    train = stage_sub.add_parser("train")
    for flag in ("--shards", "--model", "--checkpoints", "--result"):
        train.add_argument(flag, required=True)
    evaluate = stage_sub.add_parser("evaluate")
    for flag in ("--model", "--shards", "--result", "--metrics", "--plots"):
        evaluate.add_argument(flag, required=True)
    stage.set_defaults(func=_cmd_stage)

    ui = sub.add_parser("ui", help="serve the MLflow UI and a Prefect server on 127.0.0.1")
    ui.add_argument("--mlflow-port", type=int, default=5000)
    ui.add_argument("--prefect-port", type=int, default=4200)
    ui.set_defaults(func=_cmd_ui)
    return parser


def main(argv: list[str] | None = None) -> int:
    apply_offline_defaults()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except GradlineError as exc:
        print(f"gradline: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)


if __name__ == "__main__":
    sys.exit(main())
