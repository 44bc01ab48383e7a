"""The control plane is authenticated and private: records gradline writes to the job's
store are signed with the job's secret, a client without it can neither stop, stall nor
redirect a running job, and a one-node job listens on loopback only."""

from __future__ import annotations

import json
import os
import secrets
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from training.config import Config
from training.engine.control import Control
from training.engine.launch import free_port, open_control
from training.engine.signing import SECRET_ENV, JobSecretMissing, Signer, job_secret

from .test_multinode import Cluster, _finish, _node_flags

SECRET = b"s3cret-for-tests"

# Steps after the first checkpoint (step 8 of 39) take 0.25 s: the forgeries land while
# the job still has ~7 s of steps to poll them in, however fast its start on this host.
SLOW_AFTER_FIRST_CHECKPOINT = "slow:rank=-1:step=8:seconds=0.25"


def test_a_signed_record_verifies_and_any_change_is_refused() -> None:
    signer = Signer.open(SECRET, "job-a")
    record = signer.sign("stop", {"by": "node-a"})
    assert signer.verify("stop", record).value == {"by": "node-a"}
    tampered = record.replace(b"node-a", b"node-b")
    assert signer.verify("stop", tampered).refused == "forged"
    assert signer.verify("beat/0", record).refused == "forged"  # moved to another key
    assert Signer.open(SECRET, "job-b").verify("stop", record).refused == "forged"
    assert Signer.open(b"another secret", "job-a").verify("stop", record).refused == "forged"
    assert signer.verify("stop", b"1").refused == "forged"  # what an unsigned writer sets


def test_a_record_signed_before_the_replay_window_is_refused_as_stale() -> None:
    old = Signer(SECRET, "job-a", not_before=0.0).sign("stop", {"by": "earlier run"})
    assert Signer(SECRET, "job-a", not_before=time.time() + 1).verify("stop", old).refused == (
        "stale"
    )


def test_several_nodes_need_the_secret_one_node_makes_its_own(monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(JobSecretMissing, match=SECRET_ENV):
        job_secret(multi_node=True)
    made = job_secret(multi_node=False)
    assert len(made) == 64 and os.environ[SECRET_ENV] == made.decode()  # workers inherit it
    monkeypatch.setenv(SECRET_ENV, "given")
    assert job_secret(multi_node=True) == b"given"


def test_a_multi_node_job_without_the_secret_fails_before_it_serves_anything(
    monkeypatch,
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    endpoint = f"127.0.0.1:{free_port()}"
    runtime = Config.model_validate(
        {"runtime": {"nnodes": "2", "rdzv_endpoint": endpoint, "rdzv_id": "job"}}
    ).runtime
    with pytest.raises(JobSecretMissing, match="openssl rand"):
        open_control(runtime)
    with pytest.raises((RuntimeError, OSError)):  # nothing listens there
        dist.TCPStore("127.0.0.1", int(endpoint.split(":")[1]), timeout=timedelta(seconds=1))


def _forger(endpoint: str, job_id: str, connect_s: float = 10) -> dist.Store:
    """A plain store client, as anyone who reaches the port can make, in the job's keys.
    It gives up connecting after `connect_s`; its reads and writes wait up to 10 s."""
    host, port = endpoint.rsplit(":", 1)
    raw = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=connect_s))
    raw.set_timeout(timedelta(seconds=10))
    return dist.PrefixStore(f"gradline/{job_id}", raw)


def test_unsigned_records_are_ignored_and_counted() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    launcher = Control.open(endpoint, "job-a", timeout_s=10, secret=SECRET)
    worker = Control.connect(endpoint, "job-a", timeout_s=10, secret=SECRET)
    forger = _forger(endpoint, "job-a")
    forger.set("stop", "1")
    forger.set("beat/0", json.dumps({"rank": 0, "step": 9, "phase": "sync", "since": 0}))
    forger.add("failures/count", 1)
    forger.set("failures/1", json.dumps({"rank": 0, "attempt": 0, "retryable": False}))
    for _ in range(3):  # polled again and again, counted once
        assert not worker.stop_requested()
    assert worker.beats(ranks=1) == [] and worker.failures() == []
    assert worker.refused == {"stop": 1, "beat/0": 1, "failures/1": 1}
    launcher.request_stop()  # a genuine request still gets through the forged one
    assert worker.stop_requested()


def test_a_forged_claim_is_swapped_out_and_a_genuine_one_kept() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    first = Control.open(endpoint, "job-a", timeout_s=10, secret=SECRET)
    second = Control.connect(endpoint, "job-a", timeout_s=10, secret=SECRET)
    _forger(endpoint, "job-a").set("run/owner", "mine")
    assert [first.claim("run/owner"), second.claim("run/owner")] == [True, False]
    assert first.refused == {"run/owner": 1}


def test_a_replayed_older_heartbeat_does_not_replace_a_newer_one() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    worker = Control.open(endpoint, "job-a", timeout_s=10, secret=SECRET)
    launcher = Control.connect(endpoint, "job-a", timeout_s=10, secret=SECRET)
    worker.put_beat(0, {"rank": 0, "step": 3})
    captured = worker.store.get("beat/0")  # what a listener on the wire could copy
    time.sleep(0.01)
    worker.put_beat(0, {"rank": 0, "step": 7})
    assert launcher.beats(ranks=1) == [{"rank": 0, "step": 7}]
    _forger(endpoint, "job-a").set("beat/0", captured)
    assert launcher.beats(ranks=1) == [{"rank": 0, "step": 7}]


def _inodes_of(pid: int) -> set[str]:
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                found.add(target[len("socket:[") : -1])
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        pass  # the process ended while we looked
    return found


def _process_tree(root: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _listening(root: int) -> set[tuple[str, int]]:
    """(address in /proc/net hex, port) of every TCP socket the process tree listens on."""
    inodes = set().union(*(_inodes_of(pid) for pid in _process_tree(root)))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.add((address, int(port, 16)))
    return found


def _is_loopback(address: str) -> bool:
    if len(address) == 8:  # IPv4, little-endian hex: 127.x.x.x ends in 7F
        return address.endswith("7F")
    return address in {"00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net")
def test_a_one_node_job_listens_on_loopback_only(tiny_shards, tmp_path) -> None:
    cluster = Cluster(tmp_path, tiny_shards)
    folder = cluster.node("node", procs_per_node=2)
    slow = {"GRADLINE_FAULT": "slow:rank=-1:step=0:seconds=0.1"}
    proc = cluster.start(folder, hosted=False, **slow)  # its own process tree
    seen: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 300  # the first checkpoint, on a loaded 2-core host
    # Watch until checkpoints are written: the launcher's store, the workers' store and
    # gloo's sockets are all open by then.
    while not list(cluster.checkpoints.glob("*/step-????????")):
        assert proc.poll() is None and time.monotonic() < deadline, (
            folder / "node.log"
        ).read_text()
        seen |= _listening(proc.pid)
        time.sleep(0.2)
    seen |= _listening(proc.pid)
    assert _finish([proc], [folder]) == [0], (folder / "node.log").read_text()[-3000:]
    assert len({port for _, port in seen}) >= 3, seen  # control store, workers' store, gloo
    assert all(_is_loopback(address) for address, _ in seen), seen


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_client_without_the_secret_cannot_stop_stall_or_redirect_a_job(
    tiny_shards, tmp_path
) -> None:
    """Two nodes (two agents here, one rank each); a third process writes a stop request,
    heartbeats and failure records to the rendezvous store with a plain TCPStore client.
    The job ends normally in one finished MLflow run, and both nodes count the forgeries."""
    cluster = Cluster(tmp_path, tiny_shards)
    endpoint, job_id = f"127.0.0.1:{free_port()}", "forged"
    flags = _node_flags("2", endpoint, job_id)
    env = {SECRET_ENV: secrets.token_hex(32), "GRADLINE_FAULT": SLOW_AFTER_FIRST_CHECKPOINT}
    folders = [cluster.node("node-a"), cluster.node("node-b")]
    procs = [cluster.start(folder, *flags, **env) for folder in folders]
    forger = _wait_for_store(endpoint, job_id, procs)
    deadline = time.monotonic() + 300  # the first checkpoint, on a loaded 2-core host
    while not list(cluster.checkpoints.glob("*/step-????????")):  # mid-training
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.2)
    forger.set("stop", "1")
    for rank in range(2):
        beat = {"rank": rank, "step": 0, "phase": "compute", "since": 0}
        forger.set(f"beat/{rank}", json.dumps(beat))
    number = forger.add("failures/count", 1)
    failure = {"rank": 1, "time": time.time(), "attempt": 0, "error": "x", "retryable": False}
    forger.set(f"failures/{number}", json.dumps(failure))
    assert _finish(procs, folders) == [0, 0], [
        (f / "node.log").read_text()[-2000:] for f in folders
    ]
    runs = cluster.runs()
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    logs = "".join((f / "node.log").read_text() for f in folders)
    assert "ignored a forged control record under 'stop'" in logs  # rank 0 polled it
    # Each launcher's audit at the end counts the forged stop and failure record (the
    # forged heartbeats were overwritten by the ranks' next genuine ones).
    audits = [line for line in logs.splitlines() if "without this job's signature" in line]
    assert len(audits) == 2, logs[-3000:]
    assert all(f"failures/{number}: 1, stop: 1" in line for line in audits), audits


def _wait_for_store(endpoint: str, job_id: str, procs) -> dist.Store:
    """The forger's client, as soon as the job's store listens. Short connection attempts:
    one long attempt (the client backs off for longer than its timeout between tries) can
    outlast a whole short job on a loaded host."""
    deadline = time.monotonic() + 180
    while True:
        try:
            return _forger(endpoint, job_id, connect_s=1)
        except (RuntimeError, OSError):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.2)


def test_a_multi_node_run_without_the_secret_is_refused_before_any_stage(
    tmp_path, monkeypatch
) -> None:
    from flows.pipeline import apply_params
    from tests.conftest import copy_project

    monkeypatch.delenv(SECRET_ENV, raising=False)
    root = tmp_path / "project"
    copy_project(root)
    params = (root / "params.yaml").read_text()
    with pytest.raises(JobSecretMissing, match=SECRET_ENV):
        nodes = ["runtime.nnodes=2", "runtime.rdzv_endpoint=127.0.0.1:29400", "runtime.rdzv_id=j"]
        apply_params.fn(str(root), nodes)
    assert (root / "params.yaml").read_text() == params  # refused before it was written
