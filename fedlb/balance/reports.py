"""What a worker reports at an iteration (cluster) or round (federated) boundary."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

LONGEST_S = 1e7  # seconds (~4 months): a reported time past it is corrupt, not slow


class ReportError(ValueError):
    """A worker report that cannot be used. The message says what was wrong with it."""


@dataclass(frozen=True)
class WorkerReport:
    """One worker's measurements for the iterations it just ran.

    Args:
        worker: the worker's (silo's, rank's) name, as the manager knows it.
        batch_size: samples per iteration it just ran (B_i, the size it was given).
        iterations: local iterations it just ran (τ in FL, 1 in cluster mode).
        compute_s: seconds of pure compute those iterations took (no waiting, no I/O).
        overhead_s: fixed per-round seconds that do not scale with B (encryption,
            serialisation, upload). Default 0.
        cpu: CPU use measured now, a fraction in [0, 1]; drives the next iteration (c^k).
        mem: memory use measured now, a fraction in [0, 1] (m^k).
        accel_mem: accelerator memory use measured now, a fraction in [0, 1]; the GPU
            tuner never grows a worker above its memory limit.
    """

    worker: str
    batch_size: int
    iterations: int
    compute_s: float
    overhead_s: float = 0.0
    cpu: float | None = None
    mem: float | None = None
    accel_mem: float | None = None

    @property
    def speed(self) -> float:
        """Samples per second of pure compute: B·τ / compute_s."""
        return self.batch_size * self.iterations / self.compute_s

    @property
    def round_s(self) -> float:
        """The worker's busy time for the round: fixed cost plus compute."""
        return self.overhead_s + self.compute_s

    def problems(self) -> list[str]:
        """Everything wrong with this report, as sentences; empty when it is usable."""
        found: list[str] = []
        if not isinstance(self.worker, str) or not self.worker:
            found.append(f"worker name must be a non-empty string, got {self.worker!r}")
        for name in ("batch_size", "iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                found.append(f"{name} must be an integer >= 1, got {value!r}")
        for name, allow_zero in (("compute_s", False), ("overhead_s", True)):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                found.append(f"{name} must be a finite number of seconds, got {value!r}")
            elif value < 0 or (value == 0 and not allow_zero):
                bound = ">= 0" if allow_zero else "> 0"
                found.append(f"{name} must be {bound}, got {value!r}")
            elif value > LONGEST_S:
                found.append(f"{name} {value:g} s is longer than any round ({LONGEST_S:g} s)")
        if not found and not math.isfinite(self.batch_size * self.iterations / self.compute_s):
            # a subnormal compute time (1e-320 s): the speed it gives is infinite
            found.append(
                f"compute_s {self.compute_s!r} s is too short to measure {self.batch_size} x "
                f"{self.iterations} samples (an infinite speed)"
            )
        for name in ("cpu", "mem", "accel_mem"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_real(value) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
                found.append(f"{name} must be a fraction in [0, 1] or None, got {value!r}")
        return found

    def validate(self) -> WorkerReport:
        """Return self, or raise ReportError naming every problem."""
        found = self.problems()
        if found:
            raise ReportError(f"report from worker {self.worker!r} rejected: " + "; ".join(found))
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerReport:
        return cls(**data)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
