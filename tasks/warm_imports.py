"""Imports the flow needs later, done now in a background thread while stages run.

The flow process spends most of a run waiting for its `dvc` commands; a module it will
need only later (MLflow for registration) is imported meanwhile instead of when the
flow gets there. The flow waits for them before training starts (a thread of the flow
taking a core from a worker would slow every rank).

One thread imports everything queued, one module after another: two packages built on
SQLAlchemy's ORM must never be imported side by side (configuring one's mappers while
the other's models are half defined fails). Code about to use what was queued calls
`wait_for_background_imports` first. An import the flow reaches while the thread is at
it waits for that same import (Python's import lock); it never runs twice.
"""

from __future__ import annotations

import importlib
import logging
import queue
import threading

log = logging.getLogger(__name__)
_queued: queue.Queue[str] | None = None
_starting = threading.Lock()


def import_in_background(*modules: str) -> None:
    """Queue `modules` for the background importer (started on first use)."""
    global _queued
    with _starting:
        if _queued is None:
            _queued = queue.Queue()
            threading.Thread(
                target=_import_queued, args=(_queued,), name="warm-imports", daemon=True
            ).start()
    for module in modules:
        _queued.put(module)


def wait_for_background_imports() -> None:
    """Return once every queued module is imported (or failed to be)."""
    if _queued is not None:
        _queued.join()


def _import_queued(modules: queue.Queue[str]) -> None:
    while True:
        module = modules.get()
        try:
            importlib.import_module(module)
        except Exception as exc:  # the code that needs it imports it again, and reports it
            log.debug("background import of %s failed: %s", module, exc)
        finally:
            modules.task_done()
