"""The `gradline` command as installed (pyproject.toml's [project.scripts]).

Under a flow, DVC starts `gradline stage NAME` for each stage, and the stage runs in the
flow's stage host (flows/stage_host.py): this process only stands in for the host's fork
(training/host_client.py). It hands the stage over before importing anything beyond the
standard library; the CLI's own imports (its parser, the tracking and server modules)
would cost each stage about 0.2 s of a small machine's CPU for nothing. Every other
command, and a stage with no host, goes on to `flows.cli`.
"""

from __future__ import annotations

from flows.process_end import end_process
from training.gc_tuning import tune_collector
from training.host_client import stage_in_host


def main(argv: list[str] | None = None) -> int:
    """The installed command: a hosted stage at once, else the whole CLI. Run as the
    process's own command (no `argv`), it ends the process itself (flows.cli.main)."""
    tune_collector()  # before the CLI imports Prefect, MLflow or torch
    if argv is None and (code := stage_in_host(None)) is not None:
        end_process(code)
    from flows.cli import main as cli_main

    return cli_main(argv)
