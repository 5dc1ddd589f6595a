"""Speed estimators: from a worker's reports, the samples/s to expect in its next iteration.

Each estimator serves one worker: `update(report)` after every report, then `predict()`.
`Memoryless` and `EMA` are numpy-free one-liners; `NARX` (in narx.py) learns how the
worker's speed follows its CPU and memory use.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

from .reports import WorkerReport


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
