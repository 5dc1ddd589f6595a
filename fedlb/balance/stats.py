"""The little statistics the robust default needs, in plain Python (no scipy).

- `f_quantile(d1, d2, p)`: the p-quantile of Fisher's F(d1, d2), by bisection on the
  regularised incomplete beta function (exact to ~1e-10, cached); above 30 denominator
  degrees of freedom interpolated in 1/d2 between exact points and the χ² limit (within
  0.1%), and for d1 > 30 Paulson's approximation.
- `t_limit(p, dof)`: the two-sided Student t critical value (P(|t| > limit) = p).
- `pool_means(...)`: which workers' means are statistically indistinguishable, and their
  pooled means (a divisive F-test on sorted means).
- `alike_probability(...)`: the posterior probability that all workers share one mean (a
  default Bayes factor, numpy on a fixed quadrature), and `mixture_median(...)`, the
  point estimate the default tuner takes from it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import lru_cache
from statistics import NormalDist

import numpy as np


def _beta_fraction(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def f_cdf(f: float, d1: float, d2: float) -> float:
    """P(F ≤ f) for F ~ F(d1, d2)."""
    if f <= 0.0:
        return 0.0
    return incomplete_beta(d1 / 2.0, d2 / 2.0, d1 * f / (d1 * f + d2))


# Above 30 denominator degrees of freedom the quantile is interpolated linearly in 1/d2
# between these (exact, cached) points and the χ² limit: a bounded set of exact
# computations, within 0.1% of the exact value.
_DOF_GRID = (30, 40, 60, 120, 240)


@lru_cache(maxsize=4096)
def f_quantile(d1: int, d2: int, p: float) -> float:
    """The p-quantile of F(d1, d2) (d1, d2 >= 1, 0 < p < 1)."""
    if d1 < 1 or d2 < 1 or not 0.0 < p < 1.0:
        raise ValueError(f"need d1, d2 >= 1 and 0 < p < 1, got {d1}, {d2}, {p}")
    if d1 > 30:
        return _paulson(d1, d2, p)
    if d2 > _DOF_GRID[0]:
        if d2 in _DOF_GRID:
            return _f_exact(d1, d2, p)
        below = max(g for g in _DOF_GRID if g < d2)
        above = min((g for g in _DOF_GRID if g > d2), default=None)
        f_below = _f_exact(d1, below, p)
        f_above = _chi2_quantile(d1, p) / d1 if above is None else f_quantile(d1, above, p)
        x, x_below, x_above = 1.0 / d2, 1.0 / below, 0.0 if above is None else 1.0 / above
        return f_above + (f_below - f_above) * (x - x_above) / (x_below - x_above)
    return _f_exact(d1, d2, p)


@lru_cache(maxsize=1024)
def _f_exact(d1: int, d2: int, p: float) -> float:
    lo, hi = 0.0, 1.0
    while f_cdf(hi, d1, d2) < p:
        lo, hi = hi, hi * 4.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if f_cdf(mid, d1, d2) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-10 * hi:
            break
    return 0.5 * (lo + hi)


def _paulson(d1: int, d2: int, p: float) -> float:
    """Paulson's cube-root approximation of the F quantile (good when d1 and d2 are large)."""
    z = NormalDist().inv_cdf(p)
    a, b = 2.0 / (9.0 * d1), 2.0 / (9.0 * d2)
    qa, qb = (1.0 - b) ** 2 - z * z * b, -2.0 * (1.0 - a) * (1.0 - b)
    qc = (1.0 - a) ** 2 - z * z * a
    disc = max(0.0, qb * qb - 4.0 * qa * qc)
    root = (-qb + math.sqrt(disc)) / (2.0 * qa) if qa > 0 else 1.0
    return float(max(root, 0.0) ** 3)


def _gamma_p(a: float, x: float) -> float:
    """The regularised lower incomplete gamma function P(a, x)."""
    if x <= 0.0:
        return 0.0
    front = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1.0:  # the series
        term = total = 1.0 / a
        for n in range(1, 1000):
            term *= x / (a + n)
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return front * total
    tiny = 1e-300  # the continued fraction for Q = 1 − P (modified Lentz)
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return 1.0 - front * h


@lru_cache(maxsize=256)
def _chi2_quantile(k: int, p: float) -> float:
    """The p-quantile of χ²(k), by bisection on P(k/2, x/2)."""
    lo, hi = 0.0, float(k) + 10.0 * math.sqrt(2.0 * k) + 10.0
    while _gamma_p(k / 2.0, hi / 2.0) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _gamma_p(k / 2.0, mid / 2.0) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def t_limit(p: float, dof: int) -> float:
    """The two-sided critical value of Student's t: P(|t_dof| > limit) = p."""
    return math.sqrt(f_quantile(1, dof, 1.0 - p))


def pool_means(
    means: Sequence[float],
    counts: Sequence[float],
    variance: float,
    dof: int,
    significance: float,
) -> tuple[list[float], list[int]]:
    """Pool the means of groups that the data cannot tell apart.

    `means[i]` averages `counts[i]` measurements whose common variance is estimated as
    `variance` on `dof` degrees of freedom. Sorted by mean, the set is tested for equal
    means (one-way ANOVA: Σ n_i (m_i − m̄)² / variance / (k − 1) against the
    (1 − significance) quantile of F(k − 1, dof)); a set that passes shares its weighted
    mean, a set that fails is split at its largest standardised gap between neighbours and
    each side is tested again. With no spread information (dof 0) nothing is pooled; with
    zero spread only exactly equal means are.

    Returns (each worker's pooled mean, each worker's group number, 0 = lowest means).
    """
    n = len(means)
    order = sorted(range(n), key=lambda i: means[i])
    pooled = list(means)
    group_of = [0] * n
    groups: list[list[int]] = []
    stack = [order]
    while stack:
        members = stack.pop()
        if _same(members, means, counts, variance, dof, significance):
            groups.append(members)
            continue
        gaps = [
            (means[b] - means[a]) / math.sqrt(1.0 / counts[a] + 1.0 / counts[b])
            for a, b in itertools.pairwise(members)
        ]
        cut = max(range(len(gaps)), key=lambda j: gaps[j]) + 1
        stack += [members[cut:], members[:cut]]
    groups.sort(key=lambda g: means[g[0]])
    for number, members in enumerate(groups):
        weight = sum(counts[i] for i in members)
        level = math.fsum(counts[i] * means[i] for i in members) / weight
        for i in members:
            pooled[i] = level if len(members) > 1 else means[i]
            group_of[i] = number
    return pooled, group_of


def _same(
    members: list[int],
    means: Sequence[float],
    counts: Sequence[float],
    variance: float,
    dof: int,
    significance: float,
) -> bool:
    if len(members) == 1:
        return True
    if dof < 1:
        return False
    if variance <= 0.0:
        weight = sum(counts[i] for i in members)
        level = math.fsum(counts[i] * means[i] for i in members) / weight
        return all(abs(means[i] - level) <= 1e-12 * max(1.0, abs(level)) for i in members)
    k = len(members) - 1
    return _statistic(members, means, counts, variance) / k <= f_quantile(
        k, dof, 1.0 - significance
    )


def _statistic(
    members: list[int], means: Sequence[float], counts: Sequence[float], variance: float
) -> float:
    """Σ n_i (m_i − m̄)² / variance: χ²(k − 1) when the k means are equal."""
    weight = sum(counts[i] for i in members)
    level = math.fsum(counts[i] * means[i] for i in members) / weight
    return math.fsum(counts[i] * (means[i] - level) ** 2 for i in members) / variance


# Quadrature of the Zellner–Siow prior on g (below): g = scale²/z² at the midpoints of
# equal-probability bins of |Z|, Z standard normal. 128 nodes put the Bayes factor within
# ~1% of a 16,384-node one on the equal, unequal and stepped sets of tests/benchmarks.
_G_NODES = 128
_ABS_Z = np.array([NormalDist().inv_cdf(0.5 + 0.5 * (j + 0.5) / _G_NODES) for j in range(_G_NODES)])


def alike_probability(
    means: Sequence[float],
    counts: Sequence[float],
    ss: float,
    dof: float,
    scale: float,
) -> float:
    """The posterior probability that the k groups' true means are all equal (prior odds 1:1).

    `means[i]` averages `counts[i]` measurements; `ss` is their within-group sum of squares
    on `dof` degrees of freedom (a prior may be folded in as pseudo-measurements). Against
    "all equal", the alternative is the default Bayesian ANOVA of Rouder et al. (2012,
    "Default Bayes factors for ANOVA designs"): each group's deviation from the common mean
    is N(0, g·σ²) with g ~ InvGamma(1/2, scale²/2), i.e. a Cauchy of scale `scale` (in
    units of one measurement's σ) on each standardised deviation; the common mean is flat,
    σ² has the Jeffreys prior and is integrated out against `ss`. So the answer depends on
    the data only through the spread of the means against the measured noise, the counts
    and `scale`: a spread that noise explains at these counts favours "all equal", and
    does so more strongly the larger `scale` (Lindley's paradox at work: differences much
    smaller than the alternative expects are better explained by noise).

    With no spread information (dof < 1) it is 0 (nothing can be said to be equal); with
    zero spread, 1 for exactly equal means and 0 otherwise.
    """
    k = len(means)
    if k < 2:
        return 1.0
    m = np.asarray(means, dtype=float)
    inverse = 1.0 / np.asarray(counts, dtype=float)  # a mean's variance, in σ² units
    if dof < 1:
        return 0.0
    level = float(np.dot(m, 1.0 / inverse) / np.sum(1.0 / inverse))
    if ss <= 0.0:
        return 1.0 if np.all(np.abs(m - level) <= 1e-12 * max(1.0, abs(level))) else 0.0
    power = 0.5 * (k - 1 + dof)

    def log_likelihood(g: np.ndarray) -> np.ndarray:
        variances = inverse[None, :] + g[:, None]  # (nodes, k)
        weights = 1.0 / variances
        total = weights.sum(axis=1)
        centre = (weights * m).sum(axis=1) / total
        spread = (weights * (m - centre[:, None]) ** 2).sum(axis=1)
        result: np.ndarray = (
            -0.5 * np.log(variances).sum(axis=1) - 0.5 * np.log(total) - power * np.log(spread + ss)
        )
        return result

    null = float(log_likelihood(np.zeros(1))[0])
    ratios = log_likelihood(scale * scale / _ABS_Z**2) - null
    top = float(ratios.max())
    log_bayes = top + math.log(float(np.mean(np.exp(ratios - top))))  # log BF(differ : equal)
    if log_bayes > 700.0:
        return 0.0
    return 1.0 / (1.0 + math.exp(log_bayes))


def mixture_median(level: float, alike: float, se: float, p_alike: float) -> float:
    """The median of p_alike·δ(alike) + (1 − p_alike)·N(level, se²).

    The point estimate of a worker's level when, with probability `p_alike`, it shares
    the common level `alike`, and otherwise is `level` give or take `se`: exactly `alike`
    while that is the more probable (or the two overlap enough), moving continuously to
    `level` as p_alike falls to 0.
    """
    if p_alike <= 0.0:
        return level
    if p_alike >= 1.0:
        return alike
    if se <= 0.0:
        return alike if p_alike >= 0.5 else level
    normal = NormalDist()
    below = (1.0 - p_alike) * normal.cdf((alike - level) / se)  # mass strictly below alike
    if below > 0.5:
        return level + se * normal.inv_cdf(0.5 / (1.0 - p_alike))
    if below + p_alike >= 0.5:
        return alike
    return level + se * normal.inv_cdf((0.5 - p_alike) / (1.0 - p_alike))
