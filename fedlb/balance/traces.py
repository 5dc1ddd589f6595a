"""Generated speed traces for judging estimators, seeded and reproducible.

`competing_load_trace` follows the set-up of LB-BSP Section 5.4.2: a competing process on
the worker runs or sleeps with some probability, taking CPU and memory while it runs, so
the worker's speed moves with resources it can measure; on top come transient spikes
(a garbage collection, a page-cache flush) that no resource reading shows. An estimator
that reads CPU and memory (NARX) can follow the first and ignore the second; one that
sees only past speeds (EMA, memoryless) cannot tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .estimators import SpeedEstimator
from .reports import WorkerReport


@dataclass(frozen=True)
class Trace:
    """Per-iteration speeds (samples/s) and the CPU/memory use that drove each one."""

    speed: np.ndarray
    cpu: np.ndarray
    mem: np.ndarray

    def __len__(self) -> int:
        return len(self.speed)

    def reports(self, worker: str = "w0", batch_size: int = 64) -> list[WorkerReport]:
        """The reports a worker would send: report k carries the speed of iteration k and
        the resources measured after it, which drive iteration k+1."""
        out = []
        for k in range(len(self) - 1):
            out.append(
                WorkerReport(
                    worker=worker,
                    batch_size=batch_size,
                    iterations=1,
                    compute_s=batch_size / float(self.speed[k]),
                    cpu=float(self.cpu[k + 1]),
                    mem=float(self.mem[k + 1]),
                )
            )
        return out


def competing_load_trace(
    steps: int,
    seed: int = 0,
    base_speed: float = 100.0,
    switch_prob: float = 0.08,
    noise: float = 0.03,
    spike_prob: float = 0.05,
    spike_size: float = 0.35,
) -> Trace:
    """A worker sharing its machine with an on/off competing process.

    Args:
        steps: iterations to generate.
        seed: RNG seed.
        base_speed: samples/s with the machine to itself.
        switch_prob: chance per iteration that the competitor starts or stops.
        noise: relative Gaussian jitter of every iteration's speed.
        spike_prob: chance per iteration of a transient slowdown no resource shows.
        spike_size: how much such a spike slows that one iteration (fraction).
    """
    rng = np.random.default_rng(seed)
    running = False
    cpu_share = mem_share = 0.0
    speed = np.empty(steps)
    cpu = np.empty(steps)
    mem = np.empty(steps)
    for k in range(steps):
        if rng.random() < switch_prob:
            running = not running
            if running:  # every episode of the competitor has its own appetite
                cpu_share = rng.uniform(0.2, 0.75)
                mem_share = rng.uniform(0.1, 0.5)
        load_cpu = cpu_share if running else 0.0
        load_mem = mem_share if running else 0.0
        cpu[k] = np.clip(0.2 + load_cpu + rng.normal(0, 0.02), 0, 1)
        mem[k] = np.clip(0.3 + load_mem + rng.normal(0, 0.01), 0, 1)
        swap_penalty = max(0.0, mem[k] - 0.7) * 1.5  # memory pressure beyond 70% hurts more
        factor = (1.0 - 0.8 * load_cpu) * (1.0 - swap_penalty)
        if rng.random() < spike_prob:
            factor *= 1.0 - spike_size
        speed[k] = base_speed * max(factor, 0.05) * (1.0 + rng.normal(0, noise))
    return Trace(speed=speed, cpu=cpu, mem=mem)


def prediction_rmse(estimator: SpeedEstimator, trace: Trace, skip: int = 0) -> float:
    """RMSE of one-step-ahead predictions over the trace, after `skip` warm-up reports."""
    errors = []
    for k, report in enumerate(trace.reports()):
        estimator.update(report)
        if k >= skip:
            errors.append(estimator.predict() - float(trace.speed[k + 1]))
    return float(np.sqrt(np.mean(np.square(errors))))
