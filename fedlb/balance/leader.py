"""`LeaderStraggler`: LB-BSP Algorithm 2 for accelerators, where t(B) is not linear.

On a GPU a batch costs a launch overhead whatever its size, batches below a saturation size
cost as much as a full one, and memory caps the size. Algorithm 2 therefore tunes by
measurement: every iteration it moves Δ samples from the straggler (slowest) to the leader
(fastest with memory to spare) once the leader has beaten the straggler over a window of D
iterations; Δ = 5, D = 5 at first, Δ = 1, D = 20 after an oscillation.

Moved blindly, Δ-sized steps starve a worker whose time is mostly launch cost (each step
away from it saves almost nothing) and overshoot near the balance. So each move here is
*predicted* first from the times measured so far: every worker keeps a curve of mean time
per batch size it has run, and a move is made only when the pair's slower time after it,
read off those curves, would be shorter than the straggler's now (timing noise is held off
by the window rule, as in the paper). Where a size was never run the curve is extended by
a least-squares slope through the nearest measured sizes, or proportionally (t ∝ B,
Algorithm 1's assumption) from one. A move that turns out useless (the straggler measured
no slower at a larger size, beyond the noise: it is saturated) is given back, so no worker
is left below the share the ideal split gives it.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .tuners import Tuner, TuningInput, renamed

log = logging.getLogger("fedlb.balance")

SIGNIFICANCE = 2.0  # standard errors by which a larger size must be no slower to give back
EXTRAPOLATE_FROM = 4  # measured sizes a curve is extended from


@dataclass
class _SizeTime:
    """Mean and spread of the times measured at one batch size (Welford, count capped so
    that old measurements fade: the curve follows a worker whose speed drifts)."""

    mean: float = 0.0
    m2: float = 0.0
    count: int = 0

    def add(self, value: float, cap: int) -> None:
        self.count = min(self.count + 1, cap)
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 = max(0.0, self.m2 * (1 - 1 / cap) + delta * (value - self.mean))

    def stderr(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1) / self.count) if self.count > 1 else 0.0


@dataclass
class _Worker:
    """What the tuner has measured of one worker."""

    curve: dict[int, _SizeTime] = field(default_factory=dict)
    size: int = 0  # the size its `fresh` times were measured at
    fresh: deque[float] = field(default_factory=deque)  # times at `size` since it was set
    memory: tuple[int, float] | None = None  # (batch size, accelerator memory fraction)

    def time(self, size: int) -> float:
        """Predicted busy seconds at `size`, from the measured curve (see module doc)."""
        points = self.curve
        if size in points:
            return points[size].mean
        below = sorted(b for b in points if b < size)[-2:]
        above = sorted(b for b in points if b > size)[:2]
        if below and above:  # interpolate between the neighbours
            b0, b1 = below[-1], above[0]
            t0, t1 = points[b0].mean, points[b1].mean
            return t0 + (t1 - t0) * (size - b0) / (b1 - b0)
        # Outside what was measured: a line through the nearest measured sizes on that side
        # (least squares, each size weighted by its count), from the nearest one, its slope
        # kept between flat and t ∝ B. One measured size: t ∝ B (Algorithm 1's assumption).
        side = (
            sorted((b for b in points if b < size), reverse=True)
            if not above
            else sorted(b for b in points if b > size)
        )
        near = side[:EXTRAPOLATE_FROM]
        anchor = near[0]
        t = points[anchor].mean
        if len(near) == 1:
            return t * size / anchor
        b = np.array(near, dtype=float)
        y = np.array([points[k].mean for k in near])
        w = np.array([points[k].count for k in near], dtype=float)
        mean_b, mean_y = np.average(b, weights=w), np.average(y, weights=w)
        slope = float(np.sum(w * (b - mean_b) * (y - mean_y)) / np.sum(w * (b - mean_b) ** 2))
        slope = min(max(slope, 0.0), t / anchor)
        return max(0.0, t + slope * (size - anchor))

    def spread(self, size: int) -> float:
        """Standard error of the time at `size` (0 where unmeasured or measured once)."""
        point = self.curve.get(size)
        return 0.0 if point is None else point.stderr()

    def memory_at(self, size: int) -> float | None:
        """Accelerator memory fraction predicted at `size` (∝ B from the last reading: an
        overestimate, the model's own weights do not grow with B)."""
        if self.memory is None:
            return None
        measured_at, fraction = self.memory
        return fraction * size / measured_at


class LeaderStraggler(Tuner):
    """LB-BSP Algorithm 2 with measured-curve predictions (see the module docstring).

    Each step: the leader (shortest mean time at its current size among workers whose
    accelerator memory would stay ≤ `mem_limit` after growing) and the straggler (longest)
    are found. Once both have `window` measurements at their current sizes and the leader
    finished first in each of the last `window`, `step` samples move from straggler to
    leader if the curves predict the pair's slower time drops by more than the noise. The
    fast phase (step 5, window 5) switches to the fine phase (step 1, window 20) on
    oscillation (a past leader now the straggler, or the reverse) or when no fast move
    would help any more. A straggler that cannot give `step` samples while a move would
    still help is logged as a worker to remove. A straggler measured no faster after a
    move (saturated) gets the samples back from the slowest other worker.

    Args:
        step: the fast phase's step size Δ. Default 5.
        window: the fast phase's observation window D. Default 5.
        fine_step: the fine phase's step size. Default 1.
        fine_window: the fine phase's observation window. Default 20.
        mem_limit: accelerator memory fraction a leader may not pass. Default 0.95.
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
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0.0 < mem_limit <= 1.0:
            raise ValueError(f"mem_limit must be in (0, 1], got {mem_limit}")
        self.fast = (step, window)
        self.fine = (fine_step, fine_window)
        self.mem_limit = mem_limit
        self.phase = "fast"
        self.moves = 0
        self._workers: dict[str, _Worker] = {}
        self._gained: set[str] = set()  # workers that have been leaders of a move
        self._lost: set[str] = set()  # workers that have been stragglers of a move

    @property
    def step(self) -> int:
        return (self.fine if self.phase == "fine" else self.fast)[0]

    @property
    def window(self) -> int:
        return (self.fine if self.phase == "fine" else self.fast)[1]

    @property
    def _history(self) -> int:
        return 2 * max(self.fast[1], self.fine[1])

    def _enter_fine(self, why: str) -> None:
        if self.phase == "fast":
            log.info("leader/straggler tuner: %s; switching to the fine-tune phase", why)
            self.phase = "fine"

    def _observe(self, given: TuningInput) -> None:
        for name, report in given.reports.items():
            worker = self._workers.setdefault(name, _Worker())
            # Every report adds to the curve at the size it was measured at, also one that
            # arrives an iteration late (non-blocking mode) at the size before.
            worker.curve.setdefault(report.batch_size, _SizeTime()).add(
                report.round_s, self._history
            )
            if report.accel_mem is not None:
                worker.memory = (report.batch_size, report.accel_mem)
            if worker.size != given.sizes[name]:
                worker.size = given.sizes[name]
                worker.fresh = deque(maxlen=self._history)
            if report.batch_size == worker.size:
                worker.fresh.append(report.round_s)

    def _margin(self, *points: tuple[str, int]) -> float:
        """How much a predicted gain must exceed: the noise of the times it rests on."""
        spread = math.sqrt(sum(self._workers[n].spread(b) ** 2 for n, b in points))
        return SIGNIFICANCE * spread

    def propose(self, given: TuningInput) -> dict[str, int]:
        self._observe(given)
        sizes = dict(given.sizes)
        current = {
            n: w.curve[sizes[n]].mean
            for n in given.reports
            if (w := self._workers[n]).fresh and sizes[n] in w.curve
        }
        if len(current) < 2:
            return sizes
        straggler = max(current, key=lambda n: current[n])
        now = current[straggler]
        # The leader: the worker that would still be fastest after taking one more sample,
        # with memory to spare (a launch-bound worker can be fastest and gain nothing).
        eligible = [n for n in current if n != straggler and self._fits(n, sizes[n] + 1)]
        if not eligible:
            return sizes
        leader = min(eligible, key=lambda n: self._workers[n].time(sizes[n] + 1))
        if current[leader] >= now:
            return sizes
        if straggler in self._gained or leader in self._lost:
            self._enter_fine(f"oscillation ({straggler} led before or {leader} straggled)")
        step, window = self.step, self.window
        lead, strag = self._workers[leader], self._workers[straggler]
        if len(lead.fresh) < window or len(strag.fresh) < window:
            return sizes
        recent = zip(list(lead.fresh)[-window:], list(strag.fresh)[-window:], strict=True)
        if not all(a < b for a, b in recent):
            return sizes
        if self._give_back(sizes, straggler, current):
            return sizes
        amount = self._best_move(sizes, leader, straggler, step, now)
        if amount is None:
            self._enter_fine(f"moving samples to {leader} would not shorten the round")
            return sizes
        if sizes[straggler] - amount < 1 or sizes[straggler] <= step:
            self._flag(
                straggler, f"is the straggler at batch size {sizes[straggler]} <= step {step}"
            )
            if sizes[straggler] - amount < 1:
                return sizes
        self._move(sizes, straggler, leader, amount)
        return sizes

    def _best_move(
        self, sizes: dict[str, int], leader: str, straggler: str, step: int, now: float
    ) -> int | None:
        """The number of samples (≤ step) whose move shortens the pair's slower time most
        by the curves; None when no move does. Noise is guarded by the window rule (the
        leader beat the straggler D times in a row), as in the paper. The amount may leave
        the straggler with nothing: the caller flags that worker instead of moving."""
        lead, strag = self._workers[leader], self._workers[straggler]
        best, best_after = None, now * (1 - 1e-9)
        for amount in range(1, step + 1):
            if not self._fits(leader, sizes[leader] + amount):
                break
            after = max(lead.time(sizes[leader] + amount), strag.time(sizes[straggler] - amount))
            if after < best_after:
                best, best_after = amount, after
            if sizes[straggler] - amount < 1:
                break
        return best

    def _fits(self, worker: str, size: int) -> bool:
        """Would the worker's accelerator memory stay within `mem_limit` at `size`?"""
        memory = self._workers[worker].memory_at(size)
        return memory is None or memory <= self.mem_limit

    def _give_back(self, sizes: dict[str, int], straggler: str, current: dict[str, float]) -> bool:
        """A straggler measured no slower at a larger size (beyond the noise) lost samples
        it did not need to lose (saturation): take them back from the slowest other."""
        curve = self._workers[straggler].curve
        size, now = sizes[straggler], current[straggler]
        flat = [
            b
            for b in curve
            if size < b <= size + self.fast[0]
            and curve[b].mean <= now - self._margin((straggler, b), (straggler, size))
        ]
        if not flat:
            return False
        amount = min(max(flat) - size, self.step)
        if not self._fits(straggler, size + amount):
            return False
        donors = [n for n in current if n != straggler and sizes[n] > amount]
        if not donors:
            return False
        donor = max(donors, key=lambda n: current[n])
        if self._workers[donor].time(sizes[donor] - amount) > current[donor]:
            return False
        self._move(sizes, donor, straggler, amount, count=False)
        return True

    def _move(
        self, sizes: dict[str, int], source: str, target: str, amount: int, count: bool = True
    ) -> None:
        sizes[source] -= amount
        sizes[target] += amount
        if count:
            self._gained.add(target)
            self._lost.add(source)
        self.removal_candidates.discard(source)
        self.moves += 1

    def forget(self, worker: str) -> None:
        super().forget(worker)
        self._workers.pop(worker, None)
        self._gained.discard(worker)
        self._lost.discard(worker)

    def rename_workers(self, names: Mapping[str, str]) -> None:
        super().rename_workers(names)
        self._workers = renamed(self._workers, names)
        self._gained = {names.get(w, w) for w in self._gained}
        self._lost = {names.get(w, w) for w in self._lost}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "phase": self.phase,
            "moves": self.moves,
            "workers": {
                name: {
                    "curve": {str(b): [p.mean, p.m2, p.count] for b, p in w.curve.items()},
                    "size": w.size,
                    "fresh": list(w.fresh),
                    "memory": None if w.memory is None else list(w.memory),
                }
                for name, w in self._workers.items()
            },
            "gained": sorted(self._gained),
            "lost": sorted(self._lost),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.phase = state["phase"]
        self.moves = int(state["moves"])
        self._workers = {
            name: _Worker(
                curve={int(b): _SizeTime(*p) for b, p in w["curve"].items()},
                size=int(w["size"]),
                fresh=deque((float(t) for t in w["fresh"]), maxlen=self._history),
                memory=None
                if w["memory"] is None
                else (int(w["memory"][0]), float(w["memory"][1])),
            )
            for name, w in state["workers"].items()
        }
        self._gained = set(state["gained"])
        self._lost = set(state["lost"])
