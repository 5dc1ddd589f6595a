"""Dividing a fixed total X among workers: the continuous water-fill and integer rounding.

Every tuner ends here, so the invariants live here once: the integer sizes sum to X exactly,
each lies within its bounds, and the result depends only on the inputs (ties go to the
earlier worker in the given order).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]


def check_feasible(total: int, lo: Sequence[float], hi: Sequence[float]) -> None:
    """Raise ValueError when no split of `total` fits the bounds."""
    low, high = float(np.sum(lo)), float(np.sum(hi))
    if total < low or total > high:
        raise ValueError(
            f"cannot divide a total of {total} among {len(lo)} workers within their bounds "
            f"(the bounds allow {low:g} to {high:g}); lower min_batch, raise max_batch, "
            "or change the total"
        )


def water_fill(
    rates: Sequence[float] | FloatArray,
    offsets: Sequence[float] | FloatArray,
    total: float,
    lo: Sequence[float] | FloatArray,
    hi: Sequence[float] | FloatArray,
) -> tuple[float, FloatArray]:
    """Solve Σ clamp((T − offsets_i)·rates_i, lo_i, hi_i) = total for the level T.

    With rates = v_i/τ and offsets = o_i this equalises the round times o_i + τ·B_i/v_i of
    every worker that is not held at a bound (overhead-aware Algorithm 1). With offsets = 0
    it scales the rates to the total. Returns (T, real-valued sizes). The sum is
    piecewise linear and non-decreasing in T, so a binary search over its breakpoints
    finds the segment and one division solves it: O(n log n).
    """
    r = np.asarray(rates, dtype=np.float64)
    o = np.asarray(offsets, dtype=np.float64)
    low = np.asarray(lo, dtype=np.float64)
    high = np.asarray(hi, dtype=np.float64)
    if np.any(r <= 0) or not np.all(np.isfinite(r)):
        raise ValueError(f"rates must be finite and > 0, got {r.tolist()}")
    check_feasible(round(total), low.tolist(), high.tolist())

    starts = o + low / r  # level at which a worker leaves its lower bound
    ends = o + high / r  # level at which it reaches its upper bound (inf when unbounded)
    points = np.unique(np.concatenate([starts, ends[np.isfinite(ends)]]))

    def filled(level: float) -> float:
        return float(np.clip((level - o) * r, low, high).sum())

    # Largest breakpoint whose fill does not exceed the total.
    left, right = 0, len(points) - 1
    while left < right:
        mid = (left + right + 1) // 2
        if filled(float(points[mid])) <= total:
            left = mid
        else:
            right = mid - 1
    base = float(points[left])
    active = (starts <= base) & (ends > base)
    slope = float(r[active].sum())
    level = base if slope == 0 else base + (total - filled(base)) / slope
    return level, np.clip((level - o) * r, low, high)


def round_to_total(
    real: Sequence[float] | FloatArray,
    total: int,
    lo: Sequence[int],
    hi: Sequence[float],
) -> list[int]:
    """Largest-remainder rounding of real sizes to integers that sum to `total` exactly.

    Floors first; the units still missing go to the largest fractional parts (earlier
    worker first on ties), never above a worker's upper bound.
    """
    values = np.asarray(real, dtype=np.float64)
    low = np.asarray(lo, dtype=np.float64)
    high = np.asarray(hi, dtype=np.float64)
    check_feasible(total, low.tolist(), high.tolist())
    # A tiny tolerance keeps 4.9999999999 (float noise from the water-fill) at 5.
    floors = np.clip(np.floor(values + 1e-9), low, high)
    fractions = values - floors
    missing = total - int(floors.sum())
    order = np.argsort(-fractions, kind="stable")
    result = floors.astype(np.int64)
    while missing > 0:
        for i in order:
            if missing == 0:
                break
            if result[i] < high[i]:
                result[i] += 1
                missing -= 1
    while missing < 0:
        for i in order[::-1]:
            if missing == 0:
                break
            if result[i] > low[i]:
                result[i] -= 1
                missing += 1
    return [int(x) for x in result]


def min_max_split(
    rates: Sequence[float],
    offsets: Sequence[float],
    total: int,
    min_batch: int = 1,
) -> list[int]:
    """The integer split with Σ B_i = total that minimises max_i (offsets_i + B_i / rates_i).

    Start from the floors of the continuous optimum (every unit there finishes no later
    than the continuous level, so the optimum contains them), then hand out the remaining
    units one at a time to whoever would finish earliest with one more: the classic greedy,
    exact for increasing per-worker times.
    """
    n = len(rates)
    lows = [float(min_batch)] * n
    _, real = water_fill(rates, offsets, total, lows, [math.inf] * n)
    sizes = [max(min_batch, math.floor(x)) for x in real]
    while sum(sizes) > total:  # float noise only; take back from whoever finishes last
        worst = max(
            (i for i in range(n) if sizes[i] > min_batch),
            key=lambda i: offsets[i] + sizes[i] / rates[i],
        )
        sizes[worst] -= 1
    heap = [(offsets[i] + (sizes[i] + 1) / rates[i], i) for i in range(n)]
    heapq.heapify(heap)
    for _ in range(total - sum(sizes)):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        heapq.heappush(heap, (offsets[i] + (sizes[i] + 1) / rates[i], i))
    return sizes


def monotone_split(
    times: Sequence[Callable[[int], float]], total: int, min_batch: int = 1
) -> list[int]:
    """The integer split with Σ B_i = total that minimises max_i times_i(B_i), for any
    per-worker times non-decreasing in B (measured step-time curves with τ and fixed
    costs): T* where t(B) is not o + τ·B/v.

    How many samples a worker can take and still finish by a level T, its cap, grows with
    T, and T* is the smallest level whose caps reach the total. A bisection on T finds
    the highest level whose caps stay at or below the total (every worker then finishes
    by T*, so some optimum contains those sizes); the units still missing go one at a
    time to whoever would finish earliest with one more: the classic greedy, exact for
    non-decreasing times, and short after the bisection but where a curve is flat (a
    GPU's plateau, where many sizes cost the same). Ties go to the earlier worker.
    """
    n = len(times)
    if n == 0:
        raise ValueError("no workers to divide the total among")
    if total < min_batch * n:
        raise ValueError(f"total {total} is smaller than {n} workers x min_batch {min_batch}")
    most = total - min_batch * (n - 1)  # what one worker can hold at most

    def cap(i: int, level: float) -> int:
        """The largest B in [min_batch, most] with times_i(B) <= level (min_batch, which
        every worker holds anyway, where none is)."""
        low, high = min_batch, most
        if times[i](low) > level:
            return min_batch
        while low < high:
            middle = (low + high + 1) // 2
            if times[i](middle) <= level:
                low = middle
            else:
                high = middle - 1
        return low

    low_level = max(t(min_batch) for t in times)  # T* is at least this
    high_level = max(t(most) for t in times)  # every cap is `most` here: T* is at most this
    sizes = [cap(i, low_level) for i in range(n)]
    if sum(sizes) > total:  # T* = low_level: the greedy from min_batch reaches it
        sizes = [min_batch] * n
    else:
        for _ in range(200):  # float bisection: ~60 halvings reach adjacent floats
            middle = (low_level + high_level) / 2
            if not low_level < middle < high_level:
                break
            caps = [cap(i, middle) for i in range(n)]
            if sum(caps) <= total:
                low_level, sizes = middle, caps
                if sum(caps) == total:
                    break
            else:
                high_level = middle
    heap = [(times[i](sizes[i] + 1), i) for i in range(n) if sizes[i] < most]
    heapq.heapify(heap)
    for _ in range(total - sum(sizes)):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        if sizes[i] < most:
            heapq.heappush(heap, (times[i](sizes[i] + 1), i))
    return sizes
