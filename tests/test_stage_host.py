"""The stage host (flows/stage_host.py): a `gradline stage` command under it runs its
stage in a fork of the host, which must behave as the command run cold: the same
outputs and output lines, its exit code, signals passed on, nothing left running when
the command or the host's owner dies; and the command runs the stage itself when no
host answers. Every test starts processes and has a timeout."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flows.stage_host import STAGE_HOST_ENV, stage_host
from training.config import update_params_file
from training.host_client import HostedProcess
from training.mlops.dvc_cli import dvc_process
from training.tempdirs import owner_scope

from .conftest import copy_project

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(480)]

GRADLINE = str(Path(sys.executable).parent / "gradline")
SHARD = ["stage", "shard", "--raw", "data/raw", "--out"]
TRAIN = ["stage", "train", "--shards", "data/shards", "--model", "model"]
TRAIN += ["--checkpoints", "checkpoints", "--result", "result.json"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.pop(STAGE_HOST_ENV, None)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    return {**env, **extra}


@pytest.fixture(scope="module")
def ingested(tmp_path_factory) -> Path:
    """A project with its data ingested, run cold (no host)."""
    project = copy_project(tmp_path_factory.mktemp("stage-host") / "project")
    update_params_file(project / "params.yaml", {"data": {"max_rows": 600}})
    repro = [sys.executable, "-m", "dvc", "repro", "ingest"]
    done = subprocess.run(repro, cwd=project, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return project


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def _children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_a_stage_in_the_host_writes_and_says_what_the_cold_command_does(ingested) -> None:
    cold = subprocess.run(
        [GRADLINE, *SHARD, "shards-cold"], cwd=ingested, env=_env(), capture_output=True, text=True
    )
    assert cold.returncode == 0, cold.stderr[-3000:]
    with stage_host() as host:
        assert host is not None
        env = _env(**{STAGE_HOST_ENV: os.environ[STAGE_HOST_ENV]})
        hosted = subprocess.run(
            [GRADLINE, *SHARD, "shards-hosted"],
            cwd=ingested,
            env=env,
            capture_output=True,
            text=True,
        )
        bad = subprocess.run(
            [GRADLINE, "stage", "shard", "--raw", "data/missing", "--out", "x"],
            cwd=ingested,
            env=env,
            capture_output=True,
            text=True,
        )
    assert hosted.returncode == 0, hosted.stderr[-3000:]
    assert _digests(ingested / "shards-hosted") == _digests(ingested / "shards-cold")
    # The stage's own lines reach the command's stderr (a host that swallowed its
    # logging, as an import that configures the root logger would, fails here).
    said = [line.split(": ", 1)[1] for line in hosted.stderr.splitlines() if "shard:" in line]
    assert said and said == [
        line.split(": ", 1)[1].replace("shards-cold", "shards-hosted")
        for line in cold.stderr.splitlines()
        if "shard:" in line
    ]
    cold_bad = subprocess.run(
        [GRADLINE, "stage", "shard", "--raw", "data/missing", "--out", "x"],
        cwd=ingested,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert bad.returncode == cold_bad.returncode != 0  # bad input: the same exit code
    assert "data/missing" in bad.stderr
    assert host.poll() is not None  # stopped with its context


def _cold_dvc(project: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "dvc", *args]
    return subprocess.run(command, cwd=project, env=_env(), capture_output=True, text=True)


def test_a_dvc_command_in_the_host_answers_as_the_cold_one(ingested) -> None:
    """The flow's `dvc` commands fork from the host: the same answers, lines and exit
    codes as `python -m dvc`, and the fork is the host's child, not a new interpreter."""
    with stage_host() as host:
        env = _env(**{STAGE_HOST_ENV: os.environ[STAGE_HOST_ENV]})
        status = dvc_process(ingested, "status", "--json", env=env)
        assert isinstance(status, HostedProcess)
        assert psutil.Process(status.pid).ppid() == host.pid
        out, _ = status.communicate()
        assert json.loads(out) == json.loads(_cold_dvc(ingested, "status", "--json").stdout)
        assert "shard" in json.loads(out)  # a real answer: shard has not run yet

        merged = dvc_process(
            ingested, "repro", "--single-item", "ingest", env=env, stderr=subprocess.STDOUT
        )
        lines = [line.rstrip() for line in merged.stdout]
        assert merged.wait(timeout=60) == 0 and merged.poll() == 0
        cold = _cold_dvc(ingested, "repro", "--single-item", "ingest")
        assert lines == (cold.stdout + cold.stderr).splitlines()
        assert "Stage 'ingest' didn't change, skipping" in lines

        bad = dvc_process(ingested, "repro", "no-such-stage", env=env)
        _, err = bad.communicate()
    cold_bad = _cold_dvc(ingested, "repro", "no-such-stage")
    assert bad.returncode == cold_bad.returncode != 0
    assert "no-such-stage" in err and err == cold_bad.stderr


def test_no_host_answering_means_the_command_runs_the_stage_itself(ingested, tmp_path) -> None:
    env = _env(**{STAGE_HOST_ENV: str(tmp_path / "nobody.sock")})
    done = subprocess.run(
        [GRADLINE, *SHARD, "shards-alone"], cwd=ingested, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (ingested / "shards-alone" / "manifest.json").is_file()


def _start_slow_training(project: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """The train stage through the host, slowed so that it is still training when the
    test acts; returns once the fork has started training (a checkpoint exists)."""
    slow = {**env, "GRADLINE_FAULT": "slow:rank=0:step=0:seconds=0.2"}
    with log.open("w") as out:
        command = subprocess.Popen(
            [GRADLINE, *TRAIN], cwd=project, env=slow, stdout=out, stderr=out
        )
    deadline = time.monotonic() + 200  # the host's preload: minutes on a loaded host
    while not list(project.glob("checkpoints/*/step-????????")):
        assert command.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    return command


@pytest.fixture
def sharded(ingested, tmp_path) -> Path:
    project = tmp_path / "project"
    subprocess.run(["cp", "-a", str(ingested), str(project)], check=True)
    done = subprocess.run([GRADLINE, *SHARD, "data/shards"], cwd=project, env=_env())
    assert done.returncode == 0
    update_params_file(project / "params.yaml", {"train": {"epochs": 200}})
    return project


def test_sigterm_to_the_command_reaches_the_stage_which_checkpoints(sharded, tmp_path) -> None:
    with stage_host() as host:
        env = _env(**{STAGE_HOST_ENV: os.environ[STAGE_HOST_ENV]})
        command = _start_slow_training(sharded, env, tmp_path / "train.log")
        forks = _children(host.pid)
        assert forks, "the stage did not run in the host"
        command.send_signal(signal.SIGTERM)
        code = command.wait(timeout=200)
    log = (tmp_path / "train.log").read_text()
    assert code == 75, log[-3000:]  # the stage's own preemption exit, passed back
    assert "stopping at step" in log
    psutil.wait_procs(forks, timeout=120)
    assert not [p for p in forks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_killed_command_takes_its_stage_and_workers_along(sharded, tmp_path) -> None:
    with stage_host() as host:
        env = _env(**{STAGE_HOST_ENV: os.environ[STAGE_HOST_ENV]})
        command = _start_slow_training(sharded, env, tmp_path / "train.log")
        forks = _children(host.pid)
        assert len(forks) >= 4, forks  # the stage, its workers' server, 2 workers, helper
        # Nothing under the host imports torch or MLflow again: the workers' server and
        # rank 0's tracking helper are forks too, not new interpreters.
        spawned = [p.cmdline() for p in forks if "-c" in p.cmdline()]
        assert all("resource_tracker" in " ".join(argv) for argv in spawned), spawned
        command.kill()
        command.wait()
        _, alive = psutil.wait_procs(forks, timeout=120)
        assert not alive, [p.cmdline() for p in alive]


def test_the_host_ends_with_the_process_that_started_it(tmp_path) -> None:
    owner_code = (
        "import os, sys, time\n"
        "from flows.stage_host import stage_host\n"
        "with stage_host() as host:\n"
        "    print(host.pid, os.environ['GRADLINE_STAGE_HOST'], flush=True)\n"
        "    time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True, env=_env()
    )
    pid, socket_path = owner.stdout.readline().split()
    # Named for its owner: were both SIGKILLed, the next folder of its kind removes it.
    assert Path(socket_path).parent.name.startswith(f"gradline-host-{owner_scope()}-{owner.pid}-")
    host = psutil.Process(int(pid))
    owner.kill()  # no chance to remove the socket's folder itself
    owner.wait()
    host.wait(timeout=30)  # raises if the host outlived its owner
    assert not Path(socket_path).parent.exists()  # the host removed it


def test_the_installed_command_hands_a_stage_over_before_importing_the_cli() -> None:
    """`gradline` is flows/command.py, which reaches the host with the standard library
    and host_client alone; the CLI (argparse, tracking, servers) loads only for the rest."""
    from importlib.metadata import entry_points

    (entry,) = entry_points(group="console_scripts", name="gradline")
    assert entry.value == "flows.command:main"
    probe = "import sys, flows.command; print(sorted(m for m in sys.modules if m.startswith(("
    probe += "'flows.cli', 'training.mlops', 'training.config', 'argparse', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_host_finds_mlflow_s_schema_head_once_for_every_store_it_forks(tmp_path) -> None:
    """The host's last preload step keeps MLflow's newest schema revision: a store opened
    afterwards asks for it without loading the migration scripts again, and gets the
    same answer MLflow computes; a new store is still created."""
    script = f"""
from alembic.script import ScriptDirectory
from mlflow.store.db import utils
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from flows.stage_host import _remember_mlflow_schema_head, preload_steps

assert preload_steps([])[-1] is _remember_mlflow_schema_head  # the host runs it
uncached = utils._get_latest_schema_revision
_remember_mlflow_schema_head()
_remember_mlflow_schema_head()  # a second warm-up does not wrap it twice
head = utils._get_latest_schema_revision
assert head.__wrapped__ is uncached, "wrapped more than once"
(expected,) = ScriptDirectory.from_config(utils._get_alembic_config(db_url="")).get_heads()
assert head() == expected
before = head.cache_info()
store = SqlAlchemyStore("sqlite:///{tmp_path / "mlflow.db"}", "{tmp_path / "artifacts"}")
assert store.search_experiments()  # the new store's default experiment
after = head.cache_info()
assert after.misses == before.misses and after.hits > before.hits, (before, after)
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_a_fork_does_not_run_torch_s_teardown_as_it_ends(tmp_path) -> None:
    """Once a preload step has imported torch, the host's forks end without torch's exit
    handlers (its compile-time table, its operator libraries unregistered one by one):
    ~0.06 s of every fork's end. Handlers the command registers itself still run."""
    script = f"""
import atexit, collections, os, socket, weakref
from flows import stage_host

listener = socket.socket(socket.AF_UNIX)
listener.bind({str(tmp_path / "host.sock")!r})
steps = collections.deque(stage_host.import_steps(["torch._dynamo"]))
host = stage_host._Host(listener, os.getpid(), [stage_host.Preload(steps, holds=lambda s: True)])
host._preload_next()  # torch and torch._dynamo imported, as the host's phases do

import torch.library
import torch._dynamo.utils as dynamo_utils

unregisters = torch.library._del_library
libraries = [f for f in list(weakref.finalize._registry) if (f.peek() or [0, 0])[1] is unregisters]
assert len(libraries) > 50 and not any(f.atexit for f in libraries), len(libraries)
ran = []
dynamo_utils.compile_times = lambda **kwargs: ran.append("torch's compile times") or ""
atexit.register(ran.append, "the command's own")
atexit._run_exitfuncs()  # as a fork's end_process does
print(ran)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == '["the command\'s own"]', proc.stdout


def _host_with(tmp_path, preloads):
    import socket

    from flows import stage_host

    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "host.sock"))
    host = stage_host._Host(listener, os.getpid(), preloads)
    return host, listener


def _close(host, listener) -> None:
    for key in list(host.selector.get_map().values()):
        if key.fileobj is not listener:
            os.close(key.fd)
    host.selector.close()
    os.close(host.wake_write)
    listener.close()


def test_a_stage_waits_only_for_the_preload_phases_it_needs(tmp_path, monkeypatch) -> None:
    """Ingest and shard start once what every stage imports is loaded; train waits for
    torch and the engine too; a `dvc` command waits for nothing; the last phase holds
    no stage. Held stages start as soon as their phases are done, in the order asked,
    and each fork still sees the requests not started yet (to close its copies)."""
    import collections

    from flows import stage_host

    done: list[str] = []

    def steps(phase: str, count: int):
        return collections.deque(lambda n=n: done.append(f"{phase}{n}") for n in range(count))

    host, listener = _host_with(
        tmp_path,
        [
            stage_host.Preload(steps("every", 2), holds=lambda stage: True),
            stage_host.Preload(
                steps("model", 2), holds=lambda stage: stage not in stage_host.DATA_STAGES
            ),
            stage_host.Preload(steps("later", 2), holds=lambda stage: False),
        ],
    )
    started: list[tuple[str, list[str], list[str]]] = []

    def fork(conn, request, streams) -> None:
        waiting = [entry[1]["argv"][1] for entry in host.others_waiting()]
        started.append((request["argv"][1], list(done), waiting))

    monkeypatch.setattr(host, "_fork", fork)
    for argv in (["stage", "train"], ["stage", "ingest"], ["stage", "shard"], ["dvc", "status"]):
        host._start_or_hold(None, {"argv": argv}, [])
    assert started == [("status", [], ["train", "ingest", "shard"])]  # DVC at once
    while any(preload.steps for preload in host.preloads):
        host._preload_next()
    every, model = ["every0", "every1"], ["every0", "every1", "model0", "model1"]
    assert started[1:] == [
        ("ingest", every, ["train", "shard"]),  # shard: released, not forked yet
        ("shard", every, ["train"]),
        ("train", model, []),
    ]
    assert done[-2:] == ["later0", "later1"]
    assert not host.others_waiting()
    host._start_or_hold(None, {"argv": ["stage", "evaluate"]}, [])  # all loaded: at once
    assert started[-1][0] == "evaluate"
    _close(host, listener)


def test_a_failing_preload_step_leaves_the_host_serving(tmp_path, monkeypatch, capfd) -> None:
    """A step that raises (an import failing with something other than ImportError)
    must not end the host: stages forked from it may be running, and they die with it."""
    import collections

    from flows import stage_host

    done: list[str] = []

    def broken() -> None:
        raise RuntimeError("a module that fails as it is imported")

    host, listener = _host_with(
        tmp_path,
        [
            stage_host.Preload(
                collections.deque([broken, lambda: done.append("next")]), holds=lambda s: True
            )
        ],
    )
    started: list[str] = []
    monkeypatch.setattr(host, "_fork", lambda conn, request, streams: started.append("train"))
    host._start_or_hold(None, {"argv": ["stage", "train"]}, [])
    host._preload_next()
    host._preload_next()
    assert done == ["next"] and started == ["train"]
    assert "a preload step failed" in capfd.readouterr().err
    _close(host, listener)


def test_every_module_the_host_preloads_is_installed() -> None:
    """A preload step skips a module that is not installed (the command that needs it
    says so), so a misspelt or renamed module would cost its import in every command
    silently: each name must resolve to an installed module."""
    import importlib.util

    from flows import stage_host

    names = (
        *stage_host.DVC_PRELOAD,
        *stage_host.PRELOAD,
        *stage_host.MODEL_PRELOAD,
        *stage_host.LATER_PRELOAD,
    )
    assert [name for name in names if importlib.util.find_spec(name) is None] == []
