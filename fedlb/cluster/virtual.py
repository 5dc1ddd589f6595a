"""The cluster schemes on a virtual clock: 16-64 workers compared on one small machine.

`run_virtual(policy, job, model, data)` runs one scheme of `CLUSTER_POLICIES` with the
workers' speeds of `job` (a `VirtualJob`): every worker's iteration takes B / v + fixed
costs seconds on a virtual clock, nobody sleeps, and the gradients are computed for real
in this one process, one after another, so accuracy is real and only time is virtual.
Results name their clock: `virtual`.

- Synchronous BSP policies (bsp, lb, lb-ema, lb-narx, lb-gpu, deadband): an iteration
  lasts max_i(B_i / v_i + iteration_s) + allreduce_s (+ exchange_s where sizes are
  tuned); one model step on the union of the workers' batches (the weighted all-reduce's
  g = Σ B_i g_i / X is the mean over all X samples). Sizes come from the same
  `BatchSizeManager`, tuner and estimator the real `Coordinator` builds, fed with the
  virtual compute times (lb-gpu: applied one iteration late, as the real GPU mode).
- Parameter-server schemes (asp, ssp:S, backup:K) and eager-SGD (eager-solo,
  eager-majority): event-driven on a priority queue (virtual_async.py).
- Local SGD and Orchestra (its LCM barrier and its `BarrierAgent`, fed the virtual batch
  times and real probe accuracy): virtual_async.py.
"""

from __future__ import annotations

import torch
from torch import nn

from fedlb.balance import BatchSizeManager, WorkerReport

from .policies import ClusterPolicy, parse_policy
from .virtual_async import eager, local_rounds, parameter_server
from .virtual_clock import (
    VIRTUAL,
    Run,
    VirtualCosts,
    VirtualData,
    VirtualJob,
    VirtualResult,
)

__all__ = ["VIRTUAL", "VirtualCosts", "VirtualData", "VirtualJob", "VirtualResult", "run_virtual"]


def run_virtual(policy: str, job: VirtualJob, model: nn.Module, data: VirtualData) -> VirtualResult:
    """One run of `policy` ('bsp', 'lb-ema', 'asp', 'ssp:5', 'backup:1', 'eager-solo',
    'orchestra:4', ...) on `model` (its weights are the start; it ends holding the last).
    Raises ValueError for a policy the engine does not run or that does not fit the job."""
    name, chosen, parameter = parse_policy(policy)
    run = Run(policy, job, model, data)
    if chosen.engine == "bsp":
        synchronous(run, chosen)
    elif chosen.engine == "ps":
        if name == "backup" and not (parameter is not None and 1 <= parameter < run.n):
            raise ValueError(f"{policy}: K backup workers must be 1 <= K < {run.n}")
        parameter_server(run, name, parameter or 0)
    elif chosen.engine == "eager":
        eager(run, name.removeprefix("eager-"))
    elif chosen.engine in ("local", "orchestra"):
        assert parameter is not None
        local_rounds(run, name, parameter)
    else:  # pragma: no cover - every engine of the table is handled above
        raise ValueError(f"the virtual engine does not run {policy}")
    return run.finish()


def synchronous(run: Run, policy: ClusterPolicy) -> None:
    """BSP balanced by a policy of fedlb.balance (static: plain BSP)."""
    job, costs, n = run.job, run.job.costs, run.n
    sizes = [job.batch_size] * n
    total = sum(sizes)
    estimator = policy.make_estimator(job.narx_warmup if policy.estimator == "narx" else None)
    manager = BatchSizeManager({str(w): sizes[w] for w in range(n)}, policy.make_tuner(), estimator)
    tuned = policy.tuner != "static"
    pending: list[int] | None = None  # lb-gpu: the sizes decided one iteration ago
    now = 0.0
    while not run.done:
        computes = [run.compute_s(w, sizes[w], now) for w in range(n)]
        ends = [c + costs.iteration_s for c in computes]
        seconds = max(ends) + costs.allreduce_s + (costs.exchange_s if tuned else 0.0)
        index = [run.batch(w, sizes[w]) for w in range(n)]
        gradient = run.gradient(torch.cat(index))
        end = now + seconds
        run.apply(end, run.lr(total) * gradient, total)
        for w in range(n):
            run.result.iterations[w] += 1
        run.result.log.append(
            {"start": now, "seconds": seconds, "sizes": list(sizes), "compute_s": computes}
        )
        reports = [
            WorkerReport(str(w), sizes[w], 1, computes[w], cpu=run.cpu(w, now), mem=0.3)
            for w in range(n)
        ]
        decided = manager.step(reports)
        chosen = [decided[str(w)] for w in range(n)]
        if policy.asynchronous:  # sizes apply one iteration late
            sizes, pending = (pending or sizes), chosen
        else:
            sizes = chosen
        now = end
        run.observe(now)
    run.result.sizes = sizes
