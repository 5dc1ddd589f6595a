"""StabilityGuard: balancing must never cost a user their model.

Unequal batch sizes at the app's own learning rate can tip an app that runs near the edge
of stability: the silo given the smallest batch takes the noisiest steps (its SGD noise
grows as η/B with η and τ kept), and a network that dies in one round stays dead (every
silo starts from the dead model; FedAvg cannot leave it). Measured on Flower's quickstart
at its own η = 0.1 (SGD, momentum 0.9), speeds 1:2:4, 60 seeds, 8 rounds
(docs/experiments.md, "The default's guard"): fully balanced sizes (14/27/55) end at
0.53 ± 0.26 with 10 dead networks, stock FedAvg 0.74 ± 0.22 with 3; a floor of half the
mean batch (16/26/54) 0.62 ± 0.21 with 4. Guards that moved the floor with the training
(down while the loss falls, up when it rises) did worse than the fixed floor (6-9 dead):
at the edge of stability every change of sizes re-rolls the dice.

So the guard is a fixed floor plus a reaction to blow-ups:
- every silo gets at least `floors[0]` of the mean batch (default 0.5), so no silo's
  updates rest on a sliver of the global batch. At speeds where the slowest silo runs at
  half the mean speed or more it does not bind (E = 1); below, it caps the per-round
  speed-up over FedAvg at 1/floor (2x);
- an update *diverged* when its norm per local step is not finite, or more than `ratio`
  times the larger of its peers' median this round and its own recent median, or when
  the silo's training loss is not finite. A diverged update is left out of the round's
  average (as a silo that did not answer would be) and the floor rises one step (0.75,
  then uniform sizes), so the sizes that tipped the model are not tried again.
The silos report their update norm (`balance_mod`) and their loss (the app's own
metric); both travel in the clear, so the guard works under HE too.
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
    floor_before: float = 0.0
    floor: float = 0.0  # the floor from now on

    @property
    def moved(self) -> bool:
        return self.floor != self.floor_before


class StabilityGuard:
    """A floor on every silo's share of the mean batch, raised when an update diverges.

    Args:
        floors: the floor's steps, each a share of the mean batch, rising; the run starts
            at the first. Default (0.5, 0.75, 1.0).
        ratio: an update diverged when its norm per local step exceeds `ratio` times its
            reference (the larger of its peers' median this round and its own recent
            median). Default 5.0: balanced silos' updates run up to ~2x their peers'
            (docs/experiments.md); leaving an update out perturbs the run as well, so only
            a blow-up counts.
    """

    def __init__(self, floors: Sequence[float] = (0.5, 0.75, 1.0), ratio: float = 5.0) -> None:
        if not floors or any(not 0.0 <= f <= 1.0 for f in floors):
            raise ValueError(f"floors must lie within [0, 1], got {list(floors)}")
        if list(floors) != sorted(floors):
            raise ValueError(f"floors must rise, got {list(floors)}")
        if not (math.isfinite(ratio) and ratio > 1.0):
            raise ValueError(f"ratio must be a finite number > 1, got {ratio}")
        self.floors = list(floors)
        self.ratio = ratio
        self.level = 0
        self.norms: dict[str, list[float]] = {}

    @property
    def floor(self) -> float:
        """The share of the mean batch every silo gets at least now."""
        return self.floors[self.level]

    def check(
        self, norms: Mapping[str, float], losses: Mapping[str, float] | None = None
    ) -> Verdict:
        """One round's update norms per local step and training losses, by silo: the
        diverged updates, and the floor from now on (one step up if any diverged)."""
        verdict = Verdict(diverged=self._diverged(norms), floor_before=self.floor)
        for name, loss in (losses or {}).items():
            if not math.isfinite(loss):
                verdict.diverged.setdefault(name, f"its training loss is {loss}")
        if verdict.diverged:
            self.level = min(self.level + 1, len(self.floors) - 1)
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

    def forget(self, name: str) -> None:
        self.norms.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "norms": {n: list(h) for n, h in self.norms.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.level = min(int(state["level"]), len(self.floors) - 1)
        self.norms = {n: [float(v) for v in h] for n, h in state["norms"].items()}
