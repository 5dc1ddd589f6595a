"""LoadBalancedFedAvg's own options, grouped by what they decide, so that its constructor
reads like Flower's FedAvg: FedAvg's arguments, then a few fedlb groups, each documented
with its defaults here."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlb.balance import BatchSizeManager, StabilityGuard

from .records import RoundReporter

# (initial sizes) -> the balancer; BatchSizeManager itself gives fedlb's default.
Balancer = Callable[[Mapping[str, int]], BatchSizeManager]

# What a run the guard finds at the edge of stability runs from its verdict on (`Balancing.edge`)
EDGE_LEVERS = ("steps", "uniform")


@dataclass(frozen=True)
class Balancing:
    """How each silo's batch size is decided.

    Attributes:
        batch_size: B0 for every silo instead of each silo's own loader's. Default None.
        local_steps: τ for every silo instead of the steps its loop runs. Default None.
        balancer: makes the balancer from the initial sizes. Default `BatchSizeManager`
            (fedlb's default tuner and estimator: fedlb.balance.defaults).
        guard: keeps balancing from costing the model (`StabilityGuard`). Every silo starts
            at ≥ half the mean batch; the first round at unequal sizes probes the app (each
            silo's update per step against its own at equal sizes): calm, and confirmed by
            the next round (or clearly calm at once), the run is stable and the floor drops
            to a quarter of the mean batch (full balance wherever no silo needs less);
            scattered, it is at the edge of stability and keeps the app's own batch sizes
            from then on (smaller batches at its learning rate cost accuracy). An update that
            blew up (norm per step not finite or 5x its peers' and its own, an update of NaN
            or infinity, or a non-finite loss) is left out of the round's average; before
            the verdict that means the edge, after it the floor rises a step. What a run at
            the edge runs is `edge`'s. The verdict is
            in the log, every round record (`guard`, `guard_floor`, `guard_probe`) and
            summary.json (`stability`). It reads the update norm `balance_mod()` reports
            (under HE too, with `he_mod()` outside it) and the app's train loss metric. A
            higher `min_share` of the balancer's tuner stays. Default True (fedlb's guard);
            False: none (sizes fully balanced from round 2); or a `StabilityGuard` of your
            own (`probe=0`: the floor always, whatever the probe would say).
        profiles: when this machine's server has balanced this model before, ask the silos
            for their stored speed profiles before round 1 (one train message without a
            model, answered by `balance_mod()` without the app) and start round 1 balanced;
            a profile the round finds off by more than 30% is said to be stale
            (fedlb.flower.profiles). Default False (a run's first round then never depends
            on earlier runs).
        edge: what a run the guard finds at the edge of stability runs from its verdict on.
            Default "steps": every silo at its own batch size (each step as noisy as a stock
            round's), the slow silos' local steps cut so that all finish together, and each
            update normalized by its steps before the wrapped strategy sees it (FedNova:
            fedlb.balance.steps); under HE (no plaintext update to normalize) it runs as
            "uniform". "uniform": the app's own batch sizes and steps, unbalanced (fedlb's
            behaviour before the second lever).
    """

    batch_size: int | None = None
    local_steps: int | None = None
    balancer: Balancer = BatchSizeManager
    guard: StabilityGuard | bool = True
    profiles: bool = False
    edge: str = "steps"

    def __post_init__(self) -> None:
        if self.edge not in EDGE_LEVERS:
            raise ValueError(f"edge must be one of {', '.join(EDGE_LEVERS)}, got {self.edge!r}")
        for name in ("batch_size", "local_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")

    def make_guard(self) -> StabilityGuard | None:
        if isinstance(self.guard, StabilityGuard):
            return self.guard
        return StabilityGuard() if self.guard else None


@dataclass(frozen=True)
class Joining:
    """Which silos take part.

    Attributes:
        expected_silos: silos to wait for before round 1. Default None: FedAvg's
            `min_available_nodes`.
        join_timeout: seconds to wait for them before giving up. Default 600.
        rejoin_grace: seconds a silo that missed a round is left out while the SuperLink
            still lists it (a killed SuperNode stays listed until its heartbeats lapse,
            Flower: 2 x 30 s). Default 60. X = Σ B0 of the silos present: one that leaves
            takes its B0 out, one that comes back brings it again, with a new speed estimate.
        examples: each silo's example count (the weighting key's value, `num-examples` by
            default) by silo label ("silo-0", ...), as the operator knows it: a silo that
            claims another is refused and weighs this. Default None: each silo's first claim
            is pinned for the run (fedlb.flower.claims).
        max_share: the most of the average any one silo's update may weigh (0 < share <= 1);
            a silo whose claim would weigh more is lowered to it. Default None: no cap (a
            silo that outweighs all others together is named every round until a cap or
            declared counts settle it).
    """

    expected_silos: int | None = None
    join_timeout: float = 600.0
    rejoin_grace: float = 60.0
    examples: Mapping[str, int] | None = None
    max_share: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rejoin_grace) and self.rejoin_grace >= 0):
            raise ValueError(f"rejoin_grace must be a finite number >= 0, got {self.rejoin_grace}")
        if self.max_share is not None and not 0 < self.max_share <= 1:
            raise ValueError(f"max_share must be None or in (0, 1], got {self.max_share!r}")


@dataclass(frozen=True)
class Keeping:
    """What the run keeps, beside Flower's `Result`.

    Attributes:
        reporter: where round records go. Default None: a `RoundReporter` that keeps them.
        checkpoint_dir: checkpoint.npz there after every round (see `restore`). Default None.
        run_settings: the run's settings, stored in checkpoints. Default empty.
        audit_dir: every round's updates, weights and aggregate to audit_dir/round-K.npz.
            Default None.
    """

    reporter: RoundReporter | None = None
    checkpoint_dir: Path | None = None
    run_settings: Mapping[str, Any] = field(default_factory=dict)
    audit_dir: Path | None = None
