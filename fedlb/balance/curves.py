"""A measured step-time curve: the seconds of one training step against its batch size.

Real hardware is not t = B / v with one v (DESIGN.md, "The method in one screen"): a GPU's
step time is flat over two or three orders of magnitude of B and then bends, a CPU's grows
about linearly once B passes a few dozen. A `StepCurve` keeps what was measured, points
(B, seconds), and gives the seconds at any B:

- between two measured points: linear in B (piecewise-linear interpolation: it keeps
  non-decreasing points non-decreasing, and a balancer can invert it segment by segment);
- below the first point: the first point's seconds (a smaller batch is not taken to be
  faster than the smallest one measured: a step's launch and Python costs do not shrink);
- beyond the last point: linear in B through the origin, t(B) = t_last · B / B_last: the
  throughput measured at the largest batch is held, the device being saturated there.
  (The last segment's own slope is not used: at a GPU's bend it is the noise of two
  points, and a line through the origin never predicts a larger batch as cheaper per
  sample than the largest one measured.)

Seconds never fall as B grows: `StepCurve(points)` refuses points that do, and
`StepCurve.fit(measured)` makes noisy measurements non-decreasing first (isotonic
regression by pool-adjacent-violators: the least-squares non-decreasing fit, so equal
hardware noise up and down cancels instead of ratcheting the curve up).

Plain maths, no numpy: the balancer, the ideal-time maths (fedlb.balance.ideal) and the
emulated silos (fedlb.training) share it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepCurve:
    """Seconds of one step (forward, backward, optimizer step) at each batch size.

    Args:
        points: (batch size, seconds) pairs, batch sizes whole, >= 1 and increasing,
            seconds finite, > 0 and non-decreasing (`fit` makes measurements so).
        name: what outputs call it, e.g. "h200/lenet5" ('' : unnamed).
        model: the model it was measured on, e.g. "lenet5" ('' : not said). A curve is
            one model's: fedlb refuses to emulate it for another model.
    """

    points: tuple[tuple[int, float], ...]
    name: str = ""
    model: str = ""
    _batches: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        points = tuple((b, s) for b, s in self.points)  # lists from JSON become tuples
        if not points:
            raise ValueError("a step-time curve needs at least one (batch, seconds) point")
        for batch, seconds in points:
            if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
                raise ValueError(f"a curve's batch sizes must be whole numbers >= 1, got {batch!r}")
            if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"a curve's seconds must be finite and > 0, got {seconds!r}")
        for (b0, s0), (b1, s1) in itertools.pairwise(points):
            if b1 <= b0:
                raise ValueError(f"a curve's batch sizes must increase, got {b0} then {b1}")
            if s1 < s0:
                raise ValueError(
                    f"a curve's seconds must not fall as B grows: {s0:g} s at B={b0}, {s1:g} s "
                    f"at B={b1} (StepCurve.fit makes measured points non-decreasing)"
                )
        object.__setattr__(self, "points", tuple((int(b), float(s)) for b, s in points))
        object.__setattr__(self, "_batches", tuple(b for b, _ in points))

    @classmethod
    def fit(
        cls, measured: Iterable[tuple[int, float]], name: str = "", model: str = ""
    ) -> StepCurve:
        """The non-decreasing curve nearest (least squares) to `measured` (batch, seconds)
        pairs, in any order; several seconds at one batch size count as their mean."""
        by_batch: dict[int, list[float]] = {}
        for batch, seconds in measured:
            by_batch.setdefault(batch, []).append(seconds)
        # pool-adjacent-violators: blocks of (mean seconds, weight, batch sizes), merged
        # with the block before while it would fall
        blocks: list[tuple[float, int, list[int]]] = []
        for batch in sorted(by_batch):
            values = by_batch[batch]
            mean, weight, members = math.fsum(values) / len(values), len(values), [batch]
            while blocks and blocks[-1][0] > mean:
                before, before_weight, before_members = blocks.pop()
                total = before_weight + weight
                mean = (before * before_weight + mean * weight) / total
                weight, members = total, before_members + members
            blocks.append((mean, weight, members))
        points = tuple((b, mean) for mean, _, members in blocks for b in members)
        return cls(points, name, model)

    def seconds(self, batch: float) -> float:
        """Seconds of one step of `batch` samples (> 0; see the module for between, below
        and beyond the measured points)."""
        if not (math.isfinite(batch) and batch > 0):
            raise ValueError(f"a batch size must be finite and > 0, got {batch!r}")
        first_batch, first_seconds = self.points[0]
        last_batch, last_seconds = self.points[-1]
        if batch <= first_batch:
            return first_seconds
        if batch >= last_batch:
            return last_seconds * batch / last_batch
        i = bisect.bisect_right(self._batches, batch)  # points[i-1] <= batch < points[i]
        (b0, s0), (b1, s1) = self.points[i - 1], self.points[i]
        return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)

    def samples_per_s(self, batch: float) -> float:
        """The throughput at `batch`: batch / seconds(batch)."""
        return batch / self.seconds(batch)

    def scaled(self, factor: float, name: str | None = None) -> StepCurve:
        """The same curve with every time × `factor` (> 0): hardware `factor` times slower
        (a factor below 1: faster). Named `name`, by default "<name>*<factor>"."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"a curve's time factor must be finite and > 0, got {factor!r}")
        label = f"{self.name}*{factor:g}" if name is None else name
        return StepCurve(tuple((b, s * factor) for b, s in self.points), label, self.model)
