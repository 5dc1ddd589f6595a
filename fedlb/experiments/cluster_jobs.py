"""The per-rank bodies of the cluster jobs: BSP balanced by LoadBalancer (bsp, lb-ema,
lb-narx, lb-gpu, deadband), the parameter server (asp, ssp:S, backup:K) and eager-SGD
(eager-solo, eager-majority).

Each returns what `cluster_run` writes: rows (one per rank and iteration), snapshots of the
weights over wall time (taken on the server or rank 0 and evaluated after the job, off the
timed run), and the job's counts. Clock: measured (real compute, sleep-padded to each
rank's emulated speed).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import TensorDataset

from fedlb.cluster import (
    BarrierAgent,
    DataPartitionManager,
    Exchange,
    LoadBalancer,
    LocalSGD,
    ParameterServer,
    PartialAllreduce,
    Snapshot,
    barrier_steps,
    init_ps_rpc,
    lcm_barrier,
    serve_parameters,
    timed_gradient,
    work,
)
from fedlb.training import Pace

from .load import CompetingLoad, MachineProbe

if TYPE_CHECKING:
    from .cluster_scenario import ClusterScenario

log = logging.getLogger("fedlb.cluster")

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
    outcome = JobOutcome()
    if rank == 0:
        workers = list(range(1, world))
        server = ParameterServer(model, lr, kind, parameter, workers, max_updates, snapshot_s)
        init_ps_rpc(rank, world, server)
        started = time.perf_counter()
        serve_parameters(server)
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
    init_ps_rpc(rank, world)
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
                # the gradients in the results applied so far (the flush has no count of
                # its own beyond the collectives')
                sum(allreduce.log.contributors[:applied]) * batch_size,
                parameters_to_vector(model.parameters()).detach().clone(),
            )
        )

    if rank == 0:
        snapshot()
    going_on = True
    while going_on:
        x, y = next(batches)
        step = timed_gradient(model, x, y, loss_fn, pace)
        compute.append(step.compute_s)
        outcome.losses.append(step.loss)
        results, going_on = allreduce.exchange(step.gradient)
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
    outcome.samples = sum(allreduce.log.contributors) * batch_size
    contributors = allreduce.log.contributors
    outcome.extra = {
        "mean_contributors": sum(contributors) / len(contributors) if contributors else None,
        "wait_s": allreduce.log.wait_s,
        "deposited": allreduce.log.deposited,
    }
    return outcome


def local_job(
    policy: str,
    local_steps: int,
    rank: int,
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    iterations: int,
    snapshot_s: float,
    pace: Pace | None,
    batch_size: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
) -> JobOutcome:
    """One rank of local SGD: `iterations` local steps on its replica, averaged every
    `local_steps` (and once at the end). Snapshots: rank 0's averaged model."""
    world = dist.get_world_size()
    local = LocalSGD(model, local_steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    outcome = JobOutcome()
    compute: list[float] = []
    started = last_snapshot = time.perf_counter()

    def snapshot(steps: int) -> None:
        outcome.snapshots.append(
            Snapshot(
                time.perf_counter() - started,
                steps,
                steps * batch_size * world,
                parameters_to_vector(model.parameters()).detach().cpu().clone(),
            )
        )

    if rank == 0:
        snapshot(0)
    for step in range(1, iterations + 1):
        x, y = next(batches)
        timed = timed_gradient(model, x, y, loss_fn, pace)
        optimizer.step()
        compute.append(timed.compute_s)
        outcome.losses.append(timed.loss)
        averaged = local.step()
        now = time.perf_counter()
        if rank == 0 and averaged and now - last_snapshot >= snapshot_s:
            snapshot(step)
            last_snapshot = now
    local.finish()
    outcome.wall_s = time.perf_counter() - started
    if rank == 0:
        snapshot(iterations)
    outcome.rows = _rows(policy, rank, compute, batch_size)
    outcome.updates = iterations
    outcome.extra = {"averages": local.averages}
    return outcome


def orchestra_job(
    policy: str,
    bound: int,
    rank: int,
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    probe: tuple[torch.Tensor, torch.Tensor],
    lr: float,
    iterations: int,
    snapshot_s: float,
    pace: Pace | None,
    batch_size: int,
    seed: int,
    partitions: DataPartitionManager | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
    baseline: str = "moving",
) -> JobOutcome:
    """One rank of Orchestra: rounds of τ_n local steps, then the replicas averaged; rank
    0 measures every worker's time per batch, searches the barrier (LCM, bound M = `bound`)
    and lets the agent (reward `baseline`: BarrierAgent's) move it; the next τ_n are
    broadcast. The job processes as many samples as `iterations` BSP iterations of X
    would. `probe`: training samples on which rank 0 measures the averaged model's
    training accuracy for the agent. With
    `partitions` (rank-local shards) the Data Partition Controller keeps each shard's size
    in proportion to its worker's local steps (its speed): re-partitioned whenever a share
    is more than 5 points off."""
    world = dist.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    agent = BarrierAgent(seed, baseline=baseline) if rank == 0 else None
    outcome = JobOutcome()
    compute: list[float] = []
    barriers: list[dict[str, Any]] = []
    budget = iterations * batch_size * world
    steps = [2] * world  # the first round measures every worker's time per batch
    done = rounds = 0
    started = last_snapshot = round_began = time.perf_counter()

    def snapshot() -> None:
        outcome.snapshots.append(
            Snapshot(
                time.perf_counter() - started,
                rounds,
                done,
                parameters_to_vector(model.parameters()).detach().cpu().clone(),
            )
        )

    if rank == 0:
        snapshot()
    while done < budget:
        mine = []
        for _ in range(steps[rank]):
            x, y = next(batches) if partitions is None else partitions.next_batch()
            timed = timed_gradient(model, x, y, loss_fn, pace)
            optimizer.step()
            mine.append(timed.compute_s)
            outcome.losses.append(timed.loss)
        compute += mine
        waited = time.perf_counter()
        with torch.no_grad():  # the barrier: the replicas averaged
            weights = parameters_to_vector(model.parameters())
            dist.all_reduce(weights)
            vector_to_parameters(weights / world, model.parameters())
        waited = time.perf_counter() - waited
        done += sum(steps) * batch_size
        rounds += 1
        size = 0 if partitions is None else len(partitions.shard)
        measured = torch.tensor([sum(mine) / len(mine), waited, float(size)])
        everyone = [torch.zeros(3) for _ in range(world)]
        dist.all_gather(everyone, measured)
        box: list[Any] = [None]
        if agent is not None:
            now = time.perf_counter()
            batch_times = [float(e[0]) for e in everyone]
            with torch.no_grad():
                accuracy = float((model(probe[0]).argmax(dim=1) == probe[1]).float().mean())
            waiting = statistics.fmean(float(e[1]) for e in everyone) / max(now - round_began, 1e-9)
            decision = agent.decide(
                done / budget, statistics.fmean(steps), accuracy, waiting, now - round_began
            )
            barrier = barrier_steps(lcm_barrier(batch_times, bound), decision.level, batch_times)
            barriers.append(
                {
                    "seconds": now - started,
                    "round": rounds,
                    "barrier_s": barrier.seconds,
                    "level": decision.level,
                    "steps": list(barrier.steps),
                    "batch_times": batch_times,
                    "reward": decision.reward,
                    "decision_s": decision.decision_s,
                    "probe_accuracy": accuracy,
                }
            )
            sizes = [float(e[2]) for e in everyone]
            shares = [s / sum(barrier.steps) for s in barrier.steps]
            off = (
                partitions is not None
                and max(
                    abs(share - held / sum(sizes))
                    for share, held in zip(shares, sizes, strict=True)
                )
                > 0.05
            )
            box = [(list(barrier.steps), off)]
            if now - last_snapshot >= snapshot_s:
                snapshot()
                last_snapshot = now
        dist.broadcast_object_list(box, src=0)
        steps, repartition = box[0]
        if partitions is not None and repartition:  # the Data Partition Controller
            partitions.rebalance(steps)
        round_began = time.perf_counter()
    outcome.wall_s = time.perf_counter() - started
    if rank == 0:
        snapshot()
    outcome.rows = _rows(policy, rank, compute, batch_size)
    outcome.updates = rounds
    decisions = [b["decision_s"] for b in barriers]
    outcome.extra = {
        "rounds": rounds,
        "barriers": barriers,
        "partition_moves": [] if partitions is None else [m.__dict__ for m in partitions.moves],
        "agent_decision_s_mean": statistics.fmean(decisions) if decisions else None,
        "agent_decision_s_max": max(decisions, default=None),
    }
    return outcome


def bsp_job(
    scenario: ClusterScenario,
    rank: int,
    network: nn.Module,
    data: TensorDataset | Callable[[], DataPartitionManager],
    device: torch.device,
    backend: str,
    pace: Pace | None,
    load: CompetingLoad | None,
    slowdown: list[float],
) -> JobOutcome:
    """One rank of a BSP job balanced by LoadBalancer (bsp, lb-ema, lb-narx, lb-gpu,
    deadband): DDP with the weighted all-reduce, sizes from rank 0's manager. `data`: the
    whole dataset, or (shard-local data) what makes this rank's partition manager once
    the process group is up."""
    dist.init_process_group(backend)
    dataset = data if isinstance(data, TensorDataset) else data()
    model = DistributedDataParallel(
        network, device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=scenario.learning_rate)
    outcome = JobOutcome()
    iteration_s: list[float] = []

    def record(exchange: Exchange) -> None:
        speeds = {r.worker: r.speed for r in exchange.reports}
        slowest = max(r.compute_s for r in exchange.reports)
        total = sum(r.batch_size for r in exchange.reports)
        # where t(B) is not linear (GPU-like, measured curves): T* of those curves
        ideal = scenario.ideal_s(exchange.iteration, total, speeds)
        for r in exchange.reports:
            outcome.rows.append(
                {
                    "iteration": exchange.iteration,
                    "rank": int(r.worker),
                    "batch_size": r.batch_size,
                    "compute_s": r.compute_s,
                    "cpu": r.cpu,
                    "mem": r.mem,
                    "next_batch_size": exchange.sizes[int(r.worker)],
                    "slowest_compute_s": slowest,
                    "ideal_s": ideal,
                    "efficiency": ideal / slowest,
                    "policy": scenario.policy,
                    "clock": MEASURED,
                }
            )

    balancer = LoadBalancer(
        model,
        dataset,
        scenario.initial_sizes(),
        scenario.tuner(),
        scenario.estimator(),
        asynchronous=scenario.gpu_like,
        pace=pace,
        seed=scenario.seed,
        on_exchange=record if rank == 0 else None,
        probe=MachineProbe(load.pid) if load else None,
    )
    started = last = last_snapshot = time.perf_counter()
    total = sum(scenario.initial_sizes())

    def snapshot(updates: int) -> None:
        outcome.snapshots.append(
            Snapshot(
                time.perf_counter() - started,
                updates,
                updates * total,
                parameters_to_vector(network.parameters()).detach().cpu().clone(),
            )
        )

    if rank == 0:
        snapshot(0)
    for step, (x, y) in enumerate(balancer.batches(scenario.iterations), start=1):
        # The load's state now, right after the boundary's resource sample, sets this
        # iteration's speed: resources measured at k drive iteration k + 1 (Sec. 3.2.2).
        slowdown[0] = load.slowdown() if load is not None else 1.0
        loss: torch.Tensor = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        outcome.losses.append(loss.item())
        now = time.perf_counter()
        iteration_s.append(now - last)  # the BSP iteration as this rank lived it
        last = now
        if rank == 0 and (
            now - last_snapshot >= scenario.snapshot_s or step == scenario.iterations
        ):
            snapshot(step)
            last_snapshot = now
        if rank == 0 and step % 10 == 0:
            log.info("iteration %d: sizes %s, loss %.3f", step, balancer.coordinator.sizes, loss)
    balancer.close()
    outcome.wall_s = time.perf_counter() - started
    outcome.updates = scenario.iterations
    coordinator = balancer.coordinator
    steady = [r["efficiency"] for r in outcome.rows if r["iteration"] > 10 and r["rank"] == 0]
    if isinstance(dataset, DataPartitionManager):  # every rank saw the same decisions
        outcome.extra |= {
            "partition_moves": [m.__dict__ for m in dataset.moves],
            "partition_bytes_moved": dataset.bytes_moved,
            "traversal_gaps": dataset.gaps,
        }
    outcome.extra |= {
        "mean_iteration_s": statistics.fmean(iteration_s[10:] or iteration_s),
        "steady_efficiency": statistics.fmean(steady) if steady else None,
        "final_sizes": coordinator.sizes,
        # rank 0: the manager's decisions, and whole exchanges (waits for ranks included)
        "controller_s_per_iteration": coordinator.step_s / scenario.iterations,
        "exchange_s_per_iteration": coordinator.exchange_s / scenario.iterations,
    }
    dist.barrier()
    # The DDP model (its reducer holds gloo work) goes before the group: one outliving its
    # process group can abort the rank at exit, failing a finished job.
    del balancer, model, optimizer
    dist.destroy_process_group()
    return outcome
