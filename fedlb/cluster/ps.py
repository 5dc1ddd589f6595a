"""Parameter-server schemes on torch.distributed.rpc: ASP, SSP and backup workers.

PyTorch's own RPC framework carries them (its parameter-server pattern): the server, one
process of the job (`PS_NAME`), holds the model; each worker pulls the weights, computes a
gradient on its own batch and pushes it. What differs is when the server lets them go on:

- `asp`: never waits. Every push is one SGD step with that worker's gradient, applied at
  once; a worker computes on whatever weights it last pulled (stale by the pushes that
  landed meanwhile). No barrier: a fast worker makes many updates while a slow one makes one.
- `ssp` (bound S): as asp, but a worker that has finished c iterations may start another
  only while c − (the slowest worker's count) ≤ S; otherwise its pull waits (Ho et al.).
  S = 0 is BSP without batch averaging.
- `backup` (K backup workers, Chen et al.; TensorFlow's `replicas_to_aggregate` = n − K):
  synchronous SGD that averages the first n − K gradients computed on the current weights
  and drops the K that arrive later (they were computed on weights now replaced).

The server records what happened (each pull's clocks, each version's contributors and the
gradients dropped) and keeps snapshots of the weights every `snapshot_s` for evaluation
after the job: evaluating during it would steal time from the run being timed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from fedlb.training import Pace

logger = logging.getLogger("fedlb.cluster")  # (`log` is a worker's WorkerLog below)

# What a peer closing its pipes first looks like from TensorPipe (the transport's own words)
PEER_LEFT = ("connection reset", "connection closed", "econnreset", "eof", "broken pipe")

PS_NAME = "ps"


@dataclass(frozen=True)
class TimedGradient:
    """One batch's flattened gradient (the mean over the batch), its loss, and the
    seconds it took (sleep padding included where the worker emulates a slower machine)."""

    gradient: torch.Tensor
    loss: float
    compute_s: float


def timed_gradient(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    pace: Pace | None = None,
) -> TimedGradient:
    """Forward and backward on (x, y), padded to `pace`; the parameters' .grad stay set
    (an optimizer can step on them)."""
    started = time.perf_counter()
    model.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    real = time.perf_counter() - started
    if pace is not None and (remaining := pace(real, len(y)) - real) > 0:
        time.sleep(remaining)
    return TimedGradient(gradient, float(loss.detach()), time.perf_counter() - started)


PS_KINDS = ("asp", "ssp", "backup")


def worker_name(rank: int) -> str:
    """The RPC name of the job's rank `rank` (rank 0 is the server)."""
    return PS_NAME if rank == 0 else f"worker{rank}"


@dataclass(frozen=True)
class Snapshot:
    """The server's weights at one moment: seconds since the job's start, updates applied
    and samples that went into them."""

    seconds: float
    updates: int
    samples: int
    weights: torch.Tensor


@dataclass
class ServerLog:
    """What the server saw. `pulls`: (worker, its clock, the slowest clock) per pull;
    `arrivals`: the workers whose gradients for each version arrived, in order;
    `aggregated`: backup's contributors per applied version; `dropped`: gradients not
    applied, per version."""

    pulls: list[tuple[int, int, int]] = field(default_factory=list)
    arrivals: dict[int, list[int]] = field(default_factory=dict)
    aggregated: dict[int, list[int]] = field(default_factory=dict)
    dropped: dict[int, list[int]] = field(default_factory=dict)
    pushes: int = 0
    wait_s: float = 0.0  # seconds workers' pulls spent waiting (ssp's bound, backup's round)


class ParameterServer:
    """The model and the update rule of one scheme. Thread-safe: RPC handlers run on the
    RPC thread pool, a waiting pull holds one of its threads.

    Args:
        model: the initial model (its weights are copied).
        lr: the SGD learning rate of every applied update.
        kind: asp, ssp or backup.
        parameter: ssp's staleness bound S, or backup's number K of backup workers.
        workers: the workers' ranks.
        max_updates: updates after which the job ends.
        snapshot_s: seconds between snapshots of the weights.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        kind: str,
        parameter: int | None,
        workers: list[int],
        max_updates: int,
        snapshot_s: float = 1.0,
    ) -> None:
        if kind not in PS_KINDS:
            raise ValueError(f"kind must be one of {', '.join(PS_KINDS)}, got {kind!r}")
        if kind == "backup" and not (parameter is not None and 1 <= parameter < len(workers)):
            raise ValueError(
                f"backup:K needs 1 <= K < the {len(workers)} workers, got K = {parameter}"
            )
        if kind == "ssp" and (parameter is None or parameter < 0):
            raise ValueError(f"ssp:S needs a staleness bound S >= 0, got {parameter}")
        self.weights = parameters_to_vector(model.parameters()).detach().clone()
        self.lr = lr
        self.kind = kind
        self.parameter = parameter or 0
        self.clocks = dict.fromkeys(workers, 0)
        self.max_updates = max_updates
        self.snapshot_s = snapshot_s
        self.version = 0  # updates applied
        self.samples = 0
        self.done = False
        self.log = ServerLog()
        self.snapshots: list[Snapshot] = []
        self._pending: list[tuple[int, torch.Tensor, int]] = []  # backup: this version's
        self._seen: dict[int, int] = dict.fromkeys(workers, -1)  # backup: last version pushed
        self._cond = threading.Condition()
        self._started = time.perf_counter()
        self._snapshot()

    # ---- the two calls workers make ------------------------------------------------------

    def pull(self, worker: int, clock: int) -> tuple[int, torch.Tensor] | None:
        """(version, weights) for the worker's next iteration; None once the job is over."""
        began = time.perf_counter()
        with self._cond:
            if self.kind == "ssp":
                self._cond.wait_for(
                    lambda: self.done or clock - min(self.clocks.values()) <= self.parameter
                )
                if not self.done:
                    self.log.pulls.append((worker, clock, min(self.clocks.values())))
            elif self.kind == "backup":  # the weights after the version it last worked on
                self._cond.wait_for(lambda: self.done or self.version > self._seen[worker])
            self.log.wait_s += time.perf_counter() - began
            if self.done:
                return None
            return self.version, self.weights.clone()

    def push(self, worker: int, version: int, gradient: torch.Tensor, samples: int) -> None:
        """The worker's gradient (the mean over its `samples`), computed on `version`."""
        with self._cond:
            if self.done:
                return
            self.log.pushes += 1
            self.clocks[worker] += 1
            self.log.arrivals.setdefault(version, []).append(worker)
            if self.kind == "backup":
                self._backup(worker, version, gradient, samples)
            else:
                self.weights -= self.lr * gradient
                self._applied(samples)
            self._cond.notify_all()

    def _backup(self, worker: int, version: int, gradient: torch.Tensor, samples: int) -> None:
        self._seen[worker] = version
        if version != self.version:  # computed on weights already replaced
            self.log.dropped.setdefault(version, []).append(worker)
            return
        self._pending.append((worker, gradient, samples))
        if len(self._pending) < len(self.clocks) - self.parameter:
            return
        self.weights -= self.lr * torch.stack([g for _, g, _ in self._pending]).mean(dim=0)
        self.log.aggregated[version] = [w for w, _, _ in self._pending]
        total = sum(n for _, _, n in self._pending)
        self._pending = []
        self._applied(total)

    def _applied(self, samples: int) -> None:
        self.version += 1
        self.samples += samples
        elapsed = time.perf_counter() - self._started
        if self.snapshots[-1].seconds + self.snapshot_s <= elapsed:
            self._snapshot()
        if self.version >= self.max_updates:
            self.done = True
            self._snapshot()

    def _snapshot(self) -> None:
        self.snapshots.append(
            Snapshot(
                time.perf_counter() - self._started,
                self.version,
                self.samples,
                self.weights.clone(),
            )
        )

    def wait_done(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.done, timeout)


# The server of this process (set by serve()): what the RPC functions below reach.
_SERVER: ParameterServer | None = None


def _server() -> ParameterServer:
    if _SERVER is None:
        raise RuntimeError("this process serves no parameter server (rank 0 serves it)")
    return _SERVER


def _pull(worker: int, clock: int) -> tuple[int, torch.Tensor] | None:
    return _server().pull(worker, clock)


def _push(worker: int, version: int, gradient: torch.Tensor, samples: int) -> None:
    _server().push(worker, version, gradient, samples)


def init_ps_rpc(
    rank: int, world: int, server: ParameterServer | None = None, timeout_s: float = 120.0
) -> None:
    """Join the job's RPC group (torchrun's MASTER_ADDR/PORT); enough RPC threads that
    every worker's waiting pull and a push can be served at once. Rank 0 passes its
    `server`: it is in place before any worker can reach it."""
    global _SERVER
    if (rank == 0) != (server is not None):
        raise ValueError("rank 0, and only rank 0, serves the parameters: pass its server")
    _SERVER = server
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=max(16, 2 * world + 4), rpc_timeout=timeout_s
    )
    rpc.init_rpc(  # type: ignore[no-untyped-call]
        worker_name(rank), rank=rank, world_size=world, rpc_backend_options=options
    )


def serve(server: ParameterServer) -> None:
    """Rank 0, after `init_ps_rpc(0, world, server)`: serve until the job is over, then
    leave the RPC group (which waits for every worker to leave it too)."""
    if _SERVER is not server:
        raise RuntimeError("call init_ps_rpc(0, world, server) with this server first")
    server.wait_done()
    leave_rpc(0)


@dataclass
class WorkerLog:
    """One worker's side: compute seconds (sleep padding included) and losses per
    iteration, and seconds waiting on the server (pull and push round trips)."""

    compute_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    exchange_s: float = 0.0


def work(
    rank: int,
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    pace: Pace | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
) -> WorkerLog:
    """A worker: pull, compute a gradient on the next batch, push; until the server says
    the job is over. Then leaves the RPC group."""
    log = WorkerLog()
    clock = 0
    while True:
        began = time.perf_counter()
        got = rpc.rpc_sync(PS_NAME, _pull, args=(rank, clock))
        log.exchange_s += time.perf_counter() - began
        if got is None:
            break
        version, weights = got
        vector_to_parameters(weights, model.parameters())
        x, y = next(batches)
        step = timed_gradient(model, x, y, loss_fn, pace)
        log.compute_s.append(step.compute_s)
        log.losses.append(step.loss)
        began = time.perf_counter()
        rpc.rpc_sync(PS_NAME, _push, args=(rank, version, step.gradient, len(y)))
        log.exchange_s += time.perf_counter() - began
        clock += 1
    leave_rpc(rank)
    return log


def leave_rpc(rank: int) -> None:
    """Leave the RPC group once the job is over (every result is in by then).

    TensorPipe's pipes have no graceful close: a peer that leaves first can reset a
    connection this rank's shutdown still reads, and `rpc.shutdown()` then raises
    (PyTorch calls these errors expected and harmless, pytorch/pytorch#51785; it failed
    the ASP test here once, "Connection reset by peer"). That is logged, the local agent
    closed without the barrier, and the rank goes on; any other error is raised."""
    try:
        rpc.shutdown()
    except RuntimeError as error:
        if not any(word in str(error).lower() for word in PEER_LEFT):
            raise
        logger.warning(
            "rank %d: a peer closed its RPC connection while this rank was leaving the "
            "job's group (%s); the job had ended, nothing is lost",
            rank,
            str(error).splitlines()[0][:200],
        )
        with contextlib.suppress(RuntimeError):  # already torn down by the failed barrier
            rpc.shutdown(graceful=False)
