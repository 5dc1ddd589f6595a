"""A worker's step time as it has been measured, over the batch sizes it has run.

Real hardware is not t = B / v with one v: an H200 takes 1.4 ms per LeNet-5 step at B = 32
and 2.0 ms at B = 1024; one CPU thread 3.9 ms at 32, 155 ms at 1024, and 1.6 ms at B = 1
(a per-step cost that no speed describes). `ObservedSteps` keeps, for each batch size a
worker ran, a recency-weighted mean of its seconds per step, and answers "how long would a
step at B take" from a monotone fit of those points:

- between measured sizes, linear interpolation of the fit (pooled-adjacent-violators, so
  a noisy point never makes a larger batch look faster);
- above the largest measured size, growth from it as the last two measured sizes show,
  between t ∝ B^0.25 and t ∝ B (a CPU's regime: proportional; a GPU's flat curve: B^0.25,
  twice the time at 16 times the batch, so that a flat range shows itself in a few moves
  and one move past the card's saturation costs one round before the fit knows it);
- below the smallest, proportional shrinking toward it (an optimistic guess, which the
  next measurement corrects: a per-step floor shows itself the same way).

With one measured size this is exactly the one-speed model (t = B / v), so a worker whose
size never changes is treated as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

WEIGHT_CAP = 4.0  # a point's newest measurement counts at least 1/4: old ones fade
MIN_GROWTH = 0.25  # above the largest measured size, t grows at least as B^0.25
SIGMAS = 2.0  # how far beyond timing noise a departure from one speed must be
AGEING = 0.8  # each new measurement multiplies the other sizes' weights by this
MIN_CHANGE = math.log(1.5)  # a worker 1.5x faster or slower at a size it ran: it changed


class ObservedSteps:
    """Seconds per step of one worker, by batch size (see the module's docstring)."""

    def __init__(self) -> None:
        self.points: dict[int, tuple[float, float]] = {}  # B -> (weight, mean log seconds)
        # The timing noise the repeats show: squared deviations of a repeat's log seconds
        # from its size's mean so far (Welford), and how many repeats they rest on.
        self.noise_ss = 0.0
        self.noise_dof = 0

    def observe(self, batch_size: int, step_s: float) -> None:
        """One measurement: a step at `batch_size` took `step_s` seconds (> 0, finite)."""
        if batch_size < 1 or not (math.isfinite(step_s) and step_s > 0):
            raise ValueError(f"a step needs B >= 1 and seconds > 0, got {batch_size}, {step_s}")
        seconds = math.log(step_s)
        if self.changed(batch_size, seconds):  # the worker changed, not its curve
            self.points = {}
        weight, mean = self.points.get(batch_size, (0.0, 0.0))
        if weight > 0:
            self.noise_ss += (seconds - mean) ** 2 * weight / (weight + 1.0)
            self.noise_dof += 1
        # the other sizes' measurements age: a curve rests on recent evidence
        self.points = {b: (w * AGEING, m) for b, (w, m) in self.points.items()}
        weight = min(weight + 1.0, WEIGHT_CAP)
        self.points[batch_size] = (weight, mean + (seconds - mean) / weight)

    def noise(self) -> float | None:
        """The log-sd of one measurement that repeats at a size showed (None: no repeat)."""
        return math.sqrt(self.noise_ss / self.noise_dof) if self.noise_dof else None

    def changed(self, batch_size: int, log_seconds: float, sigmas: float = 3.0) -> bool:
        """Whether a measurement inside the measured range (where the fit is trusted, as
        opposed to an extrapolation the measurement teaches) contradicts the fit by more
        than `sigmas` times the noise its repeats show (at least MIN_CHANGE): the worker
        itself got faster or slower (a competing job, a throttled card)."""
        if len(self.points) < 2 and batch_size not in self.points:
            return False
        sizes = sorted(self.points)
        if not sizes[0] <= batch_size <= sizes[-1]:
            return False
        expected = math.log(self.seconds(batch_size))
        return abs(log_seconds - expected) > max(MIN_CHANGE, sigmas * (self.noise() or 0.0))

    def __len__(self) -> int:
        return len(self.points)

    def fit(self) -> tuple[list[int], list[float]]:
        """The measured sizes, ascending, and their fitted seconds: non-decreasing in B
        (weighted isotonic regression of the log means, pool-adjacent-violators)."""
        sizes = sorted(self.points)
        blocks: list[list[float]] = []  # [weight, weighted mean, count of sizes]
        for b in sizes:
            weight, mean = self.points[b]
            blocks.append([weight, mean, 1.0])
            while len(blocks) > 1 and blocks[-2][1] > blocks[-1][1]:
                w2, m2, c2 = blocks.pop()
                w1, m1, c1 = blocks.pop()
                blocks.append([w1 + w2, (w1 * m1 + w2 * m2) / (w1 + w2), c1 + c2])
        fitted: list[float] = []
        for _, mean, count in blocks:
            fitted += [math.exp(mean)] * int(count)
        return sizes, fitted

    def seconds(self, batch_size: float) -> float:
        """The predicted seconds of a step at `batch_size` (> 0); ValueError if nothing has
        been measured yet."""
        if not self.points:
            raise ValueError("no step measured yet")
        sizes, fitted = self.fit()
        return _predict(sizes, fitted, batch_size)

    def predictor(self) -> StepModel:
        """A frozen fit, for many predictions in one step."""
        sizes, fitted = self.fit()
        return StepModel(sizes, fitted, [self.points[b][0] for b in sizes])

    def state_dict(self) -> dict[str, Any]:
        return {
            "points": {str(b): [w, m] for b, (w, m) in self.points.items()},
            "noise": [self.noise_ss, self.noise_dof],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ObservedSteps:
        observed = cls()
        observed.points = {int(b): (float(w), float(m)) for b, (w, m) in state["points"].items()}
        observed.noise_ss, observed.noise_dof = float(state["noise"][0]), int(state["noise"][1])
        return observed


class StepModel:
    """`ObservedSteps.seconds` on a frozen fit."""

    def __init__(self, sizes: list[int], fitted: list[float], weights: list[float]) -> None:
        self.sizes, self.fitted, self.weights = sizes, fitted, weights

    def seconds(self, batch_size: float) -> float:
        return _predict(self.sizes, self.fitted, batch_size)

    def nonlinear(self, noise: float) -> bool:
        """Whether the measurements show that one speed (t ∝ B) does not describe this
        worker: two measured sizes whose time ratio falls short of their size ratio by
        more than twice what timing noise of `noise` (log-sd of one measurement) explains."""
        points = list(zip(self.sizes, self.fitted, self.weights, strict=True))
        return any(
            math.log(b2 / b1) - math.log(t2 / t1) > SIGMAS * noise * math.sqrt(1 / w1 + 1 / w2)
            for i, (b1, t1, w1) in enumerate(points)
            for b2, t2, w2 in points[i + 1 :]
        )


def _predict(sizes: list[int], fitted: list[float], batch_size: float) -> float:
    if batch_size <= sizes[0]:
        return fitted[0] * batch_size / sizes[0]
    if batch_size >= sizes[-1]:
        return fitted[-1] * float((batch_size / sizes[-1]) ** _growth(sizes, fitted))
    low, high = 0, len(sizes) - 1
    while high - low > 1:  # the measured sizes around batch_size
        middle = (low + high) // 2
        if sizes[middle] <= batch_size:
            low = middle
        else:
            high = middle
    share = (batch_size - sizes[low]) / (sizes[high] - sizes[low])
    return fitted[low] + share * (fitted[high] - fitted[low])


def _growth(sizes: list[int], fitted: list[float]) -> float:
    """The exponent e of t ∝ B^e above the largest measured size: the elasticity the last
    two measured sizes show, within [MIN_GROWTH, 1]. One measured size: 1 (one speed). A
    flat curve (a GPU below saturation) is thus extrapolated as t ∝ B^MIN_GROWTH: bold
    enough to cross a flat range in a few moves, cautious enough not to hand a card
    everything on one flat measurement."""
    if len(sizes) < 2:
        return 1.0
    elasticity = math.log(fitted[-1] / fitted[-2]) / math.log(sizes[-1] / sizes[-2])
    return min(1.0, max(MIN_GROWTH, elasticity))
