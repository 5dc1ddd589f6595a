"""The default tuner: `PooledProportional`, `Proportional` on estimates pooled across workers
whose speeds (and fixed costs) the reports cannot tell apart, with an optional floor.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from .estimators import Moments, overhead_from_log
from .stats import pool_means
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

    It needs estimators that keep their evidence (`ChangePointMean`, the default one);
    for workers whose estimator keeps none it is plain `Proportional`.

    Noise in, nothing out. The spread the test uses is the reports' own, combined with a
    prior worth `prior_weight` reports: timing noise of `speed_noise` (log-sd of one
    report's speed) and `overhead_noise` (of its fixed cost). With one report per worker
    (no spread measured yet) the prior alone decides: speeds within ~1.5x of each other,
    fixed costs within ~2.5x, stay pooled until more rounds show the difference is real
    (equal silos timed at milliseconds of compute, or on a busy machine, keep equal
    sizes); wider differences split at once, as LB-BSP Algorithm 1 does. As reports
    accumulate the prior fades, so clean timings (the model clock, emulated speeds) soon
    tell apart speeds a few percent apart. Fixed costs o_i and per-worker iteration counts
    τ_i enter the split as in `Proportional` (B_i = (T − o_i)·v_i/τ_i).

    Args:
        min_batch, max_batch: as `Proportional`. Defaults 1 and None.
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
        speed_noise, overhead_noise: the prior timing noise, as the log-sd of one report's
            speed and fixed cost. Defaults 0.2 and 0.5 (fixed costs, which include message
            handling and process start-up, jitter more than compute).
        prior_weight: how many reports the prior counts as (an integer). Default 2.
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
        self.speed_noise = speed_noise
        self.overhead_noise = overhead_noise
        self.prior_weight = prior_weight
        self.min_share = min_share
        self.significance = significance
        self.deadband = deadband
        self.floor = min_batch
        self.groups: dict[str, int] = {}  # the last step's speed groups (0 = slowest)

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
        speeds, overheads = self.pooled(given)
        proposal = self._split(given, speeds, overheads)
        if self.deadband > 0 and self.within_bounds(given.sizes):
            now = _modelled(given, given.sizes, speeds, overheads)
            then = _modelled(given, proposal, speeds, overheads)
            if now <= then * (1.0 + self.deadband):
                return dict(given.sizes)
            # The measurements themselves must agree that the move helps: pooled speeds
            # cannot tell silos apart, but sizes whose measured times were equal (silos
            # of unequal τ, say) are balanced whatever pooling says.
            measured_now = _modelled(given, given.sizes, given.speeds, given.overheads)
            measured_then = _modelled(given, proposal, given.speeds, given.overheads)
            if measured_now <= measured_then * (1.0 + self.deadband):
                return dict(given.sizes)
        return proposal

    def pooled(self, given: TuningInput) -> tuple[dict[str, float], dict[str, float]]:
        """(speeds, fixed costs) with workers that cannot be told apart sharing one value."""
        speeds, overheads = dict(given.speeds), dict(given.overheads)
        known = [n for n in given.names if n in given.evidence]
        self.groups = {}
        if len(known) >= 2:
            found = [given.evidence[n].speed for n in known]
            levels, groups = self._pool(found, self.speed_noise)
            self.groups = dict(zip(known, groups, strict=True))
            for name, level in zip(known, levels, strict=True):
                speeds[name] = math.exp(level)
            costs = [(n, given.evidence[n].overhead) for n in known]
            with_cost = [(n, m) for n, m in costs if m is not None]
            if len(with_cost) >= 2:
                levels, _ = self._pool([m for _, m in with_cost], self.overhead_noise)
                for (name, _), level in zip(with_cost, levels, strict=True):
                    overheads[name] = overhead_from_log(level)
        return speeds, overheads

    def _pool(self, found: list[Moments], noise: float) -> tuple[list[float], list[int]]:
        # The spread: the reports' own pooled over workers, with the prior's weight
        # (a scaled-inverse-chi-squared prior: prior_weight reports at noise²).
        prior = self.prior_weight if noise > 0 else 0
        measured = sum(m.dof for m in found)
        dof = measured + prior
        ss = math.fsum(m.ss for m in found) + prior * noise**2
        variance = ss / dof if dof > 0 else 0.0
        return pool_means(
            [m.mean for m in found],
            [m.count for m in found],
            variance,
            dof,
            self.significance,
        )

    def forget(self, worker: str) -> None:
        super().forget(worker)
        self.groups.pop(worker, None)

    def rename_workers(self, names: Mapping[str, str]) -> None:
        super().rename_workers(names)
        self.groups = renamed(self.groups, names)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "floor": self.floor,
            "min_share": self.min_share,  # a guard may have raised it during the run
            "groups": dict(self.groups),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.floor = int(state["floor"])
        self.min_share = float(state.get("min_share", self.min_share))
        self.groups = {n: int(g) for n, g in state["groups"].items()}


def _modelled(
    given: TuningInput,
    sizes: Mapping[str, int],
    speeds: Mapping[str, float],
    overheads: Mapping[str, float],
) -> float:
    return max(overheads[n] + given.iterations[n] * sizes[n] / speeds[n] for n in given.names)
