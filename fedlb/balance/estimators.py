"""Speed estimators: from a worker's reports, the samples/s to expect in its next iteration.

Each estimator serves one worker: `update(report)` after every report, then `predict()`.
`Memoryless` and `EMA` are numpy-free one-liners; `ChangePointMean` (the default) averages
everything since the worker's last significant change and says how sure it is; `NARX`
(in narx.py) learns how the worker's speed follows its CPU and memory use.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from .reports import WorkerReport
from .stats import t_limit

log = logging.getLogger("fedlb.balance")

# Fixed costs are averaged as log(overhead + this): a zero cost stays exactly zero, and
# differences well under a millisecond do not count as changes.
OVERHEAD_FLOOR_S = 1e-3
_SHIFT_P_FACTOR = 0.1  # the window is cut at a shift at outlier_p/10


def overhead_from_log(mean: float) -> float:
    """Seconds from a mean of log(overhead + OVERHEAD_FLOOR_S) (exactly 0 for zeros)."""
    return max(0.0, OVERHEAD_FLOOR_S * math.expm1(mean - math.log(OVERHEAD_FLOOR_S)))


@dataclass(frozen=True)
class Moments:
    """One measured quantity's estimate on the log scale, since its last change.

    count: the measurements behind `mean`, as a weight (fewer than were averaged when a
        trend is extrapolated: its variance is spread²/count).
    mean: the log value expected next.
    ss: the sum of squared residuals of the log values (about their mean, or about their
        trend line when there is one).
    dof: the degrees of freedom of `ss` (count − 1, or n − 2 with a trend).
    """

    count: float
    mean: float
    ss: float
    dof: int


@dataclass(frozen=True)
class Evidence:
    """What an estimator's numbers rest on, for tuners that weigh how sure they are.

    speed: log samples/s. overhead: log(fixed seconds per round + OVERHEAD_FLOOR_S), or
    None when the estimator does not track fixed costs.
    """

    speed: Moments
    overhead: Moments | None = None


class NotReadyError(RuntimeError):
    """predict() was called before the estimator saw any report."""


class SpeedEstimator(ABC):
    """One worker's speed estimator. Subclasses keep all their state JSON-serialisable."""

    kind: str = "estimator"

    def __init__(self) -> None:
        self.observations = 0

    @property
    def ready(self) -> bool:
        """True once predict() can answer."""
        return self.observations > 0

    @abstractmethod
    def update(self, report: WorkerReport) -> None:
        """Take the worker's newest report (already validated by the manager)."""

    @abstractmethod
    def predict(self) -> float:
        """Samples/s expected in the next iteration. Raises NotReadyError before any report."""

    def evidence(self) -> Evidence | None:
        """The statistics behind predict(), when the estimator keeps them. Default None."""
        return None

    def overhead(self) -> float | None:
        """Fixed seconds per round to expect, when the estimator tracks them (None: the
        manager smooths the reported fixed costs itself). Default None."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "observations": self.observations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"state is for a {state.get('kind')!r} estimator, not {self.kind!r}")
        self.observations = int(state["observations"])

    def _not_ready(self) -> NotReadyError:
        return NotReadyError(f"{type(self).__name__} has seen no report yet")


class Memoryless(SpeedEstimator):
    """The last measured speed (the paper's 'memoryless' baseline)."""

    kind = "memoryless"

    def __init__(self) -> None:
        super().__init__()
        self.last: float | None = None

    def update(self, report: WorkerReport) -> None:
        self.last = report.speed
        self.observations += 1

    def predict(self) -> float:
        if self.last is None:
            raise self._not_ready()
        return self.last

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last = state["last"]


class EMA(SpeedEstimator):
    """Exponential moving average of the measured speed: v̂ ← α·v + (1 − α)·v̂.

    Args:
        alpha: weight of the newest measurement. Default 0.2, the LB-BSP paper's setting:
            smooth enough to ignore a one-off slow round.
        restart_threshold: when set, a relative deviation |v − v̂|/v̂ above it on
            `restart_after` reports in a row is taken as a lasting change of speed (a
            silo got new hardware or a competing job) and the average restarts from
            those reports, so the balance recovers in a few rounds instead of ~1/α.
            Default None (plain EMA, as the paper).
        restart_after: how many consecutive deviating reports make a change. Default 2.
    """

    kind = "ema"

    def __init__(
        self,
        alpha: float = 0.2,
        restart_threshold: float | None = None,
        restart_after: int = 2,
    ) -> None:
        super().__init__()
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if restart_threshold is not None and not restart_threshold > 0:
            raise ValueError(f"restart_threshold must be > 0 or None, got {restart_threshold}")
        if restart_after < 1:
            raise ValueError(f"restart_after must be >= 1, got {restart_after}")
        self.alpha = alpha
        self.restart_threshold = restart_threshold
        self.restart_after = restart_after
        self.value: float | None = None
        self.deviating: list[float] = []  # consecutive speeds far from the average
        self.restarts = 0

    def update(self, report: WorkerReport) -> None:
        speed = report.speed
        self.observations += 1
        if self.value is None:
            self.value = speed
            return
        if self.restart_threshold is not None:
            if abs(speed - self.value) / self.value > self.restart_threshold:
                self.deviating.append(speed)
                if len(self.deviating) >= self.restart_after:
                    self.value = math.fsum(self.deviating) / len(self.deviating)
                    self.deviating.clear()
                    self.restarts += 1
                    return
            else:
                self.deviating.clear()
        self.value = self.alpha * speed + (1.0 - self.alpha) * self.value

    def predict(self) -> float:
        if self.value is None:
            raise self._not_ready()
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "value": self.value,
            "deviating": list(self.deviating),
            "restarts": self.restarts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.value = state["value"]
        self.deviating = [float(x) for x in state["deviating"]]
        self.restarts = int(state["restarts"])


class _LogStream:
    """Log values since the last change (a window of at most `memory`), with its tests.

    Every test judges a deviation against the spread the window itself shows (Student's t,
    so a short window needs a bigger deviation; with zero spread, clean timings, any
    deviation counts):
    - a new value beyond the two-sided `change_p` limit is held back; `confirm` of them in
      a row on one side are a change, and the window restarts from them; held-back values
      not followed by enough others join the window after all;
    - after each value, a shift inside the window (its first values differing from the
      rest: a slow first round, or a change the first test missed) cuts the window there:
      the largest two-sample t over the cut points against the `outlier_p`/10 level,
      Bonferroni-corrected (a cut discards data, so it needs the strongest evidence);
    - the value furthest from the mean of the others is dropped when it is beyond the
      `outlier_p` level, Bonferroni-corrected (a stall that arrived while the window was
      too short to judge it, or one that was held back and not confirmed).
    """

    def __init__(self) -> None:
        self.values: list[float] = []
        self.pending: list[float] = []  # consecutive values far out on one side
        # Caches of the window's (mean, ss) and estimate; None after every change.
        self._moments: tuple[float, float] | None = None
        self._estimate: Moments | None = None

    @property
    def count(self) -> int:
        return len(self.values)

    def _mean_ss(self) -> tuple[float, float]:
        if self._moments is None:
            self._estimate = None
            n = len(self.values)
            mean = math.fsum(self.values) / n if n else 0.0
            self._moments = (mean, math.fsum((v - mean) ** 2 for v in self.values))
        return self._moments

    def estimate(self, trend_p: float) -> Moments:
        """The level to expect next: the window's mean, or, when the window shows a trend
        significant at `trend_p` (t-test of the least-squares slope), the trend line one
        step past the newest value."""
        if self._moments is not None and self._estimate is not None:
            return self._estimate
        self._estimate = self._fit(trend_p)
        return self._estimate

    def _fit(self, trend_p: float) -> Moments:
        n = len(self.values)
        mean, ss = self._mean_ss()
        if n < 5:
            return Moments(n, mean, ss, max(n - 1, 0))
        centre = (n - 1) / 2.0
        sxx = n * (n * n - 1) / 12.0
        slope = math.fsum((i - centre) * v for i, v in enumerate(self.values)) / sxx
        residual = max(0.0, ss - slope * slope * sxx)
        if slope == 0.0 or (
            residual > 0.0
            and abs(slope) <= t_limit(trend_p, n - 2) * math.sqrt(residual / (n - 2) / sxx)
        ):
            return Moments(n, mean, ss, n - 1)
        ahead = n - centre  # the next value's position from the window's centre
        return Moments(1.0 / (1.0 / n + ahead * ahead / sxx), mean + slope * ahead, residual, n - 2)

    def push(
        self,
        value: float,
        memory: int,
        change_p: float,
        confirm: int,
        outlier_p: float,
        trend_p: float,
    ) -> bool:
        """Take one log value; True when a change was found (the window restarted or cut)."""
        n = len(self.values)
        if n >= 2:
            m = self.estimate(trend_p)
            spread = math.sqrt(m.ss / m.dof * (1.0 + 1.0 / m.count))
            deviation = value - m.mean
            if abs(deviation) > max(t_limit(change_p, m.dof) * spread, 1e-9):
                if self.pending and (self.pending[-1] > m.mean) != (deviation > 0):
                    self._admit([], memory)  # far out on the other side: not one change
                self.pending.append(value)
                if len(self.pending) < confirm:
                    return False
                self.values, self.pending = [], self.pending[-memory:]
                self._admit([], memory)
                return True
        self._admit([value], memory)
        if self._cut_at_shift(outlier_p * _SHIFT_P_FACTOR):
            return True
        self._drop_outlier(outlier_p)
        return False

    def _admit(self, values: list[float], memory: int) -> None:
        """Add the held-back values, then `values`, to the window."""
        self.values += [*self.pending, *values]
        self.pending = []
        del self.values[:-memory]
        self._moments = None

    def _cut_at_shift(self, level: float) -> bool:
        values = self.values
        n = len(values)
        if n < 4:
            return False
        mean, total_ss = self._mean_ss()
        limit = t_limit(level / (n - 2), n - 2)
        best, cut, head = 0.0, 0, 0.0
        rest = mean * n
        for j in range(1, n - 1):  # head values[:j], tail values[j:] (at least 2)
            head += values[j - 1]
            a, b = j, n - j
            mean_a, mean_b = head / a, (rest - head) / b
            diff = abs(mean_b - mean_a)
            if diff <= 1e-9:
                continue
            # Within-segment squares: the total about the mean less the between part.
            ss = total_ss - a * (mean_a - mean) ** 2 - b * (mean_b - mean) ** 2
            score = diff / math.sqrt(max(ss, 0.0) / (n - 2) * (1.0 / a + 1.0 / b) or 1e-300)
            if score > best:
                best, cut = score, j
        if best > limit:
            del values[:cut]
            self._moments = None
            return True
        return False

    def _drop_outlier(self, level: float) -> None:
        values = self.values
        n = len(values)
        if n < 3:
            return
        mean, ss = self._mean_ss()
        far = max(values, key=lambda v: abs(v - mean))  # the most extreme value
        deviation = (far - mean) * n / (n - 1)  # from the mean of the others
        if abs(deviation) <= 1e-9:
            return
        ss_others = max(0.0, ss - (far - mean) ** 2 * n / (n - 1))
        spread = math.sqrt(ss_others / (n - 2) * (1.0 + 1.0 / (n - 1)))
        if abs(deviation) > t_limit(level / n, n - 2) * spread:
            values.remove(far)
            self._moments = None

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "pending": list(self.pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = [float(x) for x in state["values"]]
        self.pending = [float(x) for x in state["pending"]]
        self._moments = None


class ChangePointMean(SpeedEstimator):
    """The mean of the reports since the worker's last significant change (the default).

    Speeds are averaged on the log scale (timing noise is multiplicative), so the estimate
    sharpens as 1/√n instead of staying as noisy as an EMA's last 1/α reports, and the
    spread of those same reports says how sure it is (`evidence()`, which the default
    tuner uses to pool workers it cannot tell apart). A change is judged against that
    spread: a report beyond the two-sided `change_p` limit of Student's t is held back,
    `confirm` of them in a row on one side are a change (the mean restarts from them),
    and a lone one is no change (it joins the mean, or is dropped as an outlier when it
    is extreme at the `outlier_p` level: a stalled round). Looking back, a window whose
    first reports differ from the rest (a slow first round) is cut there, and a window
    whose reports follow a significant trend (at `trend_p`) predicts the trend line's next
    value instead of its mean, so a steady drift is followed without lag. Fixed costs
    (`overhead_s`) are tracked the same way, separately (`overhead()`).

    With clean timings the spread is zero, so a change is seen at once and confirmed by
    the next report: the sizes follow two rounds after it. With noisy ones, a 3x change
    against 20% noise is ~5 standard deviations and is confirmed the same way. The mean
    covers the last `memory` reports at most.

    Args:
        memory: how many reports the mean covers at most. Default 50.
        change_p: probability that one ordinary report is held back as far out. Default
            0.01 (so an ordinary pair passes for a change with probability ~5e-5).
        confirm: far-out reports in a row, on one side, that make a change. Default 2.
        outlier_p: level of the tests that look back (Bonferroni-corrected over the
            window): drop the most extreme report, cut the window at a shift (at a tenth
            of this level). Default 0.01.
        trend_p: level of the slope test that switches from the window's mean to its
            trend line. Default 0.001: a false trend is extrapolated, which costs
            precision, so it needs strong evidence.
    """

    kind = "change-point-mean"

    def __init__(
        self,
        memory: int = 50,
        change_p: float = 0.01,
        confirm: int = 2,
        outlier_p: float = 0.01,
        trend_p: float = 0.001,
    ) -> None:
        super().__init__()
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 2:
            raise ValueError(f"memory must be an integer >= 2, got {memory!r}")
        if not 0.0 < change_p < 1.0:
            raise ValueError(f"change_p must be in (0, 1), got {change_p}")
        if isinstance(confirm, bool) or not isinstance(confirm, int) or confirm < 1:
            raise ValueError(f"confirm must be an integer >= 1, got {confirm!r}")
        if not 0.0 < outlier_p < 1.0:
            raise ValueError(f"outlier_p must be in (0, 1), got {outlier_p}")
        if not 0.0 < trend_p < 1.0:
            raise ValueError(f"trend_p must be in (0, 1), got {trend_p}")
        self.memory = memory
        self.change_p = change_p
        self.confirm = confirm
        self.outlier_p = outlier_p
        self.trend_p = trend_p
        self.changes = 0
        self._speed = _LogStream()
        self._overhead = _LogStream()

    @property
    def ready(self) -> bool:
        return self._speed.count > 0

    def update(self, report: WorkerReport) -> None:
        self.observations += 1
        speed = math.log(report.speed) if 0 < report.speed < math.inf else math.nan
        if not math.isfinite(speed):  # a speed past float range (compute_s near 0)
            log.warning("worker %s: speed %r ignored", report.worker, report.speed)
            return
        before = self.predict() if self.ready else None
        if self._speed.push(speed, *self._tests):
            self.changes += 1
            log.info(
                "worker %s: speed changed from %.4g to %.4g samples/s; its estimate restarts",
                report.worker,
                before,
                self.predict(),
            )
        overhead = math.log(report.overhead_s + OVERHEAD_FLOOR_S)  # 0 s stays exactly 0 s
        self._overhead.push(overhead, *self._tests)

    @property
    def _tests(self) -> tuple[int, float, int, float, float]:
        return self.memory, self.change_p, self.confirm, self.outlier_p, self.trend_p

    def predict(self) -> float:
        if not self.ready:
            raise self._not_ready()
        return math.exp(self._speed.estimate(self.trend_p).mean)

    def overhead(self) -> float | None:
        if self._overhead.count == 0:
            return None
        return overhead_from_log(self._overhead.estimate(self.trend_p).mean)

    def evidence(self) -> Evidence | None:
        if not self.ready:
            return None
        overhead = self._overhead.estimate(self.trend_p) if self._overhead.count else None
        return Evidence(self._speed.estimate(self.trend_p), overhead)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "changes": self.changes,
            "speed": self._speed.state_dict(),
            "overhead": self._overhead.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.changes = int(state["changes"])
        self._speed.load_state_dict(dict(state["speed"]))
        self._overhead.load_state_dict(dict(state["overhead"]))
