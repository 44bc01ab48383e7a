"""uvicorn's command, with Python's garbage collector tuned first (training/gc_tuning.py).

gradline runs its temporary Prefect server this way (flows/temporary_server.py): the
server process spends most of its start importing Prefect's server package, which took
3.4 CPU-s with Python's default thresholds and 3.0 tuned, on a 2-core machine where the
flow's own imports run beside it.
"""

from __future__ import annotations

from training.gc_tuning import tune_collector


def main() -> None:
    tune_collector()
    from uvicorn.main import main as uvicorn_main

    uvicorn_main(prog_name="uvicorn")  # its options from sys.argv, its exit codes


if __name__ == "__main__":
    main()
