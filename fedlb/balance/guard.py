"""StabilityGuard: balancing must never cost a user their model.

Unequal batch sizes at the app's own learning rate can tip an app that runs near the edge
of stability: the silo given the smallest batch takes the noisiest steps (its SGD noise
grows as η/B with η and τ kept), and a network that dies in one round stays dead (every
silo starts from the dead model; FedAvg cannot leave it). Measured on Flower's quickstart
at its own η = 0.1 (SGD, momentum 0.9), speeds 1:2:4, 60 seeds, 8 rounds
(docs/experiments.md, "The default's guard"): fully balanced sizes (14/27/55) end at
0.53 ± 0.26 with 10 dead networks, stock FedAvg 0.74 ± 0.22 with 3; a floor of half the
mean batch (16/26/54) 0.62 ± 0.21 with 4. At that edge the outcome is chaotic: one
sample more or less in one silo's batch re-rolls a run, so only distributions over many
seeds say anything.

So by default every silo gets at least half the mean batch (`floors[start]`), and an
update that *diverged* (its norm per step not finite, or more than `ratio` times the
larger of its peers' median and its own recent median; or a non-finite training loss)
is left out of the round's average and the floor goes up one step (0.75, then uniform
sizes). Guards that moved the floor with the training did no better at the edge (any
change of sizes re-rolls the dice there), but one round tells a stable run apart: the
first at unequal sizes, early in training where a step follows the gradient more than
its noise. At a stable learning rate the silos then move the model by about the same
amount per step whatever their batch (coefficient of variation of their update norms per
step ≤ 0.13 at η = 0.03 on the quickstart, 60 seeds); at the edge their local runs
scatter (median 0.32 at η = 0.1, the big batches' momentum running away from the small
ones'). With `probe` set, a first unequal round calmer than `probe` takes the floor off
(full balance, as LB-BSP publishes it). Later rounds do not move it: once gradient noise
dominates a step (a step then scales as 1/√B), the dispersion grows with unequal sizes at
every learning rate. It is not the default: at η = 0.03 full balance costs 0.02 of
final accuracy after 8 rounds (docs/experiments.md).

The silos report their update norm (`balance_mod`) and their loss (the app's own metric);
both travel in the clear, so the guard works under HE too.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

HISTORY = 5  # a silo's own recent update norms kept for its reference


@dataclass
class Verdict:
    """What the guard made of one round."""

    diverged: dict[str, str] = field(default_factory=dict)  # silo -> why
    dispersion: float | None = None  # coefficient of variation of the norms per step
    look: str = "steady"  # calm (the probe took the floor off), steady or diverged
    floor_before: float = 0.0
    floor: float = 0.0  # the floor from now on


class StabilityGuard:
    """A floor on every silo's share of the mean batch, raised when an update diverges.

    Args:
        floors: the floor's steps, each a share of the mean batch, rising. Default
            (0.0, 0.25, 0.5, 0.75, 1.0): from full balance to uniform sizes.
        start: the step a run starts at. Default 2 (0.5).
        probe: the first round at unequal sizes with a dispersion (coefficient of
            variation of the silos' update norms per step) below `probe` lowers the floor
            to `floors[0]`. Default 0.0: never. Measured on the quickstart (60 seeds,
            1:2:4): `probe=0.15` gives E 0.980 at η = 0.03 (0.904 ± 0.028 final accuracy
            against the fixed floor's 0.911 ± 0.024, stock's 0.925 ± 0.020), and at the
            edge (η = 0.1) 4 of 60 dead against the fixed floor's 3.
    The defaults are a fixed floor of half the mean batch that rises only when an update
    diverges.
        ratio: an update diverged when its norm per local step exceeds `ratio` times its
            reference (the larger of its peers' median this round and its own recent
            median). Default 5.0: balanced silos' updates run up to ~2x their peers'
            (docs/experiments.md); leaving an update out perturbs the run as well, so only
            a blow-up counts.
    """

    def __init__(
        self,
        floors: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
        start: int = 2,
        ratio: float = 5.0,
        probe: float = 0.0,
    ) -> None:
        if not floors or any(not 0.0 <= f <= 1.0 for f in floors):
            raise ValueError(f"floors must lie within [0, 1], got {list(floors)}")
        if list(floors) != sorted(floors):
            raise ValueError(f"floors must rise, got {list(floors)}")
        if not 0 <= start < len(floors):
            raise ValueError(f"start must index floors (0..{len(floors) - 1}), got {start}")
        if not 0.0 <= probe < 1.0:
            raise ValueError(f"probe must lie within [0, 1), got {probe}")
        if not (math.isfinite(ratio) and ratio > 1.0):
            raise ValueError(f"ratio must be a finite number > 1, got {ratio}")
        self.floors = list(floors)
        self.level = start
        self.ratio = ratio
        self.probe = probe
        self.probed = False  # the first round at unequal sizes has been judged
        self.norms: dict[str, list[float]] = {}

    @property
    def floor(self) -> float:
        """The share of the mean batch every silo gets at least now."""
        return self.floors[self.level]

    def check(
        self,
        norms: Mapping[str, float],
        losses: Mapping[str, float] | None = None,
        sizes: Mapping[str, int] | None = None,
    ) -> Verdict:
        """One round's update norms per local step, training losses and batch sizes, by
        silo: the diverged updates, how the round looked, and the floor from now on."""
        verdict = Verdict(diverged=self._diverged(norms), floor_before=self.floor)
        for name, loss in (losses or {}).items():
            if not math.isfinite(loss):
                verdict.diverged.setdefault(name, f"its training loss is {loss}")
        kept = [v for n, v in norms.items() if n not in verdict.diverged]
        mean = statistics.fmean(kept) if len(kept) >= 2 else 0.0
        verdict.dispersion = statistics.pstdev(kept) / mean if mean > 0 else None
        unequal = bool(sizes) and len(set((sizes or {}).values())) > 1
        probing = unequal and not self.probed  # round 1, at equal sizes, says nothing
        self.probed = self.probed or unequal
        if verdict.diverged:
            verdict.look = "diverged"
            self.level = min(self.level + 1, len(self.floors) - 1)
        elif probing and verdict.dispersion is not None and verdict.dispersion < self.probe:
            verdict.look = "calm"
            self.level = 0
        verdict.floor = self.floor
        return verdict

    def _diverged(self, norms: Mapping[str, float]) -> dict[str, str]:
        diverged: dict[str, str] = {}
        for name, norm in norms.items():
            if not math.isfinite(norm):
                diverged[name] = f"its update is not finite ({norm})"
                continue
            references = []
            others = [v for n, v in norms.items() if n != name and math.isfinite(v)]
            if others:
                references.append(statistics.median(others))
            if self.norms.get(name):
                references.append(statistics.median(self.norms[name]))
            reference = max(references, default=0.0)
            if reference > 0 and norm > self.ratio * reference:
                diverged[name] = (
                    f"its update per step is {norm / reference:.1f}x its reference "
                    f"({norm:.3g} against {reference:.3g}: the larger of its peers' median "
                    "and its own recent one)"
                )
        for name, norm in norms.items():
            if name not in diverged:
                self.norms[name] = [*self.norms.get(name, []), norm][-HISTORY:]
        return diverged

    def resume_at(self, share: float) -> None:
        """Go on from a restored run's floor: the lowest step at or above `share`."""
        self.level = next(
            (i for i, f in enumerate(self.floors) if f >= share - 1e-9), len(self.floors) - 1
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "norms": {n: list(h) for n, h in self.norms.items()},
            "probed": self.probed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.level = min(int(state["level"]), len(self.floors) - 1)
        self.norms = {n: [float(v) for v in h] for n, h in state["norms"].items()}
        self.probed = bool(state.get("probed", False))
