"""Tuners: from what the manager knows, the next integer batch sizes, with Σ B_i preserved.

- `Proportional`: LB-BSP Algorithm 1 made overhead-aware (CPU clusters, federated silos).
- `LeaderStraggler`: LB-BSP Algorithm 2 on measured times (GPU clusters, non-linear t(B)).
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
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .estimators import Evidence
from .reports import WorkerReport
from .split import round_to_total, water_fill

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


class LeaderStraggler(Tuner):
    """LB-BSP Algorithm 2: move `step` samples from the straggler to the leader.

    After each iteration the leader (shortest time among workers under `mem_limit`
    accelerator memory) and the straggler (longest time) are found. Once the leader has
    finished before the straggler in each of the last `window` iterations at their current
    sizes, `step` samples move from straggler to leader. The fast-approach phase (step 5,
    window 5) switches to the fine-tune phase (step 1, window 20) on oscillation: a former
    leader now the straggler or the reverse, or a move that would overshoot. A straggler
    at ≤ step samples is not reduced further; it is logged as a worker to remove.

    The one addition to the paper: a move is made only while the leader, grown by `step`
    at its current time per sample, would still finish before the straggler does now. At
    step 1 that is the equilibrium, so the tuner stops moving instead of swapping one
    sample back and forth forever.

    Args:
        step, window: the fast-approach phase's step size Δ and observation window D.
            Defaults 5 and 5.
        fine_step, fine_window: the fine-tune phase's. Defaults 1 and 20.
        mem_limit: accelerator memory fraction above which a worker cannot lead. Default 0.95.
    """

    kind = "leader-straggler"

    def __init__(
        self,
        step: int = 5,
        window: int = 5,
        fine_step: int = 1,
        fine_window: int = 20,
        mem_limit: float = 0.95,
    ) -> None:
        super().__init__()
        for name, value in (
            ("step", step),
            ("window", window),
            ("fine_step", fine_step),
            ("fine_window", fine_window),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0.0 < mem_limit <= 1.0:
            raise ValueError(f"mem_limit must be in (0, 1], got {mem_limit}")
        self.fast = (step, window)
        self.fine = (fine_step, fine_window)
        self.mem_limit = mem_limit
        self.phase = "fast"
        self.moves = 0
        self._times: dict[str, deque[float]] = {}
        self._memory: dict[str, float | None] = {}
        self._gained: set[str] = set()  # workers that have been leaders of a move
        self._lost: set[str] = set()  # workers that have been stragglers of a move

    @property
    def step(self) -> int:
        return (self.fine if self.phase == "fine" else self.fast)[0]

    @property
    def window(self) -> int:
        return (self.fine if self.phase == "fine" else self.fast)[1]

    def _enter_fine(self, why: str) -> None:
        if self.phase == "fast":
            log.info("leader/straggler tuner: %s; switching to the fine-tune phase", why)
            self.phase = "fine"

    def propose(self, given: TuningInput) -> dict[str, int]:
        sizes = dict(given.sizes)
        history = max(self.fast[1], self.fine[1])
        current: dict[str, float] = {}
        for name, report in given.reports.items():
            self._memory[name] = report.accel_mem
            if report.batch_size != sizes[name]:
                continue  # measured before its newest size applied (non-blocking mode)
            self._times.setdefault(name, deque(maxlen=history)).append(report.round_s)
            current[name] = report.round_s
        if len(current) < 2:
            return sizes
        eligible = [
            n
            for n in current
            if self._memory.get(n) is None or self._memory[n] <= self.mem_limit  # type: ignore[operator]
        ]
        if not eligible:
            return sizes
        leader = min(eligible, key=lambda n: current[n])
        straggler = max(current, key=lambda n: current[n])
        if leader == straggler or current[leader] >= current[straggler]:
            return sizes
        if straggler in self._gained or leader in self._lost:
            self._enter_fine(f"oscillation ({straggler} led before or {leader} straggled)")
        step, window = self.step, self.window
        if sizes[straggler] <= step:
            self._flag(
                straggler, f"is the straggler at batch size {sizes[straggler]} <= step {step}"
            )
            return sizes
        lead_t, strag_t = (
            list(self._times[leader])[-window:],
            list(self._times[straggler])[-window:],
        )
        if len(lead_t) < window or len(strag_t) < window:
            return sizes
        if not all(a < b for a, b in zip(lead_t, strag_t, strict=True)):
            return sizes
        leader_after = float(np.mean(lead_t)) * (sizes[leader] + step) / sizes[leader]
        if leader_after >= float(np.mean(strag_t)):
            if self.phase == "fast":
                self._enter_fine(f"moving {step} samples to {leader} would overshoot")
            return sizes  # in the fine phase: balanced to within one sample
        sizes[leader] += step
        sizes[straggler] -= step
        self._gained.add(leader)
        self._lost.add(straggler)
        self.removal_candidates.discard(straggler)
        self.moves += 1
        # Times measured at the old sizes say nothing about the new ones.
        self._times[leader].clear()
        self._times[straggler].clear()
        return sizes

    def forget(self, worker: str) -> None:
        super().forget(worker)
        self._times.pop(worker, None)
        self._memory.pop(worker, None)
        self._gained.discard(worker)
        self._lost.discard(worker)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "phase": self.phase,
            "moves": self.moves,
            "times": {n: list(t) for n, t in self._times.items()},
            "memory": dict(self._memory),
            "gained": sorted(self._gained),
            "lost": sorted(self._lost),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        history = max(self.fast[1], self.fine[1])
        self.phase = state["phase"]
        self.moves = int(state["moves"])
        self._times = {n: deque(t, maxlen=history) for n, t in state["times"].items()}
        self._memory = dict(state["memory"])
        self._gained = set(state["gained"])
        self._lost = set(state["lost"])


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
