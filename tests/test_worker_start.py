"""Workers forked from a server that started earlier (training.engine.worker_start) see
the launcher's environment and output of now, with torch elastic's variables kept."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from training.engine import worker_start
from training.engine.worker_start import (
    LaunchContext,
    adopt,
    launch_environment,
    start_method,
)
from training.gc_tuning import YOUNG_GENERATION


def test_a_worker_takes_the_launchers_environment_and_keeps_what_elastic_set():
    server = {"STALE": "from the server", "SAME": "1", "RANK": "0", "OMP_NUM_THREADS": "4"}
    # A forked worker: the server's environment, then what elastic set for this worker.
    current = {**server, "RANK": "0", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "job"}
    launcher = {"SAME": "1", "NEW": "since the server started", "OMP_NUM_THREADS": "1"}
    assert launch_environment(launcher, current, at_import=server) == {
        "SAME": "1",
        "NEW": "since the server started",
        "OMP_NUM_THREADS": "1",  # the launcher's, not the server's
        # elastic's, even RANK whose value equals the server's
        "RANK": "0",
        "LOCAL_RANK": "1",
        "TORCHELASTIC_RUN_ID": "job",
    }
    # A spawned worker: it imported the engine in the launcher's environment already.
    spawned = {**launcher, "RANK": "3"}
    assert launch_environment(launcher, spawned, at_import=launcher) == spawned


def _report(rank: int, context: LaunchContext, out: str) -> None:
    """A worker: what elastic would set, then adopt, then report what it sees."""
    os.environ["RANK"] = str(rank)
    adopt(context)
    print(f"worker {rank} writes to the launcher's stdout", flush=True)
    keys = ("GRADLINE_TEST_PROBE", "GRADLINE_TEST_STALE", "RANK")
    Path(out).write_text(json.dumps({k: os.environ.get(k) for k in keys}))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform != "linux", reason="stdout is reattached through /proc")
def test_a_worker_forked_by_an_older_server_sees_the_launcher_of_now(tmp_path, monkeypatch):
    monkeypatch.delenv(worker_start.START_ENV, raising=False)
    assert start_method() == "forkserver"
    monkeypatch.setenv("GRADLINE_TEST_STALE", "the server keeps this")
    first = tmp_path / "first.json"
    mp.start_processes(_report, (LaunchContext(), str(first)), nprocs=1, start_method="forkserver")
    assert json.loads(first.read_text())["GRADLINE_TEST_STALE"] == "the server keeps this"

    # Since the server started: a variable set, one removed, and stdout moved elsewhere.
    monkeypatch.setenv("GRADLINE_TEST_PROBE", "set after the server started")
    monkeypatch.delenv("GRADLINE_TEST_STALE")
    moved = tmp_path / "stdout.txt"
    saved = os.dup(1)
    sys.stdout.flush()
    target = os.open(moved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(target, 1)
    try:
        second = tmp_path / "second.json"
        context = LaunchContext()
        mp.start_processes(_report, (context, str(second)), nprocs=1, start_method="forkserver")
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(target)
    seen = json.loads(second.read_text())
    assert seen == {
        "GRADLINE_TEST_PROBE": "set after the server started",
        "GRADLINE_TEST_STALE": None,
        "RANK": "0",
    }
    assert "worker 0 writes to the launcher's stdout" in moved.read_text()


def _report_collection(rank: int, out: str) -> None:
    """A worker: its collector's young generation, how many objects it inherited frozen,
    and how many pages of memory a full collection writes to (each a page copied from the
    server)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    gc.collect()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    seen = {"young": gc.get_threshold()[0], "frozen": gc.get_freeze_count(), "faults": faults}
    Path(out).write_text(json.dumps(seen))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_full_collection_in_a_worker_leaves_the_servers_pages_alone(tmp_path, monkeypatch):
    """multiprocessing's server (what a test process, a sweep or a CUDA build uses) tunes
    its collector before importing the engine and freezes what it imported before it
    forks (training/engine/forkserver_preload.py). Measured: unfrozen, a worker's first
    full collection wrote to ~35,000 pages (~140 MB copied, ~0.3 s of CPU); frozen, to
    ~120."""
    monkeypatch.delenv(worker_start.START_ENV, raising=False)
    assert start_method() == "forkserver"
    out = tmp_path / "collection.json"
    mp.start_processes(_report_collection, (str(out),), nprocs=1, start_method="forkserver")
    seen = json.loads(out.read_text())
    assert seen["young"] == YOUNG_GENERATION, seen  # a new interpreter's default is 700
    assert seen["frozen"] > 100_000, seen  # torch's, the engine's and MLflow's objects
    assert seen["faults"] < 2_000, seen


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_a_pinned_rank_runs_on_its_own_cores_only():
    from training.engine.worker import _pin_to_cores

    allowed = os.sched_getaffinity(0)
    cores = sorted(allowed)
    try:
        _pin_to_cores(local_rank=1, threads=1)
        assert os.sched_getaffinity(0) == {cores[1 % len(cores)]}
        os.sched_setaffinity(0, allowed)
        _pin_to_cores(local_rank=0, threads=2)  # wraps around when cores run out
        assert os.sched_getaffinity(0) == {cores[0], cores[1 % len(cores)]}
    finally:
        os.sched_setaffinity(0, allowed)


def _worker_that_waits(rank: int, context: LaunchContext, out: str) -> None:
    """A worker as the engine starts one (adopt, then die with the agent), that waits."""
    from training.engine.worker import _die_with_the_agent

    adopt(context)
    _die_with_the_agent()
    Path(out).write_text(str(os.getpid()))
    time.sleep(600)


LAUNCHER = """
import sys
import torch.multiprocessing as mp
from training.engine.worker_start import LaunchContext, start_method
from tests.test_worker_start import _worker_that_waits
mp.start_processes(
    _worker_that_waits, (LaunchContext(), sys.argv[1]), nprocs=1, start_method=start_method()
)
"""


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform != "linux", reason="a worker dies with its agent on Linux")
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_worker_dies_with_its_launcher_however_it_was_started(tmp_path, method):
    # The forkserver outlives a killed launcher (its workers hold its liveness pipe), so a
    # forked worker cannot rely on its parent's death: a lost node would keep training.
    out = tmp_path / "worker.pid"
    env = {**os.environ, worker_start.START_ENV: method}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(out)], cwd=Path(__file__).parent.parent, env=env
    )
    deadline = time.monotonic() + 90
    while not out.is_file() or not out.read_text():
        assert launcher.poll() is None and time.monotonic() < deadline, "no worker started"
        time.sleep(0.1)
    worker = int(out.read_text())
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=30)
    try:
        while not _gone(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived its launcher"
            time.sleep(0.1)
    finally:  # never left behind, whatever the outcome
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


# A train stage started cold, as far as its workers' server goes: it starts the server
# (a fork of itself on a CPU-only torch), starts one process from it and prints the
# server's, that process's and its own command line.
COLD_STAGE = """
import json, sys, time
import multiprocessing.forkserver as forkserver
import torch.multiprocessing as mp
from training.engine.worker_start import start_worker_server
start_worker_server()
worker = mp.get_context("forkserver").Process(target=time.sleep, args=(60,))
worker.start()
def cmdline(pid):
    return open(f"/proc/{pid}/cmdline", "rb").read().split(bytes(1))
server = forkserver._forkserver._forkserver_pid
print(json.dumps([[a.decode() for a in cmdline(p) if a] for p in (server, worker.pid, "self")]))
worker.kill()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.skipif(sys.platform != "linux", reason="command lines through /proc")
def test_a_cold_stages_server_and_workers_do_not_carry_its_command_line():
    """`pkill -TERM -f "gradline stage train"` is how an operator stops a job at a
    checkpoint: it must reach the stage, not the server forked from it or its workers."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip("a CUDA build's server is a new interpreter (the suite installs CPU torch)")
    proc = subprocess.run(
        [sys.executable, "-c", COLD_STAGE, "gradline", "stage", "train", "--shards", "data"],
        cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    server, worker, stage = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stage[-5:] == ["gradline", "stage", "train", "--shards", "data"]
    for forked in (server, worker):
        assert forked[0].startswith("gradline-workers (server of pid"), forked
        assert "stage" not in " ".join(forked), forked


# A worker's first steps, in a process that imported what the server preloads.
WORKER_IMPORTS = """
import importlib, sys
from training.engine.worker_start import PRELOAD
for module in PRELOAD:
    importlib.import_module(module)
before = set(sys.modules)
import torch
from training.engine.state import make_optimizer
from training.config import Config
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
optimizer = make_optimizer(list(model.parameters()), Config().optim)
model(torch.randn(4, 8)).sum().backward()
optimizer.step()
optimizer.zero_grad()
compiler = ("torch._dynamo", "torch._inductor")
print(sorted(m for m in set(sys.modules) - before if m.startswith(compiler)))
"""


@pytest.mark.timeout(120)
def test_a_forked_worker_imports_no_compiler_of_its_own() -> None:
    # torch's optimizers import TorchDynamo as they are built (~0.35 s of CPU): in the
    # server's preload, not in every worker of every attempt.
    done = subprocess.run(
        [sys.executable, "-c", WORKER_IMPORTS], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_stage_host_preloads_what_the_workers_server_does() -> None:
    from flows.stage_host import MODEL_PRELOAD, PRELOAD

    assert set(worker_start.PRELOAD) <= {*PRELOAD, *MODEL_PRELOAD}
