"""The spread the stability guard reads: the coefficient of variation of the silos' steps,
and the same net of batch noise (a step's noise part goes as B^(-w/2); fedlb.balance.guard's
`quiet` explains when it is read so)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

NOISE_EXPONENTS = tuple(k / 20 for k in range(21))  # w: a step's noise part ∝ B^(-w/2)


def dispersion(values: Sequence[float]) -> float | None:
    """Coefficient of variation (population sd over mean) of two or more values."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else None


def mean_ratio(now: Mapping[str, float], against: Mapping[str, float]) -> float | None:
    """The mean, over the silos in both with a positive yardstick, of each silo's step now
    over its step in `against` (None: no silo in both): the guard's growth, and a trial
    round's fall."""
    ratios = [v / against[n] for n, v in now.items() if against.get(n, 0.0) > 0]
    return statistics.fmean(ratios) if ratios else None


def net_dispersion(
    ratios: Sequence[float], shrunk: Sequence[float]
) -> tuple[float | None, float | None]:
    """(the least dispersion of `ratios` net of batch noise, the exponent w that gives it).

    `ratios`: each silo's step now over its step at equal sizes; `shrunk`: its batch now
    over its batch then. A step whose noise part goes as B^(-1/2) grows by shrunk^(-w/2),
    w the share of noise in it (0: all gradient, 1: all noise); each ratio is multiplied
    back by shrunk^(w/2) over a grid of w, and the least dispersion is kept (the first
    w at a tie, so sizes that did not change read as measured)."""
    best: tuple[float | None, float | None] = (None, None)  # fewer than two, or all zero
    for w in NOISE_EXPONENTS:
        found = dispersion([r * s ** (w / 2) for r, s in zip(ratios, shrunk, strict=True)])
        if found is not None and (best[0] is None or found < best[0] - 1e-12):
            best = (found, w)
    return best
