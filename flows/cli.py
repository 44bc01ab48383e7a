"""`gradline`: run or serve the pipeline, sweep its keys, run one DVC stage, open the
UIs, ask about runs and model versions.

Imports are deferred into each command so `gradline stage ...` (what dvc.yaml calls)
starts without loading Prefect.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flows.environment import apply_offline_defaults
from flows.prefect_settings import prefect_setting_configured
from flows.process_end import end_process
from flows.stage_host import stage_host
from flows.supervise import SUPERVISED_ENV, supervise
from flows.temporary_server import TemporaryServer, temporary_prefect_server
from tasks.prefect_api import lasting_api_url
from training.errors import (
    ERROR_FILE_ENV,
    GradlineError,
    OrchestratorUnreachable,
    as_user_error,
)
from training.host_client import stage_in_host
from training.lock import project_lock

if TYPE_CHECKING:
    from training.config import Config


def _cmd_run(args: argparse.Namespace) -> int:
    from training.config import load_config
    from training.project import Project, find_project_root

    root = find_project_root()
    # Validate before Prefect starts or anything is written: fail in a second, not ten.
    cfg = load_config(Project(root).params, args.set)
    # Started first, both come up while this process imports Prefect: the temporary
    # Prefect server (when no server is configured) and the stages' host, which imports
    # torch and MLflow once for every stage.
    with (
        temporary_prefect_server(needed=not prefect_api_configured()) as server,
        stage_host(),
    ):
        return _run_flow(args, root, cfg, server)


def _run_flow(
    args: argparse.Namespace, root: Path, cfg: Config, server: TemporaryServer | None
) -> int:
    import httpx

    from flows.pipeline import pipeline
    from tasks.watchdog import ensure_watchdogs

    if server is not None:
        server.wait_until_ready()
    # Before the flow run starts: the server's automations act only on runs whose first
    # events they saw (an event is held back while the one before it is unseen).
    ensure_watchdogs(cfg.orchestrate.notify)
    with project_lock(root, wait=not args.no_wait):  # the flow holds it too (deployments)
        try:
            summary = pipeline(
                overrides=args.set,
                force=args.force,
                root=str(root),
                accept_drift=args.accept_drift,
            )
        except httpx.TransportError as exc:
            raise prefect_unreachable(exc) from exc
    print(summary.describe())
    return 0


def nothing_changed_here(args: argparse.Namespace) -> bool:
    """`gradline run` when nothing changed and no Prefect server is there to record it,
    answered in seconds, before the supervisor starts the command (without a server,
    Prefect would start a temporary one, seconds, only to skip). The flow's own check
    (training.mlops.summary), the same push, the same summary. Anything not as the last
    run left it, or any error (the flow says what is wrong), and the flow runs."""
    from training.config import load_config
    from training.project import Project, find_project_root

    root = find_project_root()
    if args.force or args.set or not Project(root).train_result.is_file():
        return False  # asked to, or never run: the flow runs
    if prefect_api_configured():
        return False  # the server records the skip too
    from dataclasses import asdict

    from training.mlops.dvc_cli import StatusThenPush

    with project_lock(root, wait=not args.no_wait):
        dvc = StatusThenPush(root)  # runs while mlflow imports and answers
        try:
            from mlflow.exceptions import MlflowException

            from training.mlops.summary import up_to_date_run

            cfg = load_config(Project(root).params, [])
            latest = up_to_date_run(root, cfg, dvc.status, lambda message: None)
        except (GradlineError, MlflowException):
            latest = None
        # Waited for in any case: the flow's `dvc repro` needs DVC's lock.
        if not dvc.pushed() or latest is None:
            return False
    print(json.dumps(asdict(latest), indent=2))
    print(latest.describe())
    return True


def prefect_api_configured() -> bool:
    """Whether Prefect is pointed at an API server (read without importing Prefect)."""
    return prefect_setting_configured("PREFECT_API_URL")


def prefect_unreachable(exc: Exception) -> OrchestratorUnreachable:
    """What a run that lost the Prefect API kept, and how to go on."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    retries = settings.client.max_retries
    return OrchestratorUnreachable(
        f"the Prefect API at {lasting_api_url() or 'the temporary server'} stopped answering "
        f"({type(exc).__name__}: {exc}) and did not come back within the client's "
        f"{retries} retries (about {2 ** (retries + 1) - 2} s; PREFECT_CLIENT_MAX_RETRIES). "
        "What finished is kept: the stages dvc.lock records, training's checkpoints. The "
        "flow run stays Running in Prefect until the server's watchdog marks it Crashed. "
        "When the server answers again, run `gradline run` again: finished stages are "
        "skipped and training resumes from its last checkpoint"
    )


def _cmd_compare_updates(args: argparse.Namespace) -> int:
    from tasks.dvc_stages import reproduce_shards
    from training.mlops.compare import parse_rules, plan_comparison, run_comparison
    from training.mlops.tracking import store_errors
    from training.project import default_tracking_uri, find_project_root

    root = find_project_root()
    # Every child's config, the rules and the fault are checked before anything runs.
    plan = plan_comparison(
        root, parse_rules(args.rules), args.set, args.slow_rank, args.slow_factor
    )
    _start_worker_server()
    with project_lock(root, wait=not args.no_wait), store_errors(default_tracking_uri(root)):
        reproduce_shards(root)
        report = run_comparison(plan)
    print(report.describe())
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from tasks.dvc_stages import reproduce_shards
    from training.mlops.sweep import apply_best, plan_sweep, run_sweep
    from training.mlops.tracking import store_errors
    from training.project import default_tracking_uri, find_project_root

    root = find_project_root()
    if args.apply:
        with project_lock(root, wait=not args.no_wait):
            print(apply_best(root, args.set))
        return 0
    # The space, every bound's config and the quota are checked before anything runs.
    plan = plan_sweep(root, args.set, _devices_here)
    _start_worker_server()
    with project_lock(root, wait=not args.no_wait), store_errors(default_tracking_uri(root)):
        reproduce_shards(root)  # the data versioned once, for every trial
        report = run_sweep(plan)
    print(report.describe())
    return 0


def _start_worker_server() -> None:
    """The server the trials' and children's workers fork from, started once the input
    is checked (a refusal waits for nothing) and while this process still has one
    thread: then it is a fork of this process with the engine imported
    (training/engine/worker_start.py), not a new interpreter that imports torch, the
    engine and MLflow's store again (~4.6 CPU-s each command, which the first job's
    workers waited for)."""
    from training.engine.worker_start import start_worker_server

    start_worker_server()


def _devices_here() -> int:
    from tasks.quota import devices_here  # deferred: imports Prefect and torch

    return devices_here()


def _cmd_score(args: argparse.Namespace) -> int:
    from flows.score import plain, score_steps
    from training.mlops.tracking import store_errors
    from training.project import Project, find_project_root

    project = Project(find_project_root())
    project.config()  # params.yaml checked before anything is read or written
    # The model's download draws a bar per file on stderr; the summary says what happened.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    chosen = {"model": args.model, "input": args.input, "output": args.output}
    with project_lock(project.root, wait=not args.no_wait), store_errors(project.tracking_uri):
        print(score_steps(project.root, plain, **chosen, on_bad_rows=args.on_bad_rows))
    return 0


def _cmd_example(args: argparse.Namespace) -> int:
    from training.examples import apply_example, describe
    from training.project import Project, find_project_root

    if args.list or not args.name:
        print(describe())
        return 0
    project = Project(find_project_root())
    with project_lock(project.root, wait=not args.no_wait):
        cfg = apply_example(project.params, args.name)
    print(
        f"params.yaml now holds example {args.name}: {cfg.task.type} of {cfg.data.source} "
        f"data with model {cfg.model.name or cfg.model.target}. Run it with `gradline run`."
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from flows.deploy import serve_deployments
    from training.project import find_project_root

    serve_deployments(find_project_root(), args.deployment)
    return 0


def _cmd_deploy_train(args: argparse.Namespace) -> int:
    from flows.deploy import deploy_train
    from training.project import find_project_root

    project_dir = args.project_dir or str(find_project_root())
    name = deploy_train(args.pool, project_dir, args.image)
    print(
        f"deployment {name} runs the train stage on work pool {args.pool!r} in {project_dir}; "
        f"flows use it with orchestrate.train_pool={args.pool}"
    )
    return 0


def _cmd_lineage(args: argparse.Namespace) -> int:
    from flows.review import lineage_text, restore_data
    from training.mlops.tracking import store_errors
    from training.project import default_tracking_uri, find_project_root

    root = find_project_root()
    with store_errors(default_tracking_uri(root)):
        if args.restore_data:
            with project_lock(root):
                target = restore_data(root, args.model, Path(args.restore_data))
            print(f"restored the training data of {args.model} into {target}")
        else:
            print(lineage_text(root, args.model))
    return 0


def _cmd_runs(args: argparse.Namespace) -> int:
    from flows.review import runs_text
    from training.mlops.tracking import store_errors
    from training.project import default_tracking_uri, find_project_root

    root = find_project_root()
    with store_errors(default_tracking_uri(root)):
        print(runs_text(root, args.limit))
    return 0


def _cmd_sync(args: argparse.Namespace) -> int:
    from training.mlops.sync import ship_when_back
    from training.project import Project, find_project_root

    project = Project(find_project_root())
    cfg = project.config()
    with project_lock(project.root, wait=not args.no_wait):
        # No wait: the user runs this once the server is back; if it is not, say so now.
        done = ship_when_back(project.tracking_uri, project.checkpoints, 0, print, "ship them")
        for job in done:
            print(
                f"shipped {job.shipped.records} journal records ({job.shipped.checkpoints} "
                f"checkpoint copies) of job {job.job.path.name} to MLflow run {job.run_id}"
            )
        if not done:
            print("nothing to ship: every job's journal is in MLflow")
        print(_register_after_sync(project, cfg))
    return 0


def _register_after_sync(project, cfg) -> str:
    """Register the trained model as the flow's register step would (once: a version
    registered before is reported, not added again)."""
    from training.mlops.registration import register_trained
    from training.mlops.registry import is_gated
    from training.mlops.tracking import client

    if not (project.train_result.is_file() and project.metrics.is_file()):
        return "no trained and evaluated model to register (result.json, metrics.json)"
    run_id = project.read_train_result()["run_id"]
    before = is_gated(client(project.tracking_uri), cfg.registry.model_name, run_id)
    summary = register_trained(project.root, cfg, 0, print)
    state = "already registered" if before else "registered"
    return f"{state}: {summary.model_name} v{summary.version} -> alias {summary.alias!r}"


def _cmd_stage(args: argparse.Namespace) -> int:
    from training.project import Project, find_project_root
    from training.timings import timed_span

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    root = find_project_root()
    # The nodes of a multi-node job are one writer (their launcher queues jobs), and on
    # a shared filesystem they share one project folder: they do not lock it.
    multi_node = (
        args.name == "train"
        and Project(root).config(launch_overrides(args)).runtime.node_range[1] > 1
    )
    lock = contextlib.nullcontext() if multi_node else project_lock(root, wait=not args.no_wait)
    with lock, timed_span("stage_work", stage=args.name):
        _run_stage(args, root)
    return 0


def _run_stage(args: argparse.Namespace, root: Path) -> None:
    from training import stages

    if args.name == "ingest":
        profile = Path(args.profile) if args.profile else None
        stages.ingest_stage(root, Path(args.out), Path(args.quarantine), Path(args.report), profile)
    elif args.name == "shard":
        stages.shard_stage(root, Path(args.raw), Path(args.out))
    elif args.name == "train":
        stages.train_stage(
            root,
            Path(args.shards),
            Path(args.model),
            Path(args.checkpoints),
            Path(args.result),
            overrides=launch_overrides(args),
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
    elif args.name == "register":
        stages.register_stage(root, Path(args.summary))


def _cmd_ui(args: argparse.Namespace) -> int:
    from flows.ui import UiOptions, serve_uis
    from training.project import find_project_root

    options = UiOptions(
        mlflow_port=args.mlflow_port,
        prefect_port=args.prefect_port,
        host=args.host,
        auth=args.auth,
        allowed_hosts=args.allowed_hosts,
        workers=args.workers,
    )
    return serve_uis(find_project_root(), options)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradline", description="Orchestrated, tracked, reproducible training."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands = (
        _add_run,
        _add_compare,
        _add_sweep,
        _add_score,
        _add_example,
        _add_serve,
        _add_deploy_train,
    )
    for add in (*commands, _add_lineage, _add_runs, _add_sync, _add_stage, _add_ui):
        add(sub)  # each subcommand's arguments, in the order `gradline --help` lists them
    return parser


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="run the whole pipeline as a Prefect flow")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a params.yaml value; recorded in params.yaml (repeatable)",
    )
    run.add_argument(
        "--force",
        action="store_true",
        help="run every stage even when data, params and code are unchanged",
    )
    run.add_argument(
        "--accept-drift",
        action="store_true",
        help="train on new data that drifted from the champion's past a threshold "
        "although orchestrate.drift is block (remembered for this data version)",
    )
    _add_no_wait(run)
    run.set_defaults(func=_cmd_run)


def _add_no_wait(parser) -> None:
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="exit (code 2) at once if another run holds the project, instead of waiting",
    )


def _add_compare(sub) -> None:
    compare = sub.add_parser(
        "compare-updates",
        help="train the configuration once per update rule and compare them in MLflow",
        description="Train params.yaml (plus --set overrides, not written back) once per "
        "update.rule, each as a child MLflow run of one parent run that gets a "
        "table (throughput, final val_loss, bytes per step, each against sync) and plots "
        "of val_loss against seconds, samples and bytes. The data is brought up to date "
        "first with `dvc repro shard`; the pipeline's model, result and registry are "
        "left alone.",
    )
    compare.add_argument(
        "--rules",
        default="sync,local_sgd,diloco,async",
        metavar="RULE,RULE",
        help="comma-separated update rules (default: sync,local_sgd,diloco,async)",
    )
    compare.add_argument(
        "--slow-rank", type=int, metavar="R", help="make rank R a slower device in every child"
    )
    compare.add_argument(
        "--slow-factor",
        type=float,
        metavar="F",
        help="how many times longer the slow rank computes (above 1; default 2)",
    )
    compare.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a params.yaml value for this comparison only (repeatable)",
    )
    _add_no_wait(compare)
    compare.set_defaults(func=_cmd_compare_updates)


def _add_sweep(sub) -> None:
    sweep = sub.add_parser(
        "sweep",
        help="search params.yaml's sweep.space with Optuna, pruning trials that fall behind",
        description="Train trials of the sweep section's search space (Optuna: TPE or "
        "random sampling, median or ASHA pruning on the validation metric) as child MLflow "
        "runs of one parent run, which gets the trials table and plots. The data is "
        "brought up to date once (`dvc repro shard`); trials run as many at once as the "
        "device quota allows. Running it again continues the study (sweeps/<name>/) up to "
        "its budget; Ctrl-C stops the running trials at a checkpoint, and the next run "
        "trains them on. The pipeline's model, result and registry are left alone.",
    )
    sweep.add_argument(
        "--apply",
        action="store_true",
        help="write the best trial's keys into params.yaml (then `gradline run`)",
    )
    sweep.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a params.yaml value for this sweep only (repeatable)",
    )
    _add_no_wait(sweep)
    sweep.set_defaults(func=_cmd_sweep)


def _add_score(sub) -> None:
    score = sub.add_parser(
        "score",
        help="predict new rows with a registered model version (default: the champion)",
        description="Score the new rows under a folder with a registered model version: "
        "the rows are checked as ingest checks them, predicted in batches and written as "
        "Parquet (row key, prediction, class probabilities), DVC-tracked and recorded as an "
        "MLflow run linked to the version. Defaults come from the score section of "
        "params.yaml.",
    )
    score.add_argument("--model", help="NAME@ALIAS or NAME/VERSION (score.model)")
    score.add_argument("--input", metavar="FOLDER", help="the new rows (score.input)")
    score.add_argument("--output", metavar="PATH", help="the predictions' file (score.output)")
    score.add_argument(
        "--on-bad-rows",
        choices=("fail", "quarantine"),
        help="invalid rows stop the command, or are set aside beside the output "
        "(score.on_bad_rows)",
    )
    _add_no_wait(score)
    score.set_defaults(func=_cmd_score)


def _add_example(sub) -> None:
    example = sub.add_parser(
        "example", help="write a ready-made workload into params.yaml (--list names them)"
    )
    example.add_argument("name", nargs="?", help="the example's name")
    example.add_argument("--list", action="store_true", help="list the examples")
    _add_no_wait(example)
    example.set_defaults(func=_cmd_example)


def _add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="register prefect.yaml's deployments with the Prefect server and run them",
    )
    serve.add_argument("deployment", nargs="*", help="names of deployments to serve (default: all)")
    serve.set_defaults(func=_cmd_serve)


def _add_deploy_train(sub) -> None:
    deploy_train = sub.add_parser(
        "deploy-train",
        help="register the train-only deployment on a work pool (orchestrate.train_pool)",
    )
    deploy_train.add_argument("--pool", required=True, help="the Prefect work pool (GPU machines)")
    deploy_train.add_argument(
        "--project-dir",
        help="the gradline checkout on the pool's machines (default: this one)",
    )
    deploy_train.add_argument(
        "--image", help="container image holding that checkout (Kubernetes pools)"
    )
    deploy_train.set_defaults(func=_cmd_deploy_train)


def _add_lineage(sub) -> None:
    lineage = sub.add_parser("lineage", help="where a model version came from")
    lineage.add_argument("model", help="NAME@ALIAS, NAME/VERSION, or NAME (its champion)")
    lineage.add_argument(
        "--restore-data",
        metavar="DIR",
        help="check out the version's training data with DVC into DIR (inside the project)",
    )
    lineage.set_defaults(func=_cmd_lineage)


def _add_runs(sub) -> None:
    runs = sub.add_parser("runs", help="recent runs with their key metrics")
    runs.add_argument("-n", "--limit", type=_positive_int, default=20)
    runs.set_defaults(func=_cmd_runs)


def _add_sync(sub) -> None:
    sync = sub.add_parser(
        "sync",
        help="ship what jobs kept while the tracking server was down, then register the model",
        description="Ship every journal record and checkpoint copy that the project's jobs "
        "kept while the MLflow tracking server was down (each value once), then register "
        "the trained model as `gradline run` would. Run it once the server is back; "
        "running it again changes nothing. Exit code 2 if the server does not answer.",
    )
    _add_no_wait(sync)
    sync.set_defaults(func=_cmd_sync)


def _add_stage(sub) -> None:
    stage = sub.add_parser(
        "stage", help="run one DVC stage (what dvc.yaml calls), or the flow's register step"
    )
    stage_sub = stage.add_subparsers(dest="name", required=True)
    ingest = stage_sub.add_parser("ingest")
    for flag in ("--out", "--quarantine", "--report"):
        ingest.add_argument(flag, required=True)
    ingest.add_argument("--profile", help="the data profile for drift checks (data/profile.json)")
    shard = stage_sub.add_parser("shard")
    shard.add_argument("--raw", required=True)
    shard.add_argument("--out", required=True)
    train = stage_sub.add_parser("train")
    for flag in ("--shards", "--model", "--checkpoints", "--result"):
        train.add_argument(flag, required=True)
    _add_launch_flags(train)
    evaluate = stage_sub.add_parser("evaluate")
    for flag in ("--model", "--shards", "--result", "--metrics", "--plots"):
        evaluate.add_argument(flag, required=True)
    # Not a DVC stage: the flow's register step, run in a fork of its stage host.
    register = stage_sub.add_parser("register")
    register.add_argument("--summary", required=True, help="where the run summary goes (JSON)")
    _add_no_wait(stage)
    stage.set_defaults(func=_cmd_stage)


def _add_ui(sub) -> None:
    ui = sub.add_parser(
        "ui",
        help="serve the MLflow UI and a Prefect server (127.0.0.1) until Ctrl-C or SIGTERM",
    )
    ui.add_argument("--mlflow-port", type=int, default=5000)
    ui.add_argument("--prefect-port", type=int, default=4200)
    ui.add_argument(
        "--auth",
        action="store_true",
        help="team server: MLflow's basic-auth app; the first start creates the admin from "
        "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD",
    )
    ui.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the MLflow server listens on (not loopback: needs --auth)",
    )
    ui.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="HOST[,HOST...]",
        help="Host headers MLflow accepts besides localhost, private addresses and this "
        "machine's name, e.g. mlflow.example.org (others get 403)",
    )
    ui.add_argument(
        "--workers", type=_positive_int, default=1, help="MLflow server worker processes"
    )
    ui.set_defaults(func=_cmd_ui)


# torchrun's launch notions, with torchrun's environment names (PET_*) as defaults, so
# a Slurm script or a Kubernetes operator that sets them for torchrun sets them for us.
LAUNCH_FLAGS = {
    "--nnodes": ("runtime.nnodes", "PET_NNODES", "nodes as N or MIN:MAX (elastic)"),
    "--nproc-per-node": ("runtime.procs_per_node", "PET_NPROC_PER_NODE", "worker processes here"),
    "--rdzv-endpoint": ("runtime.rdzv_endpoint", "PET_RDZV_ENDPOINT", "HOST:PORT of node one"),
    "--rdzv-id": ("runtime.rdzv_id", "PET_RDZV_ID", "the same job id on every node"),
    "--local-addr": ("runtime.local_addr", "PET_LOCAL_ADDR", "this node's reachable address"),
}


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    for flag, (key, env, text) in LAUNCH_FLAGS.items():
        parser.add_argument(flag, default=None, help=f"{text} ({key}; env {env})")


def launch_overrides(args: argparse.Namespace) -> list[str]:
    """`key=value` overrides from the launch flags, else from torchrun's environment."""
    overrides = []
    for flag, (key, env, _) in LAUNCH_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_")) or os.environ.get(env)
        if value:
            overrides.append(f"{key}={value}")
    # Operators that only name the first pod (Kubeflow: PET_MASTER_ADDR/PORT).
    addr, port = os.environ.get("PET_MASTER_ADDR"), os.environ.get("PET_MASTER_PORT")
    if addr and port and not any(o.startswith("runtime.rdzv_endpoint=") for o in overrides):
        overrides.append(f"runtime.rdzv_endpoint={addr}:{port}")
    return overrides


# Commands whose work runs under a supervisor, so that a signal reaches their whole tree.
# `serve` too: Prefect starts each served run in serve's own process group, where a
# terminal's Ctrl-C would reach every process of the run at once.
SUPERVISED_COMMANDS = ("run", "compare-updates", "sweep", "serve")


def main(argv: list[str] | None = None) -> int:
    """The `gradline` command. Run as the process's own command (no `argv`), it ends the
    process itself once the command returned: without tearing down the interpreter."""
    code = _command(argv)
    if argv is None:
        end_process(code)
    return code


def _command(argv: list[str] | None) -> int:
    if (code := stage_in_host(argv)) is not None:
        return code
    apply_offline_defaults()
    args = build_parser().parse_args(argv)
    if args.command in SUPERVISED_COMMANDS and not os.environ.get(SUPERVISED_ENV):
        if args.command == "run" and nothing_changed_here(args):
            return 0
        argv = sys.argv[1:] if argv is None else argv
        # A stop is how a server normally ends: its own exit code, not 128 + the signal.
        return supervise(argv, _stop_grace_s(), signal_code=args.command != "serve")
    try:
        return args.func(args)
    except BrokenPipeError:  # `gradline lineage ... | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (GradlineError, OSError) as exc:
        error = as_user_error(exc)  # a full disk is the user's to fix, like bad input
        if error is None:
            raise
        print(f"gradline: error: {error}", file=sys.stderr)
        _record_error(error)
        return error.exit_code


def _stop_grace_s() -> float:
    """orchestrate.stop_grace_s of this project (the default where params are invalid:
    the command itself will say what is wrong)."""
    from training.config.sections import OrchestrateConfig
    from training.project import Project, find_project_root

    try:
        return Project(find_project_root()).config().orchestrate.stop_grace_s
    except GradlineError:
        return OrchestrateConfig().stop_grace_s


def _record_error(exc: GradlineError) -> None:
    """Leave the cause where the flow that started this stage can read it."""
    if target := os.environ.get(ERROR_FILE_ENV):
        record = {"type": type(exc).__name__, "message": str(exc), "exit_code": exc.exit_code}
        Path(target).write_text(json.dumps(record))


if __name__ == "__main__":
    sys.exit(main())
