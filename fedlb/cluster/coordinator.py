"""The coordinator: every rank's report gathered to rank 0, whose BatchSizeManager decides
the next sizes, broadcast back to all ranks over the job's own process group.

CPU mode blocks at every iteration boundary (NARX needs the newest CPU and memory state).
GPU mode runs the exchange in a background thread over a separate gloo group while the next
iteration computes, and applies the sizes one iteration late (LB-BSP Section 4): every rank
applies them at the same iteration, so X = Σ x_r holds in every iteration. Whatever the
job's backend (NCCL for gradients on GPUs), the exchange's small Python objects travel on
gloo: on the CPU, off the GPU streams the gradients use.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from fedlb.balance import (
    BatchSizeManager,
    SpeedEstimator,
    Tuner,
    WorkerReport,
    default_estimator,
    default_tuner,
)

log = logging.getLogger("fedlb.cluster")


class ClusterError(RuntimeError):
    """The job cannot go on (a rank died, a collective failed); the message says which."""


@dataclass(frozen=True)
class Exchange:
    """One boundary as rank 0 saw it: the reports (None: rejected or missing) and sizes."""

    iteration: int
    reports: list[WorkerReport]
    sizes: list[int]
    rejected: list[tuple[str, str]]


def exchange_backend(job_backend: str, asynchronous: bool) -> str | None:
    """The backend of a process group of the exchange's own, or None to use the job's.

    A background exchange always gets a gloo group of its own (its collectives must not
    interleave with the training's on the job's group); a blocking one shares the job's
    group only where that is gloo already (NCCL would move every report through the GPU).
    """
    return "gloo" if asynchronous or job_backend != "gloo" else None


class Coordinator:
    """Args:
    batch_size: every rank's starting size B0 (X = world size x B0 is kept), or one
        starting size per rank (X = their sum).
    tuner, estimator: rank 0's BatchSizeManager's (default: fedlb.balance.defaults).
    asynchronous: GPU mode (exchange in the background, sizes one iteration late).
    group: the process group (default: the whole job).
    on_exchange: called on rank 0 after every exchange (logging, results).
    """

    def __init__(
        self,
        batch_size: int | Sequence[int],
        tuner: Tuner | None = None,
        estimator: Callable[[], SpeedEstimator] = default_estimator,
        *,
        asynchronous: bool = False,
        group: dist.ProcessGroup | None = None,
        on_exchange: Callable[[Exchange], None] | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise ClusterError("torch.distributed is not initialised: launch with torchrun")
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        sizes = [batch_size] * self.world if isinstance(batch_size, int) else list(batch_size)
        if len(sizes) != self.world or min(sizes) < 1:
            raise ClusterError(f"need one batch size >= 1 per rank ({self.world}), got {sizes}")
        self.sizes = sizes
        self.total = sum(sizes)
        self.group = group
        self.on_exchange = on_exchange
        self.manager = (
            BatchSizeManager(
                {str(r): sizes[r] for r in range(self.world)},
                tuner if tuner is not None else default_tuner(),
                estimator,
            )
            if self.rank == 0
            else None
        )
        self.asynchronous = asynchronous
        self._iteration = 0
        self.step_s = 0.0  # rank 0: seconds in the manager's decisions (the controller)
        self.exchange_s = 0.0  # seconds this rank spent in exchanges (gather, decide, send)
        self._pending: concurrent.futures.Future[list[int]] | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        own = exchange_backend(str(dist.get_backend(group)), asynchronous)
        if own is not None:  # every rank makes it, in the same order: a collective call
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self.group = dist.new_group(ranks=ranks, backend=own)
        if asynchronous:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "fedlb-coordinator")

    @property
    def batch_size(self) -> int:
        """This rank's current batch size."""
        return self.sizes[self.rank]

    def _collective(self, iteration: int, call: Callable[[], object]) -> None:
        """A collective of the exchange; a failed one (gloo/NCCL: a peer closed the
        connection or timed out) is a ClusterError that names this rank and iteration."""
        try:
            call()
        except RuntimeError as error:
            raise ClusterError(
                f"rank {self.rank}: the exchange after iteration {iteration} failed ({error}); "
                "a rank has probably died, so the job stops"
            ) from error

    def _exchange(self, report: WorkerReport, iteration: int) -> list[int]:
        began = time.perf_counter()
        gathered: list[WorkerReport | None] | None = [None] * self.world if self.rank == 0 else None
        self._collective(
            iteration, lambda: dist.gather_object(report, gathered, dst=0, group=self.group)
        )
        box: list[list[int] | None] = [None]
        if self.manager is not None:
            assert gathered is not None
            reports = [r for r in gathered if r is not None]
            deciding = time.perf_counter()
            by_name = self.manager.step(reports)
            self.step_s += time.perf_counter() - deciding
            sizes = [by_name[str(r)] for r in range(self.world)]
            box = [sizes]
            if self.on_exchange is not None:
                self.on_exchange(
                    Exchange(iteration, reports, sizes, list(self.manager.last_rejected))
                )
        self._collective(
            iteration, lambda: dist.broadcast_object_list(box, src=0, group=self.group)
        )
        chosen = box[0]
        assert chosen is not None
        self.exchange_s += time.perf_counter() - began
        return chosen

    def step(self, report: WorkerReport) -> int:
        """This iteration's report in, this rank's next batch size out."""
        self._iteration += 1
        if self._pool is None:
            self.sizes = self._exchange(report, self._iteration)
            return self.batch_size
        if self._pending is not None:
            self.sizes = self._pending.result()  # the previous exchange: one iteration late
        self._pending = self._pool.submit(self._exchange, report, self._iteration)
        return self.batch_size

    def close(self) -> None:
        """Finish a pending background exchange (every rank must, or a peer would hang)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
