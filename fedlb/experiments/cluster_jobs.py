"""The per-rank bodies of the cluster straggler schemes that do not run on LoadBalancer:
the parameter server (asp, ssp:S, backup:K) and eager-SGD (eager-solo, eager-majority).

Each returns what `cluster_run` writes: rows (one per rank and iteration), snapshots of the
weights over wall time (taken on the server or rank 0 and evaluated after the job, off the
timed run), and the job's counts. Clock: measured (real compute, sleep-padded to each
rank's emulated speed), as for the BSP policies.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from fedlb.cluster.eager import PartialAllreduce
from fedlb.cluster.ps import ParameterServer, Snapshot, init_ps_rpc, serve, work
from fedlb.training import Pace

MEASURED = "measured (emulated speeds)"


@dataclass
class JobOutcome:
    """What one rank brings back. `updates`: model updates applied in the job (server's or
    rank 0's count); `snapshots`: weights over time (server / rank 0 only)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    updates: int = 0
    samples: int = 0
    wall_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _rows(policy: str, rank: int, compute: list[float], batch: int) -> list[dict[str, Any]]:
    return [
        {
            "iteration": i + 1,
            "rank": rank,
            "batch_size": batch,
            "compute_s": c,
            "policy": policy,
            "clock": MEASURED,
        }
        for i, c in enumerate(compute)
    ]


def ps_job(
    policy: str,
    kind: str,
    parameter: int | None,
    rank: int,
    world: int,
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    max_updates: int,
    snapshot_s: float,
    pace: Pace | None,
    batch_size: int,
) -> JobOutcome:
    """Rank 0 serves the parameters, ranks 1..world-1 work (torchrun's env for RPC)."""
    init_ps_rpc(rank, world)
    outcome = JobOutcome()
    if rank == 0:
        server = ParameterServer(
            model,
            lr,
            kind,
            parameter,
            list(range(1, world)),
            max_updates,
            snapshot_s,
        )
        started = time.perf_counter()
        serve(server)
        outcome.wall_s = time.perf_counter() - started
        outcome.snapshots = server.snapshots
        outcome.updates = server.version
        outcome.samples = server.samples
        seen = server.log
        outcome.extra = {
            "pushes": seen.pushes,
            "dropped": sum(len(v) for v in seen.dropped.values()),
            "max_staleness_seen": max((c - low for _, c, low in seen.pulls), default=None),
            "pull_wait_s": seen.wait_s,
        }
        return outcome
    done = work(rank, model, batches, pace)
    outcome.rows = _rows(policy, rank, done.compute_s, batch_size)
    outcome.losses = done.losses
    outcome.extra = {"exchange_s": done.exchange_s}
    return outcome


def job_store() -> Store:
    """A client of torchrun's key-value store (MASTER_ADDR:MASTER_PORT), as env:// uses."""
    return TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timedelta(seconds=120),
    )


def _apply(model: nn.Module, results: list[torch.Tensor], lr: float) -> None:
    with torch.no_grad():
        params = list(model.parameters())
        weights = parameters_to_vector(params)
        for result in results:
            weights -= lr * result
        vector_to_parameters(weights, params)


def eager_job(
    policy: str,
    mode: str,
    rank: int,
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    collectives: int,
    snapshot_s: float,
    pace: Pace | None,
    batch_size: int,
    store: Store,
    seed: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
) -> JobOutcome:
    """One rank of eager-SGD: compute, deposit, apply every collective's result. The job
    ends after `collectives` partial all-reduces and one flush."""
    size = sum(p.numel() for p in model.parameters())
    allreduce = PartialAllreduce(size, mode, collectives, store, seed=seed)
    outcome = JobOutcome()
    compute: list[float] = []
    started = last_snapshot = time.perf_counter()
    applied = 0

    def snapshot() -> None:
        outcome.snapshots.append(
            Snapshot(
                time.perf_counter() - started,
                applied,
                applied * batch_size * allreduce.world,
                parameters_to_vector(model.parameters()).detach().clone(),
            )
        )

    if rank == 0:
        snapshot()
    going_on = True
    while going_on:
        x, y = next(batches)
        began = time.perf_counter()
        model.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        real = time.perf_counter() - began
        if pace is not None and (remaining := pace(real, len(y)) - real) > 0:
            time.sleep(remaining)
        compute.append(time.perf_counter() - began)
        outcome.losses.append(float(loss.detach()))
        results, going_on = allreduce.exchange(gradient)
        _apply(model, results, lr)
        applied += len(results)
        now = time.perf_counter()
        if rank == 0 and now - last_snapshot >= snapshot_s:
            snapshot()
            last_snapshot = now
    final = allreduce.finish()
    _apply(model, final, lr)
    applied += len(final)
    outcome.wall_s = time.perf_counter() - started
    if rank == 0:
        snapshot()
    outcome.rows = _rows(policy, rank, compute, batch_size)
    outcome.updates = applied
    outcome.samples = allreduce.log.deposited * batch_size  # this rank's; summed by the caller
    contributors = allreduce.log.contributors
    outcome.extra = {
        "mean_contributors": sum(contributors) / len(contributors) if contributors else None,
        "wait_s": allreduce.log.wait_s,
        "deposited": allreduce.log.deposited,
    }
    return outcome
