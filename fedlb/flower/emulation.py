"""Emulated silos: one machine standing in for many, every output naming its clock.

A silo emulates a speed (samples/s) or a measured step-time curve (fedlb.training's
STEP_CURVES), as its node config or the run config says (`protocol.read_emulation`), on
one of two clocks:
- `measured`: each step is padded with sleep to B / v or to the curve's seconds at B
  (`EmulatedSpeed`, `EmulatedCurve`): real compute, wall-clock faithful;
- `model`: nothing is slept; the silo reports τ·B/v or τ·curve(B) seconds of compute
  (`ModelCurve`; one speed is the curve B / v): deterministic, the sizes depend on the speeds alone.
Experiments bring their own clocks (fedlb.experiments' EmulatedClock): any `SiloClock`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fedlb.balance import StepCurve
from fedlb.training import EmulatedCurve, EmulatedSpeed, Pace, step_curve

from .protocol import Emulation


class SiloClock(Protocol):
    """Emulated time for one silo (fedlb.experiments provides them): `pace` slows its steps
    (measured clock), `fixed_cost` is slept as its fixed cost, `report` says which
    (compute-s, overhead-s) to report (the model clock's, or the measured ones), and
    `curve_name` which step-time curve it emulates ('' : none), for the records."""

    @property
    def name(self) -> str: ...

    @property
    def curve_name(self) -> str: ...

    def pace(self, server_round: int) -> Pace | None: ...

    def fixed_cost(self, server_round: int) -> float: ...

    def report(
        self, server_round: int, batch_size: int, steps: int, compute_s: float, fixed_s: float
    ) -> tuple[float, float]: ...


@dataclass(frozen=True)
class ModelCurve:
    """The model clock for a silo on a measured step-time curve: its steps run unpadded,
    and it reports τ·curve(B) seconds of compute and none of fixed cost."""

    curve: StepCurve
    name: str = "model"

    @property
    def curve_name(self) -> str:
        return self.curve.name

    def pace(self, server_round: int) -> Pace | None:
        return None

    def fixed_cost(self, server_round: int) -> float:
        return 0.0

    def report(
        self, server_round: int, batch_size: int, steps: int, compute_s: float, fixed_s: float
    ) -> tuple[float, float]:
        return steps * self.curve.seconds(batch_size), 0.0


def emulated_timing(emulation: Emulation) -> tuple[SiloClock | None, Pace | None]:
    """What a silo without an experiment's clock runs on: (its model clock, None) on the
    model clock, (None, its pace) on the measured one, (None, None) at its real speed.
    ValueError where the curve is none fedlb ships."""
    curve = step_curve(emulation.curve) if emulation.curve else None
    if emulation.clock == "model":
        if curve is not None:
            return ModelCurve(curve), None
        if emulation.speed > 0:
            # one speed is the curve t(B) = B / v: a single point at B = 1, held linear
            return ModelCurve(StepCurve(((1, 1.0 / emulation.speed),))), None
        return None, None
    if curve is not None:
        return None, EmulatedCurve(curve)
    return None, EmulatedSpeed(emulation.speed) if emulation.speed > 0 else None
