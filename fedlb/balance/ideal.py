"""The ideal round time T*, balance efficiency E = T*/T_round, and the idle fraction.

A worker's round time is modelled as t_i = o_i + τ_i·B_i / v_i, or, for a worker with a
measured step-time curve c_i (`curves`), t_i = o_i + τ_i·c_i(B_i). T* is the smallest
max_i t_i over all integer splits of the total X (each worker keeping at least min_batch):
the best any batch-size policy could do with these speeds and curves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from .curves import StepCurve
from .split import min_max_split, monotone_split


def _per_worker(
    value: float | int | Mapping[str, float] | Mapping[str, int] | None,
    names: list[str],
    default: float,
    what: str,
) -> list[float]:
    if value is None:
        return [default] * len(names)
    if isinstance(value, Mapping):
        missing = [n for n in names if n not in value]
        if missing:
            raise ValueError(f"{what} has no entry for workers {missing}")
        return [float(value[n]) for n in names]
    return [float(value)] * len(names)


def _checked_speeds(
    speeds: Mapping[str, float], curves: Mapping[str, StepCurve] | None = None
) -> list[str]:
    """The workers: those of `speeds`, then those only `curves` names."""
    names = list(speeds) + [n for n in curves or {} if n not in speeds]
    if not names:
        raise ValueError("speeds is empty: give at least one worker's samples/s")
    bad = {n: v for n, v in speeds.items() if not (math.isfinite(v) and v > 0)}
    if bad:
        raise ValueError(f"speeds must be finite and > 0 samples/s, got {bad}")
    return names


def _round_times(
    names: list[str],
    speeds: Mapping[str, float],
    curves: Mapping[str, StepCurve],
    taus: list[float],
    fixed: list[float],
) -> list[Callable[[int], float]]:
    """Each worker's round time as a function of its batch size."""

    def time_of(name: str, tau: float, o: float) -> Callable[[int], float]:
        curve = curves.get(name)
        if curve is not None:
            return lambda batch: o + tau * curve.seconds(batch)
        speed = speeds[name]
        return lambda batch: o + tau * batch / speed

    return [time_of(n, tau, o) for n, tau, o in zip(names, taus, fixed, strict=True)]


def ideal_sizes(
    speeds: Mapping[str, float],
    total: int,
    iterations: int | Mapping[str, int] = 1,
    overheads: Mapping[str, float] | None = None,
    min_batch: int = 1,
    curves: Mapping[str, StepCurve] | None = None,
) -> dict[str, int]:
    """The integer split of `total` that achieves T* (see module docstring). The workers
    are those of `speeds` and `curves`; one in `curves` runs on its curve."""
    names = _checked_speeds(speeds, curves)
    taus = _per_worker(iterations, names, 1.0, "iterations")
    fixed = _per_worker(overheads, names, 0.0, "overheads")
    if total < min_batch * len(names):
        raise ValueError(
            f"total {total} is smaller than {len(names)} workers x min_batch {min_batch}"
        )
    if curves:
        times = _round_times(names, speeds, curves, taus, fixed)
        return dict(zip(names, monotone_split(times, total, min_batch), strict=True))
    rates = [speeds[n] / tau for n, tau in zip(names, taus, strict=True)]
    sizes = min_max_split(rates, fixed, total, min_batch)
    return dict(zip(names, sizes, strict=True))


def modelled_round_time(
    speeds: Mapping[str, float],
    sizes: Mapping[str, int],
    iterations: int | Mapping[str, int] = 1,
    overheads: Mapping[str, float] | None = None,
    curves: Mapping[str, StepCurve] | None = None,
) -> float:
    """max_i (o_i + τ_i·B_i / v_i), or o_i + τ_i·c_i(B_i) on a curve: the round time the
    model predicts for `sizes`."""
    names = _checked_speeds(speeds, curves)
    taus = _per_worker(iterations, names, 1.0, "iterations")
    fixed = _per_worker(overheads, names, 0.0, "overheads")
    times = _round_times(names, speeds, curves or {}, taus, fixed)
    return max(time(sizes[n]) for n, time in zip(names, times, strict=True))


def ideal_round_time(
    speeds: Mapping[str, float],
    total: int,
    iterations: int | Mapping[str, int] = 1,
    overheads: Mapping[str, float] | None = None,
    min_batch: int = 1,
    curves: Mapping[str, StepCurve] | None = None,
) -> float:
    """T*: the smallest max_i (o_i + τ·B_i/v_i) over integer splits with Σ B_i = total.

    Args:
        speeds: samples/s of pure compute per worker (v_i).
        total: the global batch X to divide.
        iterations: τ, local iterations per round (one value, or one per worker). Default 1.
        overheads: fixed seconds per round per worker (o_i). Default none.
        min_batch: every worker keeps at least this many samples. Default 1.
        curves: measured step-time curves c_i per worker: such a worker's compute is
            τ·c_i(B_i) instead of τ·B_i/v_i (it needs no entry in `speeds`). Default none.
    """
    sizes = ideal_sizes(speeds, total, iterations, overheads, min_batch, curves)
    return modelled_round_time(speeds, sizes, iterations, overheads, curves)


def balance_efficiency(
    speeds: Mapping[str, float],
    sizes: Mapping[str, int],
    iterations: int | Mapping[str, int] = 1,
    overheads: Mapping[str, float] | None = None,
    round_time: float | None = None,
    min_batch: int = 1,
    curves: Mapping[str, StepCurve] | None = None,
) -> float:
    """E = T*/T_round for the split `sizes` (1.0 is perfect balance).

    T_round is `round_time` when given (a measured round), else the modelled round time of
    `sizes` under `speeds` and `curves`. T* uses the same total Σ sizes.
    """
    actual = (
        modelled_round_time(speeds, sizes, iterations, overheads, curves)
        if round_time is None
        else round_time
    )
    if not (math.isfinite(actual) and actual > 0):
        raise ValueError(f"round_time must be finite and > 0 seconds, got {actual}")
    total = sum(sizes[n] for n in _checked_speeds(speeds, curves))
    return ideal_round_time(speeds, total, iterations, overheads, min_batch, curves) / actual


def idle_fraction(busy: Mapping[str, float], round_time: float) -> float:
    """1 − Σ busy_i / (n·T_round): the share of worker-seconds spent waiting."""
    if not busy:
        raise ValueError("busy is empty")
    if not (math.isfinite(round_time) and round_time > 0):
        raise ValueError(f"round_time must be finite and > 0 seconds, got {round_time}")
    return 1.0 - sum(busy.values()) / (len(busy) * round_time)
