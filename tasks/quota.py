"""The device quota: a Prefect global concurrency limit with one slot per training device.

A training job holds as many slots as it starts workers (one GPU each under CUDA, one
CPU process otherwise) for as long as it trains, so flows started together queue for
the devices instead of oversubscribing them. The limit is shared by every flow that
talks to the same Prefect server; an administrator sizes it with
`prefect global-concurrency-limit update NAME --limit N`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.runtime import flow_run

from tasks.leases import holders, reclaim_lapsed_slots
from tasks.slot_lease import SlotLease
from training.config import Config
from training.errors import ConfigError, GradlineError


class QuotaTooSmall(ConfigError):
    """The job needs more devices than the quota will ever grant."""


class QuotaWaitExpired(GradlineError):
    """The device slots did not come free within orchestrate.quota_wait_s."""


# What a machine with a GPU driver has (NVIDIA, ROCm, WSL's GPU bridge): without any of
# them torch sees no GPU, and the flow need not import it (~1 s) to be told so.
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia/gpus", "/dev/kfd", "/dev/dxg")


def devices_here() -> int:
    """What this machine can train on: its GPUs, or its CPU cores when it has none."""
    gpus = 0
    if any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        import torch  # deferred: ~1 s, and only the first flow on a server creates the limit

        gpus = torch.cuda.device_count()  # what this process may use (CUDA_VISIBLE_DEVICES)
    # The cores this process may use (affinity, cpusets), not all the host has.
    return gpus or len(os.sched_getaffinity(0)) or 1


def ensure_limit(name: str, slots: int) -> int:
    """The limit's size, creating the limit with `slots` (0: devices here) if missing."""
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            pass
        with contextlib.suppress(ObjectAlreadyExists):  # another flow created it first
            client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=name, limit=slots or devices_here())
            )
        return client.read_global_concurrency_limit_by_name(name).limit


def check_quota(cfg: Config) -> int:
    """Fail at once when the job needs more slots than the limit will ever grant."""
    name, needed = cfg.orchestrate.device_limit, cfg.runtime.procs_per_node
    size = ensure_limit(name, cfg.orchestrate.device_slots)
    if needed > size:
        raise QuotaTooSmall(
            f"runtime.procs_per_node={needed} needs {needed} device slots here but the "
            f"Prefect concurrency limit {name!r} has {size}: lower runtime.procs_per_node, or "
            f"raise the limit with `prefect global-concurrency-limit update {name} --limit "
            f"{needed}`"
        )
    return size


# How often a waiting run looks again for slots of runs that died (their leases lapse).
RECLAIM_EVERY_S = 15.0


@contextlib.contextmanager
def device_slots(cfg: Config) -> Iterator[int]:
    """Hold one slot per training worker for the duration of the block."""
    needed = cfg.runtime.procs_per_node
    lease = _acquire(cfg)
    get_run_logger().info(
        "holding %d slots of device quota %r", needed, cfg.orchestrate.device_limit
    )
    with lease.kept():
        yield needed


def _acquire(cfg: Config) -> SlotLease:
    """Wait for the slots (up to orchestrate.quota_wait_s), giving back the slots of runs
    that died on the way."""
    name, needed = cfg.orchestrate.device_limit, cfg.runtime.procs_per_node
    size = check_quota(cfg)
    # The lease names this flow run as its holder. It lapses when the holder stops
    # renewing it (the process died): a killed run's slots come back on their own.
    holder = ConcurrencyLeaseHolder(type="flow_run", id=flow_run.id) if flow_run.id else None
    lease = SlotLease(name, needed, cfg.orchestrate.slot_lease_s, holder, get_run_logger())
    # Free slots, the usual case, are taken with one request. Only slots that are taken
    # are worth the clean-up of dead runs' leases (on a temporary server it reads every
    # lease through Prefect's server package: 0.15 s, up to 1 s while that still imports).
    if lease.take_if_free():
        return lease
    deadline = time.monotonic() + cfg.orchestrate.quota_wait_s
    while True:
        reclaim_lapsed_slots()
        _say_who_holds(name, needed, size)
        left = deadline - time.monotonic()
        try:
            lease.take(timeout_s=max(0.1, min(left, RECLAIM_EVERY_S)))
            return lease
        except TimeoutError as exc:
            if time.monotonic() >= deadline:
                raise _wait_expired(cfg, size) from exc


def _say_who_holds(name: str, needed: int, size: int) -> None:
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(name)
    if limit.limit - limit.active_slots >= needed:
        return  # free: nothing to wait for
    who = holders(limit.id)
    get_run_logger().info(
        "waiting for %d of %d slots of device quota %r: %d taken%s",
        needed,
        size,
        name,
        limit.active_slots,
        f", by {', '.join(who)}" if who else "",
    )


def _wait_expired(cfg: Config, size: int) -> QuotaWaitExpired:
    name, needed = cfg.orchestrate.device_limit, cfg.runtime.procs_per_node
    return QuotaWaitExpired(
        f"waited {cfg.orchestrate.quota_wait_s:g} s for {needed} of the {size} slots of "
        f"device quota {name!r}: other training runs hold them (a killed run's come back "
        f"{cfg.orchestrate.slot_lease_s:g} s after it died). See `prefect "
        f"global-concurrency-limit inspect {name}`; if no training runs and they stay "
        f"taken, free them with `prefect global-concurrency-limit update {name} "
        "--active-slots 0`; or wait longer (orchestrate.quota_wait_s)"
    )
