"""Asynchronous updates through a parameter server (`update.rule: async`).

Rank 0 hosts a parameter server (a thread) besides being a worker; every rank, rank 0
included, is a worker that loops: pull the newest parameters, compute a gradient on its
next batch, push it. No worker waits for the others except as the staleness bound
`s = update.max_staleness` requires. Plain data parallelism only: every rank holds a
whole replica of the model.

Semantics:

- W workers (the data-parallel world size). Worker w numbers its gradients n = 0, 1,
  2...; gradient n is computed on "slice w of global batch n". The server hands out n
  with the parameters (the caller's `compute(n)` reads the rows), so the server's state
  is the one truth about where every worker is.
- The server holds the master parameters (`server_model`, its own copy of the model) and
  an optimizer over them (`server_optimizer`). A server step (version v -> v+1) takes
  every gradient in its bucket (normally exactly W, each the mean-loss gradient of one
  rank's share), sets the parameters' `.grad` to their sample-weighted mean, calls
  `before_step(v, params)` (the caller sets the learning rate of step v and clips the
  gradient norm there), then `optimizer.step()`.
- A gradient computed on version c and applied by the step v -> v+1 has staleness v - c.
- Rule 1 (per-version cap): a worker computes at most s+1 gradients on one version; a
  pull that would exceed it waits until the version advances. With s = 0 this makes the
  protocol lockstep: every bucket is gradient n = k of every worker, all computed on
  version k, which is exactly synchronous data-parallel training.
- Rule 2 (staleness bound): a bucket of >= W gradients is applied only if no worker has
  a gradient in flight (pulled, not yet pushed) on a version c with v+1 - c > s: it would
  exceed s if it missed this step. The step then waits for that push, which joins the
  bucket (its staleness v - c <= s), and the bucket is applied with more than W
  gradients. So no applied gradient is ever staler than s.
- Segments and barriers: every rank calls `run_segment(until_version, compute)`. The
  server steps until its version is `until_version`; pulls after that get "barrier"
  instead of parameters. A barrier releases once every worker has reached it, so
  gradients in flight are pushed first; they wait in the bucket for the next segment
  (server state, saved by `state_dict`). Each worker's model then holds the parameters of
  version `until_version`, every rank gets the same `Segment` (per-step losses, gradients
  per worker, staleness of the applied gradients), and the ranks are free to make
  ordinary collectives (log, checkpoint, validate) until the next segment.
- Losses: each push carries the worker's mean loss and sample count; a step records the
  sample-weighted mean loss of its bucket.
- Floating point: the bucket is a running sum in arrival order. With two workers that
  order cannot change the sum (s=0 runs and their resumes are bitwise repeatable); with
  more, it moves the last bits from run to run, as any arrival-order sum does.
- Accounting: `bytes_sent` counts what this rank put on the wire (workers: pushes and
  pull requests; rank 0: its replies to the other workers; rank 0's own worker calls the
  server in memory and sends nothing). `wait_seconds` is this rank's worker time in pull
  and push (not computing): its sync wait.
- Resume: rank 0's `state_dict()` holds the version, each worker's next gradient number
  and the bucket (plain python and one tensor); the caller checkpoints `server_model` and
  `server_optimizer` itself. After `load_state_dict` (and loading those), the first
  pulls of the next segment give the workers the loaded parameters and their saved n.

Transport: a gloo group of its own (made collectively in __init__) carries point-to-point
messages between rank 0 and each other rank: a float64 header (kind, worker, n,
computed_on, loss, samples, version, extra length), then a flat float32 gradient or
parameter vector (a barrier reply adds the float64 segment statistics). On rank 0 one
proxy thread per remote worker receives its messages, hands them to the server and sends
the replies; rank 0's own worker calls the server directly. A threading.Condition guards
the server's state. Threads are daemons; a failure in one is stored and raised on rank
0's main thread at its next call, and on the other workers at their next pull. Every wait
is bounded by `timeout_s`: a dead or silent peer gives an error naming the worker.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger("gradline.train")

# Message kinds: the first field of every header.
PUSH, PULL, PARAMS, BARRIER, FAILED = 1, 2, 3, 4, 5
HEADER_FIELDS = 8  # kind, worker, n, computed_on, loss, samples, version, extra length

BeforeStep = Callable[[int, list[nn.Parameter]], None]
Compute = Callable[[int], tuple[float, int]]


class ParameterServerError(RuntimeError):
    """The parameter server, one of its threads, or a peer failed or went silent."""


@dataclass
class Segment:
    """What happened between two barriers; the same on every rank."""

    start_version: int
    version: int  # the server version at the barrier (the segment's until_version)
    losses: list[float]  # sample-weighted mean loss of each step's bucket, in order
    gradients: list[int]  # per worker: gradients pushed during the segment
    next_gradient: list[int]  # per worker: the number n of its next gradient
    applied: int  # gradients applied by the segment's steps
    staleness_max: int  # of the applied gradients (0 when no step ran)
    staleness_mean: float

    def to_tensor(self) -> torch.Tensor:
        head = [self.start_version, self.version, len(self.losses), len(self.gradients)]
        head += [self.applied, self.staleness_max, self.staleness_mean]
        values = head + self.losses + self.gradients + self.next_gradient
        return torch.tensor(values, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Segment:
        v = tensor.tolist()
        steps, workers = int(v[2]), int(v[3])
        losses, rest = v[7 : 7 + steps], v[7 + steps :]
        return cls(
            start_version=int(v[0]),
            version=int(v[1]),
            losses=losses,
            gradients=[int(x) for x in rest[:workers]],
            next_gradient=[int(x) for x in rest[workers : 2 * workers]],
            applied=int(v[4]),
            staleness_max=int(v[5]),
            staleness_mean=v[6],
        )


@dataclass
class _Reply:
    """The server's answer to a pull: parameters to compute gradient n on, or the barrier."""

    kind: int  # PARAMS or BARRIER
    version: int
    params: torch.Tensor  # flat float32, never modified after it is published
    n: int = -1
    stats: torch.Tensor | None = None  # barrier: Segment.to_tensor()
    segment: int = 0  # barrier: the id of the segment it ends


@dataclass
class _Entry:
    """One gradient waiting in the bucket (its sum is in the bucket's tensor)."""

    worker: int
    n: int
    computed_on: int
    samples: float
    loss: float


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in model.parameters()])


def flat_grads(model: nn.Module) -> torch.Tensor:
    parts = [
        p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros(p.numel())
        for p in model.parameters()
    ]
    return torch.cat([g.to("cpu", torch.float32) for g in parts])


def assign_params(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class _Server:
    """The master parameters, the bucket and the two rules; lives on rank 0.

    Every method takes the condition's lock; steps run on the server thread (`serve`).
    """

    def __init__(self, model, optimizer, world_size, max_staleness, before_step, timeout_s):
        self.model, self.optimizer, self.before_step = model, optimizer, before_step
        self.world, self.s, self.timeout_s = world_size, max_staleness, timeout_s
        self.cond = threading.Condition()
        self.version = 0
        self.until = 0  # no step beyond this version in the current segment
        self.segment_id = 0
        self.next_n = [0] * world_size
        self.in_flight: list[tuple[int, int] | None] = [None] * world_size  # (n, computed_on)
        self.last_heard = [time.monotonic()] * world_size
        self.numel = sum(p.numel() for p in model.parameters())
        self._empty_bucket()
        self.published = flat_params(model)
        self.arrived: set[int] = set()
        self.released: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
        self.failure: tuple[str, BaseException] | None = None
        self.closing = False
        self._reset_segment_stats()

    def _empty_bucket(self) -> None:
        self.bucket_sum = torch.zeros(self.numel, dtype=torch.float32)
        self.entries: list[_Entry] = []

    def _reset_segment_stats(self) -> None:
        self.start_version = self.version
        self.losses: list[float] = []
        self.nonfinite_steps = 0  # steps dropped for a non-finite mean gradient
        self.staleness: list[int] = []
        self.pushed = [0] * self.world

    # -- failures and waits --------------------------------------------------------

    def fail(self, message: str, cause: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = (message, cause)
            self.cond.notify_all()

    def _refuse(self, message: str) -> ParameterServerError:
        """A broken protocol (a caller's mistake) fails the server like any error."""
        error = ParameterServerError(message)
        self.failure = self.failure or (message, error)
        self.cond.notify_all()
        return error

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            message, cause = self.failure
            raise ParameterServerError(message) from cause

    def _wait(self, ready: Callable[[], bool], worker: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            self.raise_if_failed()
            left = deadline - time.monotonic()
            if left <= 0:
                message = (
                    f"worker {worker} waited {self.timeout_s:g} s for {what}; {self.describe()}"
                )
                raise self._refuse(message)
            self.cond.wait(left)

    def describe(self) -> str:
        """Where everyone is, for error messages: names who has gone silent."""
        now = time.monotonic()
        parts = [f"server at version {self.version} (segment to {self.until})"]
        parts.append(f"bucket {len(self.entries)}/{self.world} gradients")
        for w in range(self.world):
            flight = self.in_flight[w]
            doing = f"computing n={flight[0]} on version {flight[1]}" if flight else "idle"
            parts.append(
                f"worker {w} (rank {w}) {doing}, last heard {now - self.last_heard[w]:.1f} s ago"
            )
        return "; ".join(parts)

    # -- the protocol ----------------------------------------------------------------

    def open_segment(self, until: int) -> None:
        with self.cond:
            self.raise_if_failed()
            if until < self.version:
                raise ValueError(f"run_segment({until}): the server is at version {self.version}")
            self.until = until
            self.segment_id += 1
            self._reset_segment_stats()
            # The parameters may have been loaded (resume) since the last publication.
            self.published = flat_params(self.model)
            self.cond.notify_all()

    def _computed_on_current(self, worker: int) -> int:
        """Rule 1's count: every gradient on the current version is still in the bucket
        (a step would have moved the version on)."""
        return sum(e.worker == worker and e.computed_on == self.version for e in self.entries)

    def pull(self, worker: int, until: int) -> _Reply:
        with self.cond:
            self.raise_if_failed()
            self.last_heard[worker] = time.monotonic()
            if until != self.until:
                raise self._refuse(
                    f"worker {worker} runs a segment to version {until}, rank 0 to {self.until}"
                )
            if self.in_flight[worker] is not None:
                raise self._refuse(f"worker {worker} pulled twice without a push")

            def may_pull() -> bool:
                at_barrier = self.version >= self.until
                return at_barrier or self._computed_on_current(worker) <= self.s

            self._wait(may_pull, worker, "the server version to advance (rule 1)")
            if self.version < self.until:
                n = self.next_n[worker]
                self.next_n[worker] += 1
                self.in_flight[worker] = (n, self.version)
                return _Reply(PARAMS, self.version, self.published, n)
            return self._barrier(worker)

    def _barrier(self, worker: int) -> _Reply:
        segment = self.segment_id
        self.arrived.add(worker)
        if len(self.arrived) == self.world:  # the last one in: nothing is in flight now
            stats = self._segment_stats().to_tensor()
            self.released = (segment, self.version, self.published, stats)
            self.arrived = set()
            self.cond.notify_all()

        def released() -> bool:
            return self.released is not None and self.released[0] == segment

        self._wait(released, worker, "the other workers to reach the barrier")
        _, version, params, stats = self.released
        return _Reply(BARRIER, version, params, stats=stats, segment=segment)

    def _segment_stats(self) -> Segment:
        stale = self.staleness
        return Segment(
            start_version=self.start_version,
            version=self.version,
            losses=list(self.losses),
            gradients=list(self.pushed),
            next_gradient=list(self.next_n),
            applied=len(stale),
            staleness_max=max(stale, default=0),
            staleness_mean=sum(stale) / len(stale) if stale else 0.0,
        )

    def push(self, worker: int, n: int, computed_on: int, loss: float, samples: float, grad):
        with self.cond:
            self.raise_if_failed()
            self.last_heard[worker] = time.monotonic()
            if self.in_flight[worker] != (n, computed_on):
                raise self._refuse(
                    f"worker {worker} pushed gradient n={n} on version {computed_on}; "
                    f"the server expected {self.in_flight[worker]}"
                )
            if samples <= 0:
                raise self._refuse(f"worker {worker}: gradient n={n} has no samples")
            self.in_flight[worker] = None
            # Product, then sum (not a fused add_ with alpha): with two workers the sum then
            # does not depend on which push came first, so s=0 runs are bitwise repeatable.
            self.bucket_sum += grad * samples
            self.entries.append(_Entry(worker, n, computed_on, samples, loss))
            self.pushed[worker] += 1
            self.cond.notify_all()

    def _can_step(self) -> bool:
        if self.version >= self.until or len(self.entries) < self.world:
            return False
        # Rule 2: nobody may be left holding a gradient that would then be too stale.
        return all(f is None or self.version + 1 - f[1] <= self.s for f in self.in_flight)

    def serve(self) -> None:
        """The server thread: apply a step whenever the rules allow one."""
        try:
            with self.cond:
                while True:
                    while not (self.closing or self.failure or self._can_step()):
                        self.cond.wait()
                    if self.closing or self.failure:
                        return
                    self._step()
                    self.cond.notify_all()
        except BaseException as exc:
            self.fail(f"the parameter server's step {self.version} failed: {exc!r}", exc)

    def _step(self) -> None:
        samples = sum(e.samples for e in self.entries)
        mean = self.bucket_sum / samples
        params = list(self.model.parameters())
        offset = 0
        for p in params:
            chunk = mean[offset : offset + p.numel()].view_as(p)
            p.grad = chunk.to(device=p.device, dtype=p.dtype)
            offset += p.numel()
        if self.before_step is not None:
            self.before_step(self.version, params)
        # A non-finite mean gradient (one worker's NaN is in the mean) is dropped, as a
        # synchronous job skips such a step (training.engine.nonfinite): the weights
        # every replica pulls next stay finite; the version still moves on.
        if bool(torch.isfinite(mean).all()):
            self.optimizer.step()
        else:
            self.nonfinite_steps += 1
            log.warning(
                "parameter server: step %d dropped: its mean gradient is not finite "
                "(%d dropped so far)",
                self.version,
                self.nonfinite_steps,
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(sum(e.loss * e.samples for e in self.entries) / samples)
        self.staleness.extend(self.version - e.computed_on for e in self.entries)
        self.version += 1
        self.published = flat_params(self.model)
        self._empty_bucket()

    # -- resume ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        with self.cond:
            self.raise_if_failed()
            if any(f is not None for f in self.in_flight) or self.version < self.until:
                raise ParameterServerError("state_dict() is taken between segments")
            return {
                "version": self.version,
                "next_gradient": list(self.next_n),
                "world_size": self.world,
                "max_staleness": self.s,
                "bucket": {
                    "sum": self.bucket_sum.clone(),
                    "entries": [
                        [e.worker, e.n, e.computed_on, e.samples, e.loss] for e in self.entries
                    ],
                },
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.cond:
            self.raise_if_failed()
            self.version = self.until = int(state["version"])
            self.next_n = [int(n) for n in state["next_gradient"]]
            bucket = state["bucket"]
            self.bucket_sum = bucket["sum"].to("cpu", torch.float32).clone()
            self.entries = [
                _Entry(int(w), int(n), int(c), float(s), float(loss))
                for w, n, c, s, loss in bucket["entries"]
            ]
            self._reset_segment_stats()


class AsyncUpdates:
    """This rank's worker, and on rank 0 the parameter server (see the module docstring).

    `model` is the replica this rank computes on. `make_optimizer(server_model)` builds the
    server's optimizer (called on rank 0 only). `before_step(version, params)` runs on
    the server thread before each optimizer step, with the mean gradient in the params'
    `.grad`: it must make no collective (only rank 0 runs it).
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[nn.Module], Any],
        rank: int,
        world_size: int,
        max_staleness: int,
        before_step: BeforeStep | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.model, self.rank, self.world_size = model, rank, world_size
        self.max_staleness, self.timeout_s = max_staleness, timeout_s
        self.bytes_sent = 0.0
        self.wait_seconds = 0.0
        self.last_segment: Segment | None = None
        self._version = 0
        self._next_gradient = [0] * world_size
        self._numel = sum(p.numel() for p in model.parameters())
        self._lock = threading.Lock()  # bytes_sent, from rank 0's proxy threads
        self._group = None
        if world_size > 1:  # a collective: every rank builds its AsyncUpdates together
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise ValueError(
                    f"AsyncUpdates(rank={rank}, world_size={world_size}) needs every rank of "
                    f"the job as a worker; the job has rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}"
                )
            timeout = timedelta(seconds=timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        self.server_model: nn.Module | None = None
        self.server_optimizer = None
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        if rank == 0:
            self.server_model = copy.deepcopy(model)
            self.server_optimizer = make_optimizer(self.server_model)
            self._server = _Server(
                self.server_model,
                self.server_optimizer,
                world_size,
                max_staleness,
                before_step,
                timeout_s,
            )
            self._start(self._server.serve, "ps-server")
            for worker in range(1, world_size):
                self._start(lambda w=worker: self._proxy(w), f"ps-proxy-{worker}")

    def _start(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- what the caller reads -------------------------------------------------------

    @property
    def version(self) -> int:
        """The server version (rank 0), else the version of this rank's parameters."""
        return self._server.version if self._server else self._version

    def next_gradient(self, worker: int) -> int:
        """The number n of `worker`'s next gradient: always exact on rank 0; on other
        ranks as of the last barrier or `load_state_dict`."""
        return self._server.next_n[worker] if self._server else self._next_gradient[worker]

    def check(self) -> None:
        """Raise the stored failure of a server or proxy thread, if any (rank 0)."""
        if self._server is not None:
            with self._server.cond:
                self._server.raise_if_failed()

    # -- the worker ------------------------------------------------------------------

    def run_segment(self, until_version: int, compute: Compute) -> Segment:
        """Work (pull, compute(n), push) until the server reaches `until_version` and
        every worker has reached the barrier; return the segment's statistics."""
        if self._server is not None:
            self._server.open_segment(until_version)
        while True:
            reply = self._timed(self._pull, until_version)
            if reply.kind == BARRIER:
                break
            self.model.zero_grad(set_to_none=True)
            loss, samples = compute(reply.n)
            self._timed(self._push, reply, float(loss), float(samples))
        segment = Segment.from_tensor(reply.stats)
        self._version, self._next_gradient = segment.version, list(segment.next_gradient)
        self.last_segment = segment
        return segment

    def _timed(self, call, *args):
        started = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.wait_seconds += time.perf_counter() - started

    def _pull(self, until: int) -> _Reply:
        if self._server is not None:
            reply = self._server.pull(0, until)
        else:
            reply = self._remote_pull(until)
        assign_params(self.model, reply.params)
        self._version = reply.version
        return reply

    def _push(self, reply: _Reply, loss: float, samples: float) -> None:
        grad = flat_grads(self.model)
        if self._server is not None:
            self._server.push(0, reply.n, reply.version, loss, samples, grad)
            return
        header = _header(PUSH, self.rank, reply.n, reply.version, loss, samples)
        self._exchange(lambda: (self._send(header), self._send(grad)))

    def _remote_pull(self, until: int) -> _Reply:
        def ask() -> _Reply:
            self._send(_header(PULL, self.rank, version=until))
            header = torch.empty(HEADER_FIELDS, dtype=torch.float64)
            dist.recv(header, src=0, group=self._group)
            kind, _, n, _, _, _, version, extra = (int(x) for x in header.tolist())
            if kind == FAILED:
                raise ParameterServerError(
                    f"rank {self.rank}: the parameter server on rank 0 failed (see rank 0's error)"
                )
            params = torch.empty(self._numel, dtype=torch.float32)
            dist.recv(params, src=0, group=self._group)
            stats = None
            if kind == BARRIER:
                stats = torch.empty(extra, dtype=torch.float64)
                dist.recv(stats, src=0, group=self._group)
            return _Reply(kind, version, params, n, stats)

        return self._exchange(ask)

    def _exchange(self, talk):
        try:
            return talk()
        except ParameterServerError:
            raise
        except Exception as exc:
            raise ParameterServerError(
                f"rank {self.rank}: no answer from the parameter server on rank 0 within "
                f"{self.timeout_s:g} s, or the connection failed: {exc}"
            ) from exc

    def _send(self, tensor: torch.Tensor, dst: int = 0) -> None:
        dist.send(tensor, dst=dst, group=self._group)
        with self._lock:
            self.bytes_sent += tensor.numel() * tensor.element_size()

    # -- rank 0's proxies --------------------------------------------------------------

    def _proxy(self, worker: int) -> None:
        """Serve one remote worker: receive its pushes and pulls, send the replies. Between
        segments (after its barrier reply) it waits for the next segment before posting a
        receive, so a long pause between segments never times out."""
        server, served = self._server, 0
        try:
            while True:
                with server.cond:
                    while not (server.closing or server.segment_id > served):
                        server.cond.wait()
                    if server.closing:
                        return
                header = torch.empty(HEADER_FIELDS, dtype=torch.float64)
                dist.recv(header, src=worker, group=self._group)
                kind, _, n, computed_on, loss, samples, until, _ = header.tolist()
                if int(kind) == PUSH:
                    grad = torch.empty(self._numel, dtype=torch.float32)
                    dist.recv(grad, src=worker, group=self._group)
                    with contextlib.suppress(ParameterServerError):  # stored: its pull fails
                        server.push(worker, int(n), int(computed_on), loss, samples, grad)
                    continue
                try:
                    reply = server.pull(worker, int(until))
                except ParameterServerError:
                    self._send(_header(FAILED, worker), dst=worker)
                    raise
                extra = reply.stats.numel() if reply.stats is not None else 0
                self._send(
                    _header(reply.kind, worker, reply.n, version=reply.version, extra=extra), worker
                )
                self._send(reply.params, dst=worker)
                if reply.kind == BARRIER:
                    self._send(reply.stats, dst=worker)
                    served = reply.segment
        except BaseException as exc:
            if not server.closing:
                # Whichever notices first (this receive's timeout or the server's own
                # wait), the message says where every worker was.
                with server.cond:
                    where = server.describe()
                server.fail(
                    f"worker {worker} (rank {worker}) failed, went silent for "
                    f"{self.timeout_s:g} s, or its connection broke: {exc!r}; {where}",
                    exc,
                )

    # -- resume and shutdown -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The server's extra state (rank 0, between segments); checkpoint `server_model`
        and `server_optimizer` beside it."""
        if self._server is None:
            raise RuntimeError("state_dict() is rank 0's: the server lives there")
        return self._server.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rank 0 restores the server (load `server_model`/`server_optimizer` too); any
        other rank only learns the version and next gradient numbers from it."""
        if int(state["world_size"]) != self.world_size:
            raise ValueError(
                f"async state of {state['world_size']} workers cannot resume on {self.world_size}"
            )
        self._version = int(state["version"])
        self._next_gradient = [int(n) for n in state["next_gradient"]]
        if self._server is not None:
            self._server.load_state_dict(state)

    def close(self) -> None:
        """Stop the server and proxy threads (rank 0) and leave the group. Call it between
        segments; after a failure, threads stuck on a dead peer are left (daemons)."""
        if self._server is not None:
            with self._server.cond:
                self._server.closing = True
                self._server.cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5.0)
        if self._group is not None and not any(t.is_alive() for t in self._threads):
            dist.destroy_process_group(self._group)
        self._group = None

    def __enter__(self) -> AsyncUpdates:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _header(
    kind: int,
    worker: int,
    n: int = -1,
    computed_on: int = -1,
    loss: float = 0.0,
    samples: float = 0.0,
    version: int = 0,
    extra: int = 0,
) -> torch.Tensor:
    values = [kind, worker, n, computed_on, loss, samples, version, extra]
    return torch.tensor(values, dtype=torch.float64)
