"""Health records go through the job's control store and name where a rank stopped, even
when it failed within its first second; stop requests reach every rank's reader."""

from __future__ import annotations

from training.engine.control import Control
from training.engine.health import Heartbeat, describe, latest_failures, record_failure
from training.engine.launch import free_port

SECRET = b"test-secret"


def test_a_failure_record_carries_the_rank_s_last_step() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    launcher = Control.open(endpoint, "job-a", timeout_s=10, secret=SECRET)
    worker = Control.connect(endpoint, "job-a", timeout_s=10, secret=SECRET)
    assert launcher.hosting and not worker.hosting
    fast, slow = Heartbeat(worker, rank=0), Heartbeat(worker, rank=1, interval_s=3600)
    fast.beat(25, "sync")
    slow.beat(25, "compute")  # the periodic publisher has not run yet
    record_failure(worker, 0, 0, RuntimeError("connection closed by peer"))
    record_failure(worker, 1, 0, RuntimeError("injected failure at step 25"))
    beats = {b["rank"]: (b["step"], b["phase"]) for b in launcher.beats(ranks=4)}
    assert beats == {0: (25, "sync"), 1: (25, "compute")}
    assert describe(launcher.beats(ranks=2)).startswith("rank 1 stopped at step 25 in compute")
    assert [r["rank"] for r in latest_failures(launcher.failures())] == [0, 1]


def test_stop_requests_and_the_run_claim_are_per_job_and_shared() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    first = Control.open(endpoint, "job-b", timeout_s=10, secret=SECRET)
    second = Control.connect(
        endpoint, "job-b", timeout_s=10, secret=SECRET
    )  # another node's launcher
    other_job = Control.connect(endpoint, "job-c", timeout_s=10, secret=SECRET)
    assert [first.claim("run/owner"), second.claim("run/owner")] == [True, False]
    second.request_stop()
    assert first.stop_requested() and not other_job.stop_requested()


def test_a_checkpoint_failure_is_recorded_by_its_rank_s_own_error() -> None:
    """DCP's CheckpointException names only the failed ranks: the record names the lowest
    failed rank's error, and a full disk under it stops the retries like any full disk."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def wrapped(exc: BaseException):
        try:
            raise exc
        except BaseException as raised:  # wrapped with its traceback, as DCP does
            return _wrap_exception(raised)

    endpoint = f"127.0.0.1:{free_port()}"
    launcher = Control.open(endpoint, "job-d", timeout_s=10, secret=SECRET)
    timeout = RuntimeError("gloo: timed out waiting 300000ms for recv")
    full = OSError(errno.ENOSPC, "No space left on device", "/ckpt/step-00000016")
    record_failure(launcher, 0, 0, CheckpointException("save", {3: wrapped(timeout)}))
    record_failure(launcher, 1, 0, CheckpointException("save", {2: wrapped(full)}))
    first, second = latest_failures(launcher.failures())
    assert first["error"] == (
        "RuntimeError (in a checkpoint, on rank 3): gloo: timed out waiting 300000ms for recv"
    )
    assert first["retryable"]
    assert second["error"].startswith("DiskFull (in a checkpoint, on rank 2): no space left")
    assert not second["retryable"]
