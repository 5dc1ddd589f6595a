"""The virtual engine's schemes without a per-iteration barrier of all workers: the
parameter server's asp, ssp:S and backup:K (as fedlb.cluster.ps runs them), eager-SGD's
partial all-reduce (fedlb.cluster.eager), local SGD and Orchestra (fedlb.cluster.local,
fedlb.cluster.orchestra).

A worker computes its gradient at the moment it starts an iteration, on the weights it
read then; the gradient lands B / v + iteration_s virtual seconds later. So the
staleness is exact: the updates applied between its read and its arrival. Events are
taken from a priority queue in arrival order (ties: the order they were queued).
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics

import torch

from .orchestra import BarrierAgent, barrier_steps, lcm_barrier
from .virtual_clock import Run


def parameter_server(run: Run, kind: str, parameter: int) -> None:
    """asp (every gradient applied on arrival), ssp (a worker with clock c starts another
    iteration only while c − the slowest clock <= `parameter`), backup (the first n − K
    gradients computed on the current version are averaged, later ones dropped; a worker
    starts again once the version has moved past the one it last pushed)."""
    costs, n, batch = run.job.costs, run.n, run.job.batch_size
    queue: list[tuple[float, int, int, int, float, torch.Tensor]] = []
    order = itertools.count()
    clocks = [0] * n  # iterations pushed, per worker
    seen = [-1] * n  # backup: the version each worker last pushed a gradient for
    pending: list[torch.Tensor] = []  # backup: this version's gradients so far
    waiting: set[int] = set()

    def start(worker: int, now: float) -> None:
        gradient = run.gradient(run.batch(worker, batch))  # on the weights it pulls now
        arrival = now + run.compute_s(worker, batch, now) + costs.iteration_s
        heapq.heappush(queue, (arrival, next(order), worker, run.version, now, gradient))

    for worker in range(n):
        start(worker, 0.0)
    while queue and not run.done:
        now, _, worker, read, began, gradient = heapq.heappop(queue)
        run.result.iterations[worker] += 1
        clocks[worker] += 1
        entry = {"worker": worker, "start": began, "arrival": now, "read": read}
        entry["staleness"] = run.version - read
        if kind == "backup":
            seen[worker] = read
            entry["dropped"] = read != run.version
            if read == run.version:
                pending.append(gradient)
                if len(pending) == n - parameter:
                    samples = len(pending) * batch
                    step = run.lr(samples) * torch.stack(pending).mean(dim=0)
                    pending = []
                    run.apply(now, step, samples)
        else:
            run.apply(now, run.lr(batch) * gradient, batch)
        run.result.log.append(entry)
        waiting.add(worker)
        slowest = min(clocks)
        for other in sorted(waiting):
            if (
                kind == "asp"
                or (kind == "ssp" and clocks[other] - slowest <= parameter)
                or (kind == "backup" and run.version > seen[other])
            ):
                waiting.discard(other)
                start(other, now)
        run.observe(now)
    run.result.extra |= {"pushes": sum(clocks), "blocked_at_end": sorted(waiting)}
    if kind == "backup":
        run.result.extra["dropped"] = sum(1 for e in run.result.log if e["dropped"])


def eager(run: Run, mode: str) -> None:
    """eager-SGD: a collective starts when the first worker has a gradient (solo) or when
    a randomly drawn initiator has (majority; the draw as PartialAllreduce's), never
    before the previous one ended; it sums the gradients ready by then, divided by n;
    those workers start again after it, the others go on computing on the weights they
    read (their gradient joins a later collective)."""
    costs, n, batch = run.job.costs, run.n, run.job.batch_size
    initiators = random.Random(run.job.seed)
    ready = [0.0] * n
    started = [0.0] * n
    read = [0] * n
    gradients: list[torch.Tensor] = []

    def start(worker: int, now: float) -> None:
        gradients[worker] = run.gradient(run.batch(worker, batch))
        ready[worker] = now + run.compute_s(worker, batch, now) + costs.iteration_s
        started[worker], read[worker] = now, run.version

    gradients.extend(torch.empty(0) for _ in range(n))
    for worker in range(n):
        start(worker, 0.0)
    previous = 0.0
    while not run.done:
        if mode == "solo":
            begin = max(previous, min(ready))
        else:
            begin = max(previous, ready[initiators.randrange(n)])
        ready_now = [w for w in range(n) if ready[w] <= begin]
        end = begin + costs.allreduce_s
        total = torch.stack([gradients[w] for w in ready_now]).sum(dim=0) / n
        stale = [run.version - read[w] for w in ready_now]
        run.apply(end, run.lr(n * batch) * total, len(ready_now) * batch)
        run.result.log.append(
            {"start": begin, "end": end, "contributors": ready_now, "staleness": stale}
        )
        for worker in ready_now:
            run.result.iterations[worker] += 1
            start(worker, end)
        previous = end
        run.observe(end)
    contributors = [len(e["contributors"]) for e in run.result.log]
    run.result.extra |= {"mean_contributors": statistics.fmean(contributors) if contributors else 0}


def local_rounds(run: Run, name: str, parameter: int) -> None:
    """Rounds of local steps on each worker's replica, then the replicas averaged (an
    all-reduce). local-sgd:H: H steps each. orchestra:M / orchestra-paper:M: 2 steps in
    the first round (every worker's time per batch measured), then the steps of the LCM
    barrier (local steps at most M apart) moved by the BarrierAgent, which sees the
    round's progress, the mean local steps, the averaged model's accuracy on 256 training
    samples and the waiting share, as in the real job."""
    job, costs, n, batch = run.job, run.job.costs, run.n, run.job.batch_size
    orchestra = name.startswith("orchestra")
    agent = None
    if orchestra:
        agent = BarrierAgent(job.seed, baseline="best" if name == "orchestra-paper" else "moving")
    steps = [2] * n if orchestra else [parameter] * n
    budget = job.max_samples or job.max_seconds * sum(job.speeds)
    probe = run.data.train_x[:256], run.data.train_y[:256]
    now = 0.0
    while not run.done:
        replicas, ends, batch_times = [], [], []
        for worker in range(n):
            weights, clock, times = run.weights.clone(), now, []
            for _ in range(steps[worker]):
                weights -= run.lr(batch) * run.gradient(run.batch(worker, batch), weights)
                times.append(run.compute_s(worker, batch, clock))
                clock += times[-1] + costs.local_step_s
                run.result.iterations[worker] += 1
            replicas.append(weights)
            ends.append(clock)
            batch_times.append(statistics.fmean(times))
        end = max(ends) + costs.allreduce_s
        run.apply(end, run.weights - torch.stack(replicas).mean(dim=0), sum(steps) * batch)
        entry = {"start": now, "end": end, "steps": list(steps), "batch_times": batch_times}
        if agent is not None:
            waiting = statistics.fmean(end - e for e in ends) / (end - now)
            decision = agent.decide(
                run.result.samples / budget,
                statistics.fmean(steps),
                run.accuracy(*probe),
                waiting,
                end - now,
            )
            barrier = barrier_steps(
                lcm_barrier(batch_times, parameter), decision.level, batch_times
            )
            steps = list(barrier.steps)
            entry |= {"level": decision.level, "barrier_s": barrier.seconds}
        run.result.log.append(entry)
        now = end
        run.observe(now)
