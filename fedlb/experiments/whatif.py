"""Round-by-round what-if of a tuner on modelled workers (the `model` clock): `fedlb tune`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from fedlb.balance import EMA, BatchSizeManager, SpeedEstimator, Tuner, WorkerReport

from .clocks import TimeModel, ideal_split

CLOCK = "model"


@dataclass(frozen=True)
class WhatIfRound:
    """One modelled round: the sizes used and what they cost."""

    round: int
    sizes: dict[str, int]
    busy_s: dict[str, float]  # each worker's fixed cost + compute this round
    round_s: float  # the slowest worker's busy time: everyone waits for it
    ideal_s: float  # T*: the best split's round time
    efficiency: float  # E = T*/round_s
    idle_fraction: float  # share of worker-seconds spent waiting


def what_if(
    models: Mapping[str, TimeModel],
    tuner: Tuner,
    initial: Mapping[str, int],
    *,
    iterations: int = 1,
    rounds: int = 10,
    estimator: Callable[[], SpeedEstimator] = EMA,
    noise: float = 0.0,
    seed: int = 0,
) -> list[WhatIfRound]:
    """Run `rounds` rounds of `tuner` on workers whose times follow `models`.

    Args:
        models: each worker's time model.
        tuner: the tuner under test (a fresh one: it keeps state).
        initial: starting sizes; their sum X is kept.
        iterations: τ, iterations per round (1 for a cluster iteration). Default 1.
        rounds: how many rounds. Default 10.
        estimator: speed estimator factory. Default EMA.
        noise: relative Gaussian jitter on every measured compute time. Default 0.
        seed: RNG seed of the jitter. Default 0.
    """
    if rounds < 1 or iterations < 1:
        raise ValueError("rounds and iterations must be >= 1")
    if set(models) != set(initial):
        raise ValueError("models and initial must name the same workers")
    rng = np.random.default_rng(seed)
    manager = BatchSizeManager(initial, tuner, estimator)
    _, ideal = ideal_split(models, manager.total, iterations)
    history: list[WhatIfRound] = []
    for number in range(1, rounds + 1):
        sizes = manager.sizes
        reports: list[WorkerReport] = []
        busy: dict[str, float] = {}
        for name, size in sizes.items():
            model = models[name]
            jitter = max(0.05, 1.0 + noise * float(rng.standard_normal())) if noise else 1.0
            compute = model.compute_s(size, iterations) * jitter
            busy[name] = model.overhead + compute
            reports.append(
                WorkerReport(
                    name, size, iterations, compute, model.overhead, accel_mem=model.memory(size)
                )
            )
        slowest = max(busy.values())
        history.append(
            WhatIfRound(
                round=number,
                sizes=sizes,
                busy_s=busy,
                round_s=slowest,
                ideal_s=ideal,
                efficiency=ideal / slowest,
                idle_fraction=1.0 - sum(busy.values()) / (len(busy) * slowest),
            )
        )
        manager.step(reports)
    return history
