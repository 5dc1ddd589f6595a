"""Time models of emulated workers: how long B samples take on a worker of a given kind.

Used by the `model` clock (virtual time, nothing slept, deterministic) and by `fedlb tune`.
- `LinearTime`: a CPU worker, t = o + τ·B/v (LB-BSP Section 3.2.1: linear in B).
- `GpuLikeTime`: a GPU worker (Section 3.3.1): a launch cost per iteration, a saturation
  size below which a batch costs as much as a full one, and a memory ceiling.
- `CurveTime`: a worker on a measured step-time curve (fedlb.balance's StepCurve).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from fedlb.balance import StepCurve


class TimeModel(Protocol):
    @property
    def overhead(self) -> float:
        """Fixed seconds per round (encryption, upload): o_i."""
        ...

    def compute_s(self, batch: int, iterations: int = 1) -> float:
        """Seconds of pure compute for `iterations` iterations of `batch` samples."""
        ...

    def memory(self, batch: int) -> float | None:
        """Accelerator memory fraction used at `batch` samples, or None (no accelerator)."""
        ...


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")


@dataclass(frozen=True)
class LinearTime:
    """t_compute = τ·B/speed; fixed cost `overhead` per round."""

    speed: float
    overhead: float = 0.0

    def __post_init__(self) -> None:
        _positive("speed", self.speed)
        if not (math.isfinite(self.overhead) and self.overhead >= 0):
            raise ValueError(f"overhead must be finite and >= 0, got {self.overhead!r}")

    def compute_s(self, batch: int, iterations: int = 1) -> float:
        return iterations * batch / self.speed

    def memory(self, batch: int) -> float | None:
        return None


@dataclass(frozen=True)
class GpuLikeTime:
    """Per iteration: launch + max(B, saturation)/speed; memory = B/capacity of the card.

    Args:
        speed: samples/s once saturated.
        launch: seconds per iteration whatever the batch (kernel launches, copies).
        saturation: batches below this size take as long as this size.
        capacity: the batch size that fills the accelerator's memory (None: unlimited).
        overhead: fixed seconds per round.
    """

    speed: float
    launch: float = 0.0
    saturation: int = 0
    capacity: int | None = None
    overhead: float = 0.0

    def __post_init__(self) -> None:
        _positive("speed", self.speed)
        if self.launch < 0 or self.saturation < 0 or self.overhead < 0:
            raise ValueError("launch, saturation and overhead must be >= 0")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {self.capacity}")

    def compute_s(self, batch: int, iterations: int = 1) -> float:
        return iterations * (self.launch + max(batch, self.saturation) / self.speed)

    def memory(self, batch: int) -> float | None:
        return None if self.capacity is None else min(1.0, batch / self.capacity)


@dataclass(frozen=True)
class CurveTime:
    """τ steps on a measured step-time curve: t_compute = τ·curve(B); fixed cost
    `overhead` per round; its memory is not modelled."""

    curve: StepCurve
    overhead: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.overhead) and self.overhead >= 0):
            raise ValueError(f"overhead must be finite and >= 0, got {self.overhead!r}")

    def compute_s(self, batch: int, iterations: int = 1) -> float:
        return iterations * self.curve.seconds(batch)

    def memory(self, batch: int) -> float | None:
        return None


def round_time(model: TimeModel, batch: int, iterations: int = 1) -> float:
    """The worker's busy seconds in a round: fixed cost plus compute."""
    return model.overhead + model.compute_s(batch, iterations)


def ideal_split(
    models: Mapping[str, TimeModel], total: int, iterations: int = 1, min_batch: int = 1
) -> tuple[dict[str, int], float]:
    """T* for any non-decreasing time models: the min-max integer split and its time.

    Greedy (each unit to whoever would finish earliest with it), exact for non-decreasing
    times; O(X log n). Workers are held below their memory capacity where they have one.
    """
    names = list(models)
    if total < min_batch * len(names):
        raise ValueError(f"total {total} < {len(names)} workers x min_batch {min_batch}")
    sizes = dict.fromkeys(names, min_batch)

    def cap(name: str) -> float:
        capacity = getattr(models[name], "capacity", None)
        return math.inf if capacity is None else capacity

    heap = [(round_time(models[n], min_batch + 1, iterations), i, n) for i, n in enumerate(names)]
    heapq.heapify(heap)
    for _ in range(total - min_batch * len(names)):
        if not heap:
            raise ValueError(f"total {total} does not fit in the workers' memory capacities")
        _, i, name = heapq.heappop(heap)
        sizes[name] += 1
        if sizes[name] + 1 <= cap(name):
            heapq.heappush(heap, (round_time(models[name], sizes[name] + 1, iterations), i, name))
    return sizes, max(round_time(models[n], sizes[n], iterations) for n in names)
