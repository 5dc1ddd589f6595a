"""Tuners: from what the manager knows, the next integer batch sizes, with Σ B_i preserved.

- `Proportional`: LB-BSP Algorithm 1 made overhead-aware (CPU clusters, federated silos).
- `LeaderStraggler` (in `leader`): LB-BSP Algorithm 2 on measured times (GPU clusters,
  non-linear t(B)).
- `Deadband`: the dynamic-batching proportional controller (Tyagi & Sharma, Section III.C).
- `PooledProportional` (the default, in `pooled`): `Proportional` on estimates pooled
  across workers whose speeds (and fixed costs) the reports cannot tell apart, with an
  optional floor.

A tuner sees only the workers that reported this step; the manager keeps the others' sizes.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from .estimators import Evidence
from .reports import WorkerReport
from .split import round_to_total, water_fill

V = TypeVar("V")

log = logging.getLogger("fedlb.balance")


@dataclass(frozen=True)
class TuningInput:
    """What a tuner gets at one step, for the workers being tuned (all keyed alike).

    sizes: their current batch sizes; the proposal must keep Σ sizes.
    speeds: predicted samples/s of pure compute for the next iteration (the estimators').
    overheads: smoothed fixed seconds per round (o_i).
    iterations: local iterations per round (τ_i; 1 in cluster mode).
    reports: this step's validated reports.
    evidence: what the estimates rest on, for the workers whose estimator keeps it
        (`SpeedEstimator.evidence()`); empty by default.
    """

    sizes: Mapping[str, int]
    speeds: Mapping[str, float]
    overheads: Mapping[str, float]
    iterations: Mapping[str, int]
    reports: Mapping[str, WorkerReport]
    evidence: Mapping[str, Evidence] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return list(self.sizes)

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def renamed(values: Mapping[str, V], names: Mapping[str, str]) -> dict[str, V]:
    """`values` keyed by worker, its keys renamed by `names` (old -> new; others kept)."""
    return {names.get(w, w): v for w, v in values.items()}


class Tuner(ABC):
    """Proposes the next sizes. Subclasses keep all their state JSON-serialisable."""

    kind: str = "tuner"

    def __init__(self) -> None:
        # Workers the tuner found too slow to keep: Algorithm 2's "remove this straggler".
        self.removal_candidates: set[str] = set()

    @abstractmethod
    def propose(self, given: TuningInput) -> dict[str, int]:
        """The next sizes for `given.sizes`' workers, summing to `given.total`."""

    def bounds(self, worker: str) -> tuple[int, float]:
        """(lowest, highest) size this tuner allows the worker."""
        return 1, math.inf

    def set_population(self, total: int, workers: int, strict: bool = True) -> None:
        """Told by the manager whenever X or the number of workers is set or changes.

        Bounds that depend on them (`PooledProportional(min_share=...)`) raise ValueError
        here when X cannot be placed; with `strict=False` (a worker left: the run must go
        on) they loosen instead, with a warning. Default: nothing.
        """
        return None

    def forget(self, worker: str) -> None:
        """Drop what the tuner remembers of a worker that left."""
        self.removal_candidates.discard(worker)

    def rename_workers(self, names: Mapping[str, str]) -> None:
        """Go on under new names (`names`: old -> new) for the same machines: what it
        remembers of each follows its worker (a server restarted, its silos rejoined)."""
        self.removal_candidates = {names.get(w, w) for w in self.removal_candidates}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "removal_candidates": sorted(self.removal_candidates)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"state is for a {state.get('kind')!r} tuner, not {self.kind!r}")
        self.removal_candidates = set(state["removal_candidates"])

    def _flag(self, worker: str, why: str) -> None:
        if worker not in self.removal_candidates:
            log.warning("worker %s %s: it should be removed from the job", worker, why)
            self.removal_candidates.add(worker)


class Static(Tuner):
    """Sizes never change: plain FedAvg / BSP, the baseline every policy is measured against."""

    kind = "static"

    def propose(self, given: TuningInput) -> dict[str, int]:
        return dict(given.sizes)


def _check_bounds(min_batch: int, max_batch: int | None) -> None:
    if isinstance(min_batch, bool) or not isinstance(min_batch, int) or min_batch < 1:
        raise ValueError(f"min_batch must be an integer >= 1, got {min_batch!r}")
    if max_batch is not None and (not isinstance(max_batch, int) or max_batch < min_batch):
        raise ValueError(f"max_batch must be None or an integer >= min_batch, got {max_batch!r}")


class Proportional(Tuner):
    """LB-BSP Algorithm 1, overhead-aware: sizes that equalise o_i + τ_i·B_i / v_i.

    Without fixed costs this is B_i = v_i / Σv · X in one step. With them, the level T is
    chosen so that Σ B_i = X and every worker not held at a bound finishes at T. Real sizes
    are rounded by largest remainder so the total stays exactly X.

    Args:
        min_batch: smallest size any worker gets. Default 1. A worker held there while the
            balance wants less is reported as a removal candidate.
        max_batch: largest size any worker gets (memory). Default None (no limit).
    """

    kind = "proportional"

    def __init__(self, min_batch: int = 1, max_batch: int | None = None) -> None:
        super().__init__()
        _check_bounds(min_batch, max_batch)
        self.min_batch = min_batch
        self.max_batch = max_batch

    def bounds(self, worker: str) -> tuple[int, float]:
        return self.min_batch, math.inf if self.max_batch is None else self.max_batch

    def propose(self, given: TuningInput) -> dict[str, int]:
        return self._split(given, given.speeds, given.overheads)

    def _split(
        self, given: TuningInput, speeds: Mapping[str, float], overheads: Mapping[str, float]
    ) -> dict[str, int]:
        names = given.names
        rates = [speeds[n] / given.iterations[n] for n in names]
        offsets = [overheads[n] for n in names]
        lo, hi = zip(*(self.bounds(n) for n in names), strict=True)
        level, real = water_fill(rates, offsets, given.total, lo, hi)
        for name, rate, offset in zip(names, rates, offsets, strict=True):
            if (level - offset) * rate < self.min_batch - 1e-9:
                self._flag(
                    name,
                    f"would need fewer than min_batch={self.min_batch} samples to keep up "
                    f"(its fixed cost {offset:.3g} s or its speed holds every round back)",
                )
            else:
                self.removal_candidates.discard(name)
        return dict(zip(names, round_to_total(real, given.total, list(lo), list(hi)), strict=True))


class Deadband(Tuner):
    """Proportional control with a dead-band (dynamic batching, Tyagi & Sharma III.C).

    Each step: smooth every worker's round time since the last change (EWMA), propose
    B_i ← B_i · t̄ / t_i (rescaled so Σ B_i = X), clamp to [min_batch, b_max_i], and apply
    the proposal only if some worker's size would change by more than `threshold`
    (relative). b_max_i starts at `max_batch` and drops to the previous size when the
    worker's throughput fell after it was given a larger batch.

    Args:
        threshold: the dead-band, relative size change. Default 0.05 (the paper's).
        min_batch: smallest size. Default 1.
        max_batch: initial upper bound for every worker. Default None (no limit).
        alpha: EWMA weight of the newest round time. Default 0.5.
        drop_tolerance: relative throughput drop that counts as a fall. Default 0.1:
            measured times jitter by a few percent, and a cap set on noise would freeze a
            worker below its share for good.
        drop_evidence: measurements needed at both sizes before a fall is believed.
            Default 2.
    """

    kind = "deadband"

    def __init__(
        self,
        threshold: float = 0.05,
        min_batch: int = 1,
        max_batch: int | None = None,
        alpha: float = 0.5,
        drop_tolerance: float = 0.1,
        drop_evidence: int = 2,
    ) -> None:
        super().__init__()
        _check_bounds(min_batch, max_batch)
        if not threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.threshold = threshold
        self.min_batch = min_batch
        self.max_batch = max_batch
        self.alpha = alpha
        self.drop_tolerance = drop_tolerance
        self.drop_evidence = drop_evidence
        self.changes = 0
        self._smoothed: dict[str, float] = {}  # round time at the current size
        # size -> [mean samples/s measured there, how many measurements]
        self._throughput: dict[str, dict[int, list[float]]] = {}
        self._previous: dict[str, int] = {}  # size before the last change
        self._ceiling: dict[str, int] = {}  # b_max lowered by observed throughput drops

    def bounds(self, worker: str) -> tuple[int, float]:
        ceiling = self._ceiling.get(worker, self.max_batch)
        return self.min_batch, math.inf if ceiling is None else ceiling

    def _observe(self, name: str, report: WorkerReport) -> None:
        a = self.alpha
        t = report.round_s
        self._smoothed[name] = (
            t if name not in self._smoothed else a * t + (1 - a) * self._smoothed[name]
        )
        mean_count = self._throughput.setdefault(name, {}).setdefault(report.batch_size, [0.0, 0.0])
        mean_count[1] += 1
        mean_count[0] += (report.speed - mean_count[0]) / mean_count[1]

    def _lower_ceilings(self, sizes: Mapping[str, int], total: int) -> None:
        for name, size in sizes.items():
            before = self._previous.get(name)
            seen = self._throughput.get(name, {})
            if before is None or size <= before:
                continue
            (now, n_now), (then, n_then) = seen.get(size, [0.0, 0.0]), seen.get(before, [0.0, 0.0])
            if min(n_now, n_then) < self.drop_evidence:
                continue
            if now < then * (1 - self.drop_tolerance):
                ceiling = before
                others = sum(self.bounds(n)[1] for n in sizes if n != name)
                if ceiling + others < total:
                    continue  # lowering it would leave no way to place X
                if self._ceiling.get(name) != ceiling:
                    log.info(
                        "worker %s: throughput fell from %.1f to %.1f samples/s going from "
                        "batch %d to %d; its batch size is capped at %d",
                        name,
                        then,
                        now,
                        before,
                        size,
                        ceiling,
                    )
                self._ceiling[name] = ceiling

    def propose(self, given: TuningInput) -> dict[str, int]:
        sizes = dict(given.sizes)
        for name, report in given.reports.items():
            if report.batch_size == sizes[name]:
                self._observe(name, report)
        names = [n for n in sizes if n in self._smoothed]
        if len(names) < 2:
            return sizes
        sub = {n: sizes[n] for n in names}
        total = sum(sub.values())
        self._lower_ceilings(sub, total)
        mean_t = float(np.mean([self._smoothed[n] for n in names]))
        targets = [sub[n] * mean_t / self._smoothed[n] for n in names]
        lo, hi = zip(*(self.bounds(n) for n in names), strict=True)
        _, real = water_fill(targets, [0.0] * len(names), total, lo, hi)
        proposal = dict(zip(names, round_to_total(real, total, list(lo), list(hi)), strict=True))
        change = max(abs(proposal[n] - sub[n]) / sub[n] for n in names)
        if change <= self.threshold and all(sub[n] <= self.bounds(n)[1] for n in names):
            return sizes
        for n in names:
            if proposal[n] != sub[n]:
                self._previous[n] = sub[n]
            self._smoothed.pop(n)  # the smoothing restarts at every change
        self.changes += 1
        sizes.update(proposal)
        return sizes

    def forget(self, worker: str) -> None:
        super().forget(worker)
        for table in (self._smoothed, self._throughput, self._previous, self._ceiling):
            table.pop(worker, None)

    def rename_workers(self, names: Mapping[str, str]) -> None:
        super().rename_workers(names)
        self._smoothed = renamed(self._smoothed, names)
        self._throughput = renamed(self._throughput, names)
        self._previous = renamed(self._previous, names)
        self._ceiling = renamed(self._ceiling, names)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "changes": self.changes,
            "smoothed": dict(self._smoothed),
            "throughput": {
                n: {str(b): list(v) for b, v in t.items()} for n, t in self._throughput.items()
            },
            "previous": dict(self._previous),
            "ceiling": dict(self._ceiling),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.changes = int(state["changes"])
        self._smoothed = {n: float(v) for n, v in state["smoothed"].items()}
        self._throughput = {
            n: {int(b): [float(v[0]), float(v[1])] for b, v in t.items()}
            for n, t in state["throughput"].items()
        }
        self._previous = {n: int(v) for n, v in state["previous"].items()}
        self._ceiling = {n: int(v) for n, v in state["ceiling"].items()}
