"""More than one node: one agent per node (`gradline stage train` with torchrun's launch
flags), c10d rendezvous, the control plane in the rendezvous store.

Each node runs in its own working folder with its own copy of the shards; the nodes share
only the checkpoint location and the tracking store (which a team runs as a server).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from training.config import Config, update_params_file
from training.engine.launch import free_port
from training.engine.signing import SECRET_ENV
from training.errors import PREEMPTED_EXIT_CODE, ConfigError
from training.host_client import STAGE_HOST_ENV
from training.mlops.runs import check_checkpoint_location
from training.mlops.tracking import client, ensure_experiment
from training.models.folder import load_model_dir

from .conftest import REPO
from .resume_checks import (
    Resumed,
    assert_resume_tags,
    assert_resumed,
    resumes_of,
    stopped_steps,
)
from .servers import SharedStageHost, made_once_for_the_run
from .test_deploy_recipes import FAKE_SCONTROL, FAKE_SRUN, SBATCH

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

GRADLINE = str(Path(sys.executable).parent / "gradline")
PARAMS = {
    "model": {"name": "mlp", "hidden": 32, "depth": 2},
    "optim": {"lr": 0.01, "warmup_steps": 5},
    "train": {"epochs": 3, "batch_size": 32, "deterministic": True},
    "runtime": {
        "procs_per_node": 1,
        "checkpoint_every_steps": 8,
        "log_every_steps": 4,
        "control_every_steps": 2,
        "rdzv_last_call_s": 2,
        "collective_timeout_s": 30,
    },
}


class Cluster:
    """Node folders and what the nodes share, all under one temporary folder."""

    def __init__(self, base: Path, shards: Path) -> None:
        self.base, self.shards = base, shards
        self.checkpoints = base / "shared" / "checkpoints"
        self.tracking_uri = f"sqlite:///{base / 'shared' / 'tracking' / 'mlflow.db'}"
        (base / "shared" / "tracking").mkdir(parents=True)
        # The tracking server's artifact store: every node's rank 0 writes there.
        artifacts = (base / "shared" / "artifacts").as_uri()
        self.experiment = ensure_experiment(self.tracking_uri, "gradline", artifacts)
        # Every node of a job holds the same secret for its control records.
        self.secret = secrets.token_hex(32)

    def node(self, name: str, **runtime) -> Path:
        folder = self.base / name
        folder.mkdir()
        shutil.copy(REPO / "dvc.yaml", folder / "dvc.yaml")
        shutil.copy(REPO / "params.yaml", folder / "params.yaml")
        params = {**PARAMS, "runtime": {**PARAMS["runtime"], **runtime}}
        update_params_file(folder / "params.yaml", params, replace=frozenset({"model"}))
        shutil.copytree(self.shards, folder / "shards")
        return folder

    def start(
        self, folder: Path, *flags: str, netns: str | None = None, hosted: bool = True, **env
    ):
        """A node's agent: `gradline stage train` in `folder`, run as `gradline run` runs
        its stages, a fork of the test process's stage host (tests/servers.py) behind a
        command that passes signals on and dies with it. A node in a network namespace of
        its own, or one whose process tree a test inspects (`hosted=False`), starts cold."""
        command = [
            GRADLINE,
            *("stage", "train", "--shards", "shards", "--model", "model"),
            *("--checkpoints", str(self.checkpoints), "--result", "result.json", *flags),
        ]
        if netns:
            command = ["ip", "netns", "exec", netns, *command]
        environ = {
            **os.environ,
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            SECRET_ENV: self.secret,
            **env,
        }
        if hosted and not netns:
            environ[STAGE_HOST_ENV] = SharedStageHost.socket()
        log = (folder / "node.log").open("w")
        return subprocess.Popen(command, cwd=folder, env=environ, stdout=log, stderr=log)

    def runs(self) -> list:
        return client(self.tracking_uri).search_runs([self.experiment])


def _node_flags(nnodes: str, endpoint: str, job: str) -> tuple[str, ...]:
    return ("--nnodes", nnodes, "--rdzv-endpoint", endpoint, "--rdzv-id", job)


def _finish(procs, folders, timeout: float = 300) -> list[int]:
    """Every node's exit code (killing them all if one overruns `timeout`)."""
    deadline = time.monotonic() + timeout
    for proc, folder in zip(procs, folders, strict=True):
        try:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError((folder / "node.log").read_text()[-3000:]) from None
    return [proc.returncode for proc in procs]


def _wait(procs, folders, timeout: float = 300) -> None:
    for code, folder in zip(_finish(procs, folders, timeout), folders, strict=True):
        assert code == 0, (folder / "node.log").read_text()[-3000:]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model_dir(model_dir)
    return model.state_dict()


def _reference(cluster: Cluster) -> dict[str, torch.Tensor]:
    """One node with two ranks, the same job otherwise: trained once for the test run
    (this file's tests and the node-loss test run in different test processes)."""

    def train(path: Path) -> None:
        folder = cluster.node("one-node", procs_per_node=2)
        proc = cluster.start(folder)
        _wait([proc], [folder])
        torch.save(_weights(folder / "model"), path)

    return torch.load(made_once_for_the_run("multinode-reference.pt", train), weights_only=True)


def _identical(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _one_value_per_step(cluster: Cluster, run_id: str) -> None:
    history = client(cluster.tracking_uri).get_metric_history(run_id, "train_loss")
    steps = [m.step for m in history]
    assert steps == sorted(set(steps)) == list(range(1, len(steps) + 1)), steps


def test_two_nodes_of_one_rank_equal_one_node_of_two(tiny_shards, tmp_path) -> None:
    cluster = Cluster(tmp_path, tiny_shards)
    expected = _reference(cluster)
    flags = _node_flags("2", f"127.0.0.1:{free_port()}", "two-nodes")
    folders = [cluster.node("node-a"), cluster.node("node-b")]
    procs = [cluster.start(folder, *flags) for folder in folders]
    _wait(procs, folders)
    _check_two_node_job(cluster, folders, expected)


def test_two_nodes_in_two_network_namespaces(tiny_shards, tmp_path) -> None:
    """The same job across a veth pair between two network namespaces: each node sees
    only its own address and the other's, as two machines on one link would."""
    spaces = _namespaces(f"gl{os.getpid() % 10000}")
    try:
        cluster = Cluster(tmp_path, tiny_shards)
        expected = _reference(cluster)
        endpoint = f"{spaces[0][2]}:29531"
        folders = [cluster.node("node-a"), cluster.node("node-b")]
        procs = []
        for folder, (netns, device, address) in zip(folders, spaces, strict=True):
            flags = (*_node_flags("2", endpoint, "netns"), "--local-addr", address)
            procs.append(cluster.start(folder, *flags, netns=netns, GLOO_SOCKET_IFNAME=device))
        _wait(procs, folders)
        _check_two_node_job(cluster, folders, expected)
    finally:
        for netns, _, _ in spaces:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def _namespaces(tag: str) -> list[tuple[str, str, str]]:
    """Two network namespaces joined by a veth pair: (name, device, address) each."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    spaces = [(f"{tag}a", f"{tag}va", "10.231.7.1"), (f"{tag}b", f"{tag}vb", "10.231.7.2")]
    (ns_a, dev_a, _), (ns_b, dev_b, _) = spaces
    commands = [
        ["netns", "add", ns_a],
        ["netns", "add", ns_b],
        ["link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", dev_b, "netns", ns_b],
    ]
    for netns, device, address in spaces:
        commands += [
            ["-n", netns, "addr", "add", f"{address}/24", "dev", device],
            ["-n", netns, "link", "set", device, "up"],
            ["-n", netns, "link", "set", "lo", "up"],
        ]
    for command in commands:
        made = subprocess.run(["ip", *command], capture_output=True, text=True)
        if made.returncode != 0:
            for netns, _, _ in spaces:
                subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            pytest.skip(
                f"cannot make network namespaces here: ip {' '.join(command)}: "
                f"{made.stderr.strip()}"
            )
    return spaces


def _check_two_node_job(cluster: Cluster, folders: list[Path], expected) -> None:
    finished = [f for f in folders if (f / "model").is_dir()]
    assert len(finished) == 1  # the node that ran rank 0 records the model
    assert _identical(_weights(finished[0] / "model"), expected)
    runs = [r for r in cluster.runs() if r.data.tags.get("gradline.runtime.nnodes") == "2"]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    _one_value_per_step(cluster, runs[0].info.run_id)
    assert not any(cluster.checkpoints.rglob("rank*.json"))  # no heartbeat files
    metrics = runs[0].data.metrics  # each node's system metrics, named by node
    assert {"system_cpu_percent/node0", "system_cpu_percent/node1"} <= metrics.keys()


@pytest.mark.timeout(720)
def test_losing_a_node_the_job_goes_on_with_the_other(tiny_shards, tmp_path) -> None:
    """nnodes 1:2: SIGKILL to the second node's agent (its workers die with it); the first
    node's agent restarts alone from the latest checkpoint and finishes the job, with the
    weights of the uninterrupted two-rank job up to summation order: the loader gives a
    step the same rows at any world size, so after the loss one rank sums the whole
    global batch's gradient where two ranks summed halves and all-reduced them. That
    rounding, through Adam, stays within the relative 1e-4 that test_distributed allows
    the MLP between world sizes."""
    # The reference trains in a cluster of its own: the same job in the same checkpoint
    # location would leave its checkpoints (of two ranks) where this job's are awaited.
    expected = _reference(Cluster(tmp_path / "reference", tiny_shards))
    cluster = Cluster(tmp_path / "elastic", tiny_shards)
    endpoint = f"127.0.0.1:{free_port()}"
    flags = _node_flags("1:2", endpoint, "elastic")
    # The first node waits up to 120 s for the second before training alone (the round
    # closes as soon as it joins): on a loaded host the second can take over 30 s to
    # start, and a kill before it joined would lose no node and prove nothing.
    first, second = (cluster.node(n, rdzv_last_call_s=120) for n in ("node-a", "node-b"))
    slow = "slow:rank=-1:step=0:seconds=0.1"
    proc_a = cluster.start(first, *flags, GRADLINE_FAULT=slow)
    _wait_for_port(endpoint, proc_a)  # the first node serves the rendezvous store
    # The second node stops at step 20, after two checkpoints of both nodes, until the
    # kill: on a loaded host a checkpoint can land on disk late, and a kill after the last
    # step would find the first node past training, waiting for its peer's exit.
    stall = f"{slow};stall:rank=-1:step=20"
    proc_b = cluster.start(second, *flags, GRADLINE_FAULT=stall)
    deadline = time.monotonic() + 240
    while not _checkpoint_of_two_ranks(cluster.checkpoints):  # both nodes at work
        log = (first / "node.log").read_text()[-2000:]
        assert proc_a.poll() is None, f"the first node ended before both wrote a checkpoint: {log}"
        assert time.monotonic() < deadline, "no checkpoint of both nodes"
        time.sleep(0.2)
    proc_b.send_signal(signal.SIGKILL)
    proc_b.wait(timeout=30)
    _wait([proc_a], [first])
    assert (first / "model").is_dir()
    log = (first / "node.log").read_text()
    runs = cluster.runs()
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", log[-2000:]
    _one_value_per_step(cluster, runs[0].info.run_id)
    # Resumed by the first node alone from a checkpoint both nodes wrote: which one
    # depends on when the kill landed, but it is one of the every-8-steps checkpoints.
    (job,) = [p for p in cluster.checkpoints.iterdir() if p.is_dir()]
    resumed = resumes_of(job)
    assert resumed and all(r.step % 8 == 0 for r in resumed), resumed
    assert (resumed[-1].written_by, resumed[-1].resumed_by) == (2, 1), resumed
    assert_resumed(job, *resumed)
    assert_resume_tags(client(cluster.tracking_uri), runs[0].info.run_id, resumed)
    weights = _weights(first / "model")
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5, msg=key)


def _checkpoint_of_two_ranks(checkpoints: Path) -> bool:
    """Whether a whole checkpoint written by two ranks is on disk."""
    for state in checkpoints.glob("*/step-????????/train_state.json"):
        with contextlib.suppress(OSError, ValueError):  # being written or rotated away
            if json.loads(state.read_text())["world_size"] == 2:
                return True
    return False


def test_sigterm_to_one_node_stops_both_at_a_checkpoint_then_both_resume(
    tiny_shards, tmp_path
) -> None:
    """A preemption notice to the second node's launcher reaches every rank through the
    rendezvous store (the nodes share no folder but the checkpoints): both exit 75 after
    one checkpoint, and the same command on both finishes the job in the same run."""
    cluster = Cluster(tmp_path, tiny_shards)
    endpoint = f"127.0.0.1:{free_port()}"
    flags = _node_flags("2", endpoint, "stop-and-resume")
    folders = [cluster.node("node-a"), cluster.node("node-b")]
    slow = {"GRADLINE_FAULT": "slow:rank=-1:step=0:seconds=0.1"}
    first = cluster.start(folders[0], *flags, **slow)
    _wait_for_port(endpoint, first)
    procs = [first, cluster.start(folders[1], *flags, **slow)]
    deadline = time.monotonic() + 240
    while not list(cluster.checkpoints.glob("*/step-????????")):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    assert _finish(procs, folders) == [PREEMPTED_EXIT_CODE] * 2
    logs = [(f / "node.log").read_text() for f in folders]
    stopped = {int(log.split("stopped on request at step ")[1].split(";")[0]) for log in logs}
    assert len(stopped) == 1  # the same step on both nodes
    step = stopped.pop()
    assert list(cluster.checkpoints.glob(f"*/step-{step:08d}"))
    assert stopped_steps(logs[0]) == [step]
    _wait([cluster.start(f, *flags) for f in folders], folders)
    runs = cluster.runs()
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    _one_value_per_step(cluster, runs[0].info.run_id)
    (job,) = [p for p in cluster.checkpoints.iterdir() if p.is_dir()]
    assert_resumed(job, Resumed(step, written_by=2, resumed_by=2))


def test_a_rank_stalled_on_another_node_is_named(tiny_shards, tmp_path) -> None:
    """Hang diagnosis across nodes: the heartbeats come through the store, so the
    launcher of the node whose rank timed out names the stalled rank on the other node.
    (The stall ends after a while: the stalled rank's node learns of the failure only
    when its rank next talks to the dead peer.)"""
    cluster = Cluster(tmp_path, tiny_shards)
    endpoint = f"127.0.0.1:{free_port()}"
    flags = _node_flags("2", endpoint, "stall")
    # The timeout also bounds the process group's start: 15 s lets the second node's
    # workers start late on a loaded host; the stall outlasts it by 20 s.
    folders = [cluster.node(name, collective_timeout_s=15, max_restarts=0) for name in ("a", "b")]
    stall = {"GRADLINE_FAULT": "stall:rank=1:step=4:seconds=35"}
    first = cluster.start(folders[0], *flags, **stall)
    _wait_for_port(endpoint, first)
    procs = [first, cluster.start(folders[1], *flags, **stall)]
    assert all(code != 0 for code in _finish(procs, folders))
    logs = [(folder / "node.log").read_text() for folder in folders]
    # The first node explains (its rank timed out first); the other loses the rendezvous
    # store with it and fails too, instead of waiting for its stalled rank.
    assert any("training failed after 1 attempt(s)" in log for log in logs)
    assert any("rank 1 stopped at step 4 in data" in log for log in logs), logs[0][-2000:]


def test_the_slurm_script_trains_on_two_nodes_of_this_machine(tiny_shards, tmp_path) -> None:
    """deploy/slurm/train.sbatch run by bash, with stand-ins for srun and scontrol that
    make two "nodes" of this machine: its launch line trains the job for real."""
    cluster = Cluster(tmp_path, tiny_shards)
    project, shims, log = cluster.node("project"), tmp_path / "bin", tmp_path / "log"
    shims.mkdir()
    log.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
        **{"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "x"},
        **{"FAKE_HOSTS": "localhost localhost", "FAKE_LOG": str(log)},
        **{"SLURM_SUBMIT_DIR": str(project), "GRADLINE": GRADLINE, "SHARDS": "shards"},
        **{"CKPT_DIR": str(cluster.checkpoints), "RDZV_PORT": str(free_port())},
        "MLFLOW_TRACKING_URI": cluster.tracking_uri,
        STAGE_HOST_ENV: SharedStageHost.socket(),  # each node's stage forks from it
    }
    done = subprocess.run(
        ["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (project / "model").is_dir() and (project / "result.json").is_file()
    runs = cluster.runs()
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["gradline.runtime.nnodes"] == "2"
    assert runs[0].data.tags["gradline.runtime.rdzv_id"] == "gradline-77"


def _wait_for_port(endpoint: str, proc, timeout: float = 180) -> None:
    import socket

    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the first node exited"
        with socket.socket() as sock:
            if sock.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on {endpoint}")


def test_config_refuses_nodes_without_a_rendezvous() -> None:
    with pytest.raises(ValueError, match=r"needs runtime\.rdzv_endpoint"):
        Config.model_validate({"runtime": {"nnodes": "1:2"}})


def test_an_object_store_url_is_refused_as_the_checkpoint_location() -> None:
    with pytest.raises(ConfigError, match=r"s3:// URL, not a checkpoint location"):
        check_checkpoint_location(Path("s3://bucket/checkpoints"))
    check_checkpoint_location(Path("/mnt/shared/checkpoints"))
