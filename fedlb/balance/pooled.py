"""The default tuner: `PooledProportional`, `Proportional` on estimates pooled across workers
whose speeds (and fixed costs) the reports cannot tell apart, with an optional floor.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from .estimators import Moments, overhead_from_log
from .stats import alike_probability, mixture_median, pool_means
from .tuners import Proportional, TuningInput, renamed

log = logging.getLogger("fedlb.balance")


class PooledProportional(Proportional):
    """`Proportional` on pooled estimates: the default tuner, made for noisy timings.

    Measured times are noisy, so two silos of the same speed never report the same speed,
    and splitting X by the raw estimates chases that noise round after round. Before
    splitting, this tuner asks of the estimates what a dead-band asks of the sizes: is the
    difference real? Workers whose mean log speeds the reports cannot tell apart share one
    speed, their pooled mean; fixed costs are pooled the same way. The test is a one-way
    F-test of the sorted means against the spread the reports themselves show (pooled over
    all workers); a set that fails is split at its largest gap and each side tested again
    (`stats.pool_means`). Equal silos thus get equal sizes, and a worker's share moves
    away from its peers' only once its difference is significant.

    All alike, or not: the noise floor. The F-test is asked anew every round, and at its
    level equal silos are split now and then, and stay split for as long as the noise that
    split them lasts: under 20% timing noise the means of three equal silos' 30 reports each
    still spread by over 2 standard errors in about one run in ten, and 16 of 60 runs kept a
    mean E below 0.97 (worst 0.914). A stricter level saves them and costs the runs that
    must split on the same evidence (a silo 3x slower after a step, 1.33x from its nearest
    peer on its two reports since). What tells the two apart is the whole set: equal silos
    spread as noise does, unequal ones do not. So one more question is asked of all workers
    at once: are they all alike? Its answer is the posterior probability of one level for
    all against the default Bayesian ANOVA alternative (Zellner–Siow, prior odds 1:1:
    `stats.alike_probability`), whose Cauchy prior on real differences has the scale
    `difference_scale`. Against it, a spread of a few percent that noise explains is
    evidence for "all alike", the more so as reports accumulate (Lindley's paradox, here put
    to work), while 1:2:4, or a silo 3x slower, is against it at once. Each worker's level
    is then the posterior median between the common level and its F-test level: the median,
    not the mean, because E is lost in proportion to the slowest silo's error; it is exactly
    the common level while "all alike" is the more probable and moves off it continuously as
    the evidence for a difference grows. First reports (no spread measured yet) are left to
    the F-test on the prior, as before. Measured (benchmarks/noise_floor.py: model clock, σ
    = 0.2, 30 rounds, seeds 0-59 and 100-159): every run of 2, 3 or 5 equal silos keeps a
    mean E ≥ 0.97 (worst 0.971, 0.983, 0.994; before 0.916, 0.914, 0.900); 1:2:4, the spread
    1:1.5:2:4:8 and a 3x step keep their E (none lower, up to 0.002 higher). The price is
    paid by silos within ~20% of each other, kept equal longer: speeds 1:1.1:1.2 lose 0.015
    of E over rounds 4-30.

    It needs estimators that keep their evidence (`ChangePointMean`, the default one);
    for workers whose estimator keeps none it is plain `Proportional`.

    Noise in, nothing out. The spread the test uses is the reports' own, combined with a
    prior worth `prior_weight` reports: timing noise of `speed_noise` (log-sd of one
    report's speed) and `overhead_noise` (of its fixed cost). With one report per worker
    (no spread measured yet) the prior alone decides for speeds: within ~1.5x of each
    other they stay pooled until more rounds show the difference is real (equal silos
    timed at milliseconds of compute, or on a busy machine, keep equal sizes); wider
    differences split at once, as LB-BSP Algorithm 1 does. A fixed cost resting on one
    report is not tested at all: a first round's fixed cost carries one-offs (imports, a
    first allocation, a data load) that no prior noise describes (one of 10 equal silos
    once paid 0.17 s against the rest's 0.002 s and was sent to the floor), so it takes
    the common level of the fixed costs measured more than once (of all first ones, in
    round 1) and counts from its second report (`_pool_costs`). As reports
    accumulate the prior fades, so clean timings (the model clock, emulated speeds) soon
    tell apart speeds a few percent apart. Fixed costs o_i and per-worker iteration counts
    τ_i enter the split as in `Proportional` (B_i = (T − o_i)·v_i/τ_i).

    Args:
        min_batch: as `Proportional`. Default 1.
        max_batch: as `Proportional`. Default None.
        min_share: an accuracy guard: every worker gets at least ⌈min_share·X/n⌉ samples
            (n: the workers present), so no silo's updates rest on a sliver of the global
            batch. X is kept; a min_share that X cannot meet raises ValueError (when the
            manager is built or a worker added; a worker leaving loosens it to X // n with
            a warning instead, so the run goes on). Default 0.0 (no floor). 0.5 (no silo
            below half the uniform batch) guards an app whose learning rate is near the edge
            of stability, at a cost in E wherever a silo runs below half the mean speed:
            docs/experiments.md, "Accuracy at the app's own learning rate".
        significance: the level at which a difference between workers counts as real.
            Default 0.16: about the Akaike break-even for one difference (z² > 2), where
            a separate estimate starts to pay for its noise. Lower pools more (equal silos
            closer to exact, near-equal ones biased longer); higher pools less.
        deadband: keep the current sizes while the new split would shorten the modelled
            round (on the pooled estimates) by less than this fraction. Default 0.01: the
            estimates refine by less than that from round to round, so moves below it are
            mostly sample shuffling (the dynamic-batching paper uses 5% on sizes).
        speed_noise: the prior timing noise, as the log-sd of one report's speed.
            Default 0.2.
        overhead_noise: the same for one report's fixed cost. Default 0.5 (fixed costs,
            which include message handling and process start-up, jitter more than
            compute).
        prior_weight: how many reports the prior counts as (an integer). Default 2.
        difference_scale: the prior scale of real differences between workers, in log
            units (of speed and of fixed cost), for the all-alike test. Default 1.0:
            silos that differ at all differ by about e-fold (1:2:4 federations; LB-BSP's
            GPUs span 15x). 0.5 left one run in 60 of each of 2, 3 and 5 equal silos
            below E 0.97; larger keeps near-equal workers together longer. None: no
            all-alike test (the F-test alone, the default until 2026-11-26).

    The dead-band looks at the workers' own estimates too (a move must help on them):
    for sizes this tuner chose, their own means after the all-alike test; for sizes it did
    not choose (each silo's own B0, a re-division after a worker joined or left), their
    raw means, so that sizes measured balanced (silos of unequal τ at their B0) stay.
    Judged on raw means, a split that noise made was held for as long as the raw means
    favoured it, after the pooling had undone it.
    """

    kind = "pooled-proportional"

    def __init__(
        self,
        min_batch: int = 1,
        max_batch: int | None = None,
        min_share: float = 0.0,
        significance: float = 0.16,
        deadband: float = 0.01,
        speed_noise: float = 0.2,
        overhead_noise: float = 0.5,
        prior_weight: int = 2,
        difference_scale: float | None = 1.0,
    ) -> None:
        super().__init__(min_batch, max_batch)
        if not (math.isfinite(min_share) and 0.0 <= min_share <= 1.0):
            raise ValueError(f"min_share must be in [0, 1], got {min_share}")
        if not 0.0 < significance < 1.0:
            raise ValueError(f"significance must be in (0, 1), got {significance}")
        if not (math.isfinite(deadband) and deadband >= 0.0):
            raise ValueError(f"deadband must be a finite number >= 0, got {deadband}")
        for name, value in (("speed_noise", speed_noise), ("overhead_noise", overhead_noise)):
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if isinstance(prior_weight, bool) or not isinstance(prior_weight, int) or prior_weight < 0:
            raise ValueError(f"prior_weight must be an integer >= 0, got {prior_weight!r}")
        if difference_scale is not None and not (
            math.isfinite(difference_scale) and difference_scale > 0.0
        ):
            raise ValueError(
                f"difference_scale must be a finite number > 0 or None, got {difference_scale}"
            )
        self.difference_scale = difference_scale
        self.speed_noise = speed_noise
        self.overhead_noise = overhead_noise
        self.prior_weight = prior_weight
        self.min_share = min_share
        self.significance = significance
        self.deadband = deadband
        self.floor = min_batch
        self.groups: dict[str, int] = {}  # the last step's speed groups (0 = slowest)
        # The sizes this tuner last moved to: sizes in force that it did not choose (each
        # silo's own B0, a re-division after a worker joined) are guarded (`propose`).
        self.moved_to: dict[str, int] = {}

    def set_population(self, total: int, workers: int, strict: bool = True) -> None:
        floor = max(self.min_batch, math.ceil(self.min_share * total / workers - 1e-9))
        if floor * workers > total and not strict and self.min_batch * workers <= total:
            log.warning(
                "min_share=%g cannot give each of %d workers %d samples out of X = %d; "
                "the floor is %d (an equal split) until the number of workers changes",
                self.min_share,
                workers,
                floor,
                total,
                total // workers,
            )
            floor = max(self.min_batch, total // workers)
        if floor * workers > total:
            bound = f"min_batch={self.min_batch}" + (
                f" with min_share={self.min_share:g}" if self.min_share > 0 else ""
            )
            raise ValueError(
                f"cannot divide a total of {total} among {workers} workers: {bound} needs at "
                f"least {floor} samples for each ({floor * workers} in all); lower "
                + ("min_share or min_batch" if self.min_share > 0 else "min_batch")
                + ", or raise the total"
            )
        if self.max_batch is not None and self.max_batch < floor:
            raise ValueError(
                f"min_share={self.min_share:g} needs at least {floor} samples per worker, "
                f"above max_batch={self.max_batch}"
            )
        self.floor = floor

    def bounds(self, worker: str) -> tuple[int, float]:
        return self.floor, math.inf if self.max_batch is None else self.max_batch

    def within_bounds(self, sizes: Mapping[str, int]) -> bool:
        """Whether every worker's size is within its bounds (a dead-band may keep them)."""
        return all(self.bounds(n)[0] <= b <= self.bounds(n)[1] for n, b in sizes.items())

    def propose(self, given: TuningInput) -> dict[str, int]:
        found = self._estimates(given)
        speeds, overheads = found.speeds, found.overheads
        proposal = self._split(given, speeds, overheads)
        if self.deadband > 0 and self.within_bounds(given.sizes):
            now = _modelled(given, given.sizes, speeds, overheads)
            then = _modelled(given, proposal, speeds, overheads)
            if now <= then * (1.0 + self.deadband):
                return dict(given.sizes)
            # The workers' own estimates must agree that the move helps: pooled speeds
            # cannot tell silos apart, but sizes whose measured times were equal (silos
            # of unequal τ at their own B0, say) are balanced whatever pooling says. For
            # sizes this tuner chose itself, "own" is taken after the all-alike test
            # (`_pool`): the raw means would hold on to a split that noise made, and that
            # the evidence no longer supports, for as long as the noise lasts.
            own_speeds: Mapping[str, float] = found.own_speeds
            own_overheads: Mapping[str, float] = found.own_overheads
            if not self.chose(given.sizes):
                own_speeds, own_overheads = given.speeds, given.overheads
            measured_now = _modelled(given, given.sizes, own_speeds, own_overheads)
            measured_then = _modelled(given, proposal, own_speeds, own_overheads)
            if measured_now <= measured_then * (1.0 + self.deadband):
                return dict(given.sizes)
        return self.moving(proposal)

    def chose(self, sizes: Mapping[str, int]) -> bool:
        """Whether `sizes` are those this tuner last moved these workers to (not each
        silo's own B0, nor a re-division after a worker joined or left)."""
        return all(self.moved_to.get(n) == b for n, b in sizes.items())

    def moving(self, proposal: dict[str, int]) -> dict[str, int]:
        """Note a move to `proposal` (see `chose`) and return it."""
        self.moved_to.update(proposal)
        return proposal

    def pooled(self, given: TuningInput) -> tuple[dict[str, float], dict[str, float]]:
        """(speeds, fixed costs) with workers that cannot be told apart sharing one value."""
        found = self._estimates(given)
        return found.speeds, found.overheads

    def _estimates(self, given: TuningInput) -> _Estimates:
        speeds, overheads = dict(given.speeds), dict(given.overheads)
        own_speeds, own_overheads = dict(given.speeds), dict(given.overheads)
        known = [n for n in given.names if n in given.evidence]
        self.groups = {}
        if len(known) >= 2:
            pooled = self._pool([given.evidence[n].speed for n in known], self.speed_noise)
            self.groups = dict(zip(known, pooled.groups, strict=True))
            for name, level, own in zip(known, pooled.levels, pooled.own, strict=True):
                speeds[name], own_speeds[name] = math.exp(level), math.exp(own)
            costs = [(n, given.evidence[n].overhead) for n in known]
            with_cost = [(n, m) for n, m in costs if m is not None]
            if len(with_cost) >= 2:
                pooled = self._pool_costs([m for _, m in with_cost])
                for (name, _), level, own in zip(with_cost, pooled.levels, pooled.own, strict=True):
                    overheads[name] = overhead_from_log(level)
                    own_overheads[name] = overhead_from_log(own)
        return _Estimates(speeds, overheads, own_speeds, own_overheads)

    def _pool_costs(self, found: list[Moments]) -> _Levels:
        """Fixed costs pooled as speeds are, but a fixed cost resting on one report (a
        worker's first round: imports, a first allocation, a data load, one-offs that no
        prior noise describes) takes the common level of those measured more than once,
        or of all when none is: it counts from the worker's second report."""
        seen = [i for i, m in enumerate(found) if m.dof >= 1]
        if len(seen) == len(found):
            return self._pool(found, self.overhead_noise)
        basis = [found[i] for i in seen] or found
        common = _weighted_mean(basis)
        levels, own, groups = [common] * len(found), [common] * len(found), [0] * len(found)
        if len(seen) >= 2:  # (one alone is the common level)
            pooled = self._pool(basis, self.overhead_noise)
            for k, i in enumerate(seen):
                levels[i], own[i], groups[i] = pooled.levels[k], pooled.own[k], pooled.groups[k]
        return _Levels(levels, groups, own)

    def _pool(self, found: list[Moments], noise: float) -> _Levels:
        # The spread: the reports' own pooled over workers, with the prior's weight
        # (a scaled-inverse-chi-squared prior: prior_weight reports at noise²).
        prior = self.prior_weight if noise > 0 else 0
        measured = sum(m.dof for m in found)
        dof = measured + prior
        ss = math.fsum(m.ss for m in found) + prior * noise**2
        variance = ss / dof if dof > 0 else 0.0
        means = [m.mean for m in found]
        counts = [m.count for m in found]
        levels, groups = pool_means(means, counts, variance, dof, self.significance)
        if self.difference_scale is None or measured < 1 or variance <= 0.0:
            # First reports (no spread measured yet): the F-test on the prior decides.
            return _Levels(levels, groups, means)
        # All alike, or not (the class docstring says why): each worker's posterior median
        # between the common level and its level from the F-test (or, for `own`, its own).
        alike = alike_probability(
            means, counts, ss, dof, self.difference_scale / math.sqrt(variance)
        )
        common = _weighted_mean(found)
        weight = [0.0] * (max(groups) + 1)
        for group, count in zip(groups, counts, strict=True):
            weight[group] += count
        levels = [
            mixture_median(level, common, math.sqrt(variance / weight[group]), alike)
            for level, group in zip(levels, groups, strict=True)
        ]
        if all(level == common for level in levels):
            groups = [0] * len(levels)
        own = [
            mixture_median(m, common, math.sqrt(variance / c), alike)
            for m, c in zip(means, counts, strict=True)
        ]
        return _Levels(levels, groups, own)

    def forget(self, worker: str) -> None:
        super().forget(worker)
        self.groups.pop(worker, None)
        self.moved_to.pop(worker, None)

    def rename_workers(self, names: Mapping[str, str]) -> None:
        super().rename_workers(names)
        self.groups = renamed(self.groups, names)
        self.moved_to = renamed(self.moved_to, names)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "floor": self.floor,
            "min_share": self.min_share,  # a guard may have raised it during the run
            "groups": dict(self.groups),
            "moved_to": dict(self.moved_to),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.floor = int(state["floor"])
        self.min_share = float(state.get("min_share", self.min_share))
        self.groups = {n: int(g) for n, g in state["groups"].items()}
        # A state from before moved_to: the sizes in force are guarded until the next move.
        self.moved_to = {n: int(b) for n, b in state.get("moved_to", {}).items()}


def _weighted_mean(found: list[Moments]) -> float:
    return math.fsum(m.count * m.mean for m in found) / sum(m.count for m in found)


class _Levels(NamedTuple):
    """One quantity's pooled log levels, the workers' groups, and each worker's own level
    after the all-alike test only (no F-test pooling)."""

    levels: list[float]
    groups: list[int]
    own: list[float]


class _Estimates(NamedTuple):
    speeds: dict[str, float]
    overheads: dict[str, float]
    own_speeds: dict[str, float]
    own_overheads: dict[str, float]


def _modelled(
    given: TuningInput,
    sizes: Mapping[str, int],
    speeds: Mapping[str, float],
    overheads: Mapping[str, float],
) -> float:
    return max(overheads[n] + given.iterations[n] * sizes[n] / speeds[n] for n in given.names)
