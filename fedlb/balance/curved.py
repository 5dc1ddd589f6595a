"""`CurvePooled`: the pooled tuner on measured step-time curves where one speed is wrong.

`PooledProportional` splits X by one speed per worker (t = o + τ·B/v). That is right for a
CPU in its linear range and for emulated silos, and wrong for a GPU (flat from B = 1 to
B ≈ 1000) or a CPU at small B (a per-step floor): a speed read at one size is a guess at
another. This tuner keeps every worker's seconds per step by the sizes it has run
(`ObservedSteps`), and as long as those measurements agree with one speed per worker it is
exactly `PooledProportional` (its pooling, its dead-band, its floor). Once a worker's
measurements show that one speed cannot describe it (the slope of log t on log B short of
1 by more than timing noise explains: `StepModel.nonlinear`), it splits X on the curves:
the integer sizes that minimise the slowest worker's predicted o_i + τ_i·t_i(B_i).

Where a curve is flat the split explores by itself: beyond the sizes a worker has run, its
curve is extrapolated with the elasticity its two nearest measured sizes show, between
t ∝ B^0.25 and t ∝ B (`ObservedSteps`), so a GPU whose time did not grow with its last move
is given more, one measured move at a time, until its time rises or the others reach
their floors. It settles when the prediction no longer promises a round shorter by more
than the dead-band.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from .observed import ObservedSteps
from .pooled import PooledProportional
from .split import monotone_split
from .tuners import TuningInput, renamed


class CurvePooled(PooledProportional):
    """`PooledProportional`, on measured step-time curves once one speed is shown wrong.

    Takes `PooledProportional`'s arguments (min_batch, max_batch, min_share, significance,
    deadband, speed_noise, overhead_noise, prior_weight); `speed_noise` also sets how far
    a curve must depart from one speed before the curves decide.
    """

    kind = "curve-pooled"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.observed: dict[str, ObservedSteps] = {}
        self.on_curves = False  # whether the last step split on the curves

    def propose(self, given: TuningInput) -> dict[str, int]:
        for name, report in given.reports.items():
            if report.iterations > 0 and report.compute_s > 0:
                steps = self.observed.setdefault(name, ObservedSteps())
                steps.observe(report.batch_size, report.compute_s / report.iterations)
        models = {n: self.observed[n].predictor() for n in given.names if n in self.observed}
        noise = self.timing_noise()
        curved = {n for n, m in models.items() if m.nonlinear(noise)}
        self.on_curves = bool(curved)
        if not self.on_curves:
            return super().propose(given)
        # A worker whose own measurements agree with one speed keeps its pooled speed
        # (averaged over every size it ran, and pooled with its peers'); only the others
        # are described by their curves.
        speeds, overheads = self.pooled(given)

        def step_s(name: str, size: float) -> float:
            return models[name].seconds(size) if name in curved else size / speeds[name]

        def round_s(name: str, size: float) -> float:
            return overheads[name] + given.iterations[name] * step_s(name, size)

        proposal = self._split_on_curves(given, round_s)
        now = max(round_s(n, b) for n, b in given.sizes.items())
        then = max(round_s(n, b) for n, b in proposal.items())
        if now <= then * (1.0 + self.deadband) and self.within_bounds(given.sizes):
            return dict(given.sizes)
        return self.moving(proposal)

    def timing_noise(self) -> float:
        """The log-sd of one step-time measurement: what repeated sizes showed, pooled over
        workers, with the prior (`speed_noise`, worth `prior_weight` repeats) where they
        showed little. Clean timings (a GPU's, the model clock's) let curves decide soon;
        noisy ones make them wait for departures that noise cannot explain."""
        ss = math.fsum(o.noise_ss for o in self.observed.values())
        dof = sum(o.noise_dof for o in self.observed.values())
        prior = self.prior_weight
        return math.sqrt((ss + prior * self.speed_noise**2) / (dof + prior)) if dof + prior else 0.0

    def _split_on_curves(
        self, given: TuningInput, round_s: Callable[[str, float], float]
    ) -> dict[str, int]:
        """The integer split of X that minimises the slowest predicted round
        (`split.monotone_split`, exact for non-decreasing times), within the bounds."""
        names = given.names

        def bounded(name: str) -> Callable[[int], float]:
            highest = self.bounds(name)[1]
            return lambda size: math.inf if size > highest else round_s(name, size)

        sizes = monotone_split([bounded(n) for n in names], given.total, int(self.floor))
        return dict(zip(names, sizes, strict=True))

    def forget(self, worker: str) -> None:
        super().forget(worker)
        self.observed.pop(worker, None)

    def rename_workers(self, names: Mapping[str, str]) -> None:
        super().rename_workers(names)
        self.observed = renamed(self.observed, names)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "observed": {n: steps.state_dict() for n, steps in self.observed.items()},
            "on_curves": self.on_curves,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.observed = {
            n: ObservedSteps.from_state(points) for n, points in state.get("observed", {}).items()
        }
        self.on_curves = bool(state.get("on_curves", False))
