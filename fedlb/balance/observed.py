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
- below the smallest, shrinking toward it as the two smallest measured sizes show, within
  the same bounds (a CPU near its per-step floor shrinks little: 2.2 ms at B = 24 and 2.5
  ms at 32 on four threads say that 12 samples still take 1.7 ms, which a proportional
  guess would put at 1.1 ms and learn only a round later).

With one measured size this is exactly the one-speed model (t = B / v), so a worker whose
size never changes is treated as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

WEIGHT_CAP = 4.0  # a point's newest measurement counts at least 1/4: old ones fade
MIN_GROWTH = 0.25  # above the largest measured size, t grows at least as B^0.25
# How far below one speed (in standard errors of the log-log slope) the measurements must
# lie before the curves decide. At 1.5 one-speed silos under 20% lognormal noise keep the
# pooled tuner's E (60 seeds) and follow a 3x step as fast (40 seeds: E ≥ 0.937 from the
# third round after it, pooled 0.947), while the H200-beside-CPUs curves are split within
# 1.01x of the best by round 8; 2.0 waited three rounds longer (benchmarks/curves.py).
SIGMAS = 1.5
MIN_DEPARTURE = 0.05  # a slope of 0.95 or more is one speed, whatever the noise
MIN_SPREAD = 0.1  # the weighted sd of log B below which no curve is claimed (~ ±10%)
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
        """Whether a measurement contradicts what the fit allows by more than `sigmas` times
        the noise its repeats show (at least MIN_CHANGE): the worker itself got faster or
        slower (a competing job, a throttled card). Inside the measured range the fit is
        trusted; beyond it only what holds for any hardware is: a step takes no less time
        at a larger batch, and no more time per sample (beyond the largest measured size
        its time is between the fit's there and proportional growth from it; below the
        smallest, between proportional shrinking to it and the fit's there)."""
        if len(self.points) < 2 and batch_size not in self.points:
            return False
        sizes, fitted = self.fit()
        if batch_size < sizes[0]:
            low, high = fitted[0] * batch_size / sizes[0], fitted[0]
        elif batch_size > sizes[-1]:
            low, high = fitted[-1], fitted[-1] * batch_size / sizes[-1]
        else:
            low = high = _predict(sizes, fitted, batch_size)
        margin = max(MIN_CHANGE, sigmas * (self.noise() or 0.0))
        return not math.log(low) - margin <= log_seconds <= math.log(high) + margin

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
        worker: the weighted least-squares slope of log t on log B falls short of 1 by more
        than SIGMAS standard errors, with timing noise of `noise` (log-sd of one
        measurement). One test over all the points, not one per pair: under 20% timing
        noise, pairs of nearby sizes show a "curve" by chance every few rounds. And only
        over sizes spread by MIN_SPREAD: a worker slowing 2% a round, its size shrinking
        with it, shows a flat "curve" over sizes a few percent apart."""
        if len(self.sizes) < 2:
            return False
        logs = [math.log(b) for b in self.sizes]
        times = [math.log(t) for t in self.fitted]
        total = math.fsum(self.weights)
        mean_b = math.fsum(w * x for w, x in zip(self.weights, logs, strict=True)) / total
        mean_t = math.fsum(w * y for w, y in zip(self.weights, times, strict=True)) / total
        spread = math.fsum(w * (x - mean_b) ** 2 for w, x in zip(self.weights, logs, strict=True))
        if spread <= 0.0:
            return False
        slope = (
            math.fsum(
                w * (x - mean_b) * (y - mean_t)
                for w, x, y in zip(self.weights, logs, times, strict=True)
            )
            / spread
        )
        wide = spread / total >= MIN_SPREAD**2
        return wide and 1.0 - slope > max(MIN_DEPARTURE, SIGMAS * noise / math.sqrt(spread))


def _predict(sizes: list[int], fitted: list[float], batch_size: float) -> float:
    if batch_size <= sizes[0]:
        return fitted[0] * float((batch_size / sizes[0]) ** _growth(sizes[:2], fitted[:2]))
    if batch_size >= sizes[-1]:
        return fitted[-1] * float((batch_size / sizes[-1]) ** _growth(sizes[-2:], fitted[-2:]))
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
    """The exponent e of t ∝ B^e beyond the measured range: the elasticity that the two
    measured sizes nearest that end show, within [MIN_GROWTH, 1]. One measured size: 1
    (one speed). A flat curve (a GPU below saturation) is thus extrapolated as
    t ∝ B^MIN_GROWTH: bold enough to cross a flat range in a few moves, cautious enough
    not to hand a card everything on one flat measurement."""
    if len(sizes) < 2:
        return 1.0
    elasticity = math.log(fitted[1] / fitted[0]) / math.log(sizes[1] / sizes[0])
    return min(1.0, max(MIN_GROWTH, elasticity))
