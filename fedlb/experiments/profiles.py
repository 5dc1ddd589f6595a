"""Emulated silos: speed profiles, presets, and the two clocks experiments run on.

A profile gives a silo's speed (samples/s of pure compute) in every round, or its measured
step-time curve (fedlb.training's STEP_CURVES: "curve:h200/cnn" in a list of speeds), and
its fixed cost per round. Every output names its clock, and the curves where there are:

- `model`: virtual time t_i = o_i + τ·B_i / v_i(round), or o_i + τ·c_i(B_i) on a curve,
  from the profile; the silo trains for real (accuracy is real) but nothing is slept and
  the times are exact and repeatable.
- `measured`: real compute padded with sleep to the profile's speed or curve, plus a sleep
  of o_i: wall-clock faithful, with the machine's own noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedlb.balance import StepCurve
from fedlb.training import BASE_SPEED, EmulatedCurve, EmulatedSpeed, Pace, step_curve

from .clocks import CurveTime, LinearTime, TimeModel

CLOCKS = ("model", "measured")


@dataclass(frozen=True)
class SpeedProfile:
    """A silo's speed over rounds.

    Args:
        speed: samples/s at the start (on a curve: 1, the trace's factors' base).
        overhead: fixed seconds per round (encryption, upload).
        trace: 'static'; 'step:R:F' (from round R on, speed × F); 'periodic:P:F' (every
            other block of P rounds at speed × F, as LB-BSP Fig. 9's slow/fast phases);
            'walk:S' (a seeded multiplicative random walk with step S, within 0.25x-4x).
            On a curve, speed × F is the curve's times / F.
        seed: seed of the random walk.
        curve: a measured step-time curve in place of B / speed (None: B / speed).
    """

    speed: float
    overhead: float = 0.0
    trace: str = "static"
    seed: int = 0
    curve: StepCurve | None = None

    @classmethod
    def on_curve(
        cls, curve: StepCurve, overhead: float = 0.0, trace: str = "static", seed: int = 0
    ) -> SpeedProfile:
        """A silo whose steps follow `curve` (its trace scales the curve's times)."""
        return cls(1.0, overhead, trace, seed, curve)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"a profile's speed must be > 0 samples/s, got {self.speed}")
        if not (math.isfinite(self.overhead) and self.overhead >= 0):
            raise ValueError(f"a profile's overhead must be >= 0 s, got {self.overhead}")
        self.speed_at(1)  # validates the trace

    def speed_at(self, server_round: int) -> float:
        kind, _, rest = self.trace.partition(":")
        args = rest.split(":") if rest else []
        try:
            if kind == "static" and not args:
                return self.speed
            if kind == "step" and len(args) == 2:
                start, factor = int(args[0]), float(args[1])
                return self.speed * (factor if server_round >= start else 1.0)
            if kind == "periodic" and len(args) == 2:
                period, factor = int(args[0]), float(args[1])
                slow = ((server_round - 1) // period) % 2 == 1
                return self.speed * (factor if slow else 1.0)
            if kind == "walk" and len(args) == 1:
                step = float(args[0])
                rng = np.random.default_rng(self.seed)
                moves = rng.normal(0.0, step, max(server_round - 1, 0))
                return self.speed * float(np.clip(np.exp(np.sum(moves)), 0.25, 4.0))
        except ValueError as error:
            raise ValueError(f"speed trace {self.trace!r}: {error}") from error
        raise ValueError(
            f"unknown speed trace {self.trace!r}: use static, step:R:F, periodic:P:F or walk:S"
        )

    def curve_at(self, server_round: int) -> StepCurve | None:
        """The curve in `server_round`, its times over the trace's factor (None: no curve)."""
        if self.curve is None:
            return None
        factor = self.speed_at(server_round) / self.speed
        return self.curve if factor == 1.0 else self.curve.scaled(1.0 / factor, self.curve.name)

    def time_model(self, server_round: int) -> TimeModel:
        """Its time model in `server_round`: B / speed, or its curve (fedlb tune's kinds)."""
        curve = self.curve_at(server_round)
        if curve is None:
            return LinearTime(self.speed_at(server_round), self.overhead)
        return CurveTime(curve, self.overhead)

    def pace(self, server_round: int) -> Pace:
        """The measured clock's padding in `server_round`: to its speed, or its curve."""
        curve = self.curve_at(server_round)
        if curve is None:
            return EmulatedSpeed(self.speed_at(server_round))
        return EmulatedCurve(curve)

    def describe(self) -> str:
        """In words, for outputs: "curve h200/cnn", "200 samples/s"."""
        if self.curve is not None:
            return f"curve {self.curve.name}"
        return f"{self.speed:g} samples/s"


@dataclass(frozen=True)
class EmulatedClock:
    """What a silo does with its profile: pace its steps (measured) or report modelled
    times (model). Plugs into fedlb.flower's silo handler as its `clock`."""

    name: str
    profile: SpeedProfile

    def __post_init__(self) -> None:
        if self.name not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {self.name!r}")

    @property
    def curve_name(self) -> str:
        """The step-time curve it emulates ('' : none)."""
        return "" if self.profile.curve is None else self.profile.curve.name

    def pace(self, server_round: int) -> Pace | None:
        if self.name == "measured":
            return self.profile.pace(server_round)
        return None

    def fixed_cost(self, server_round: int) -> float:
        """Seconds to sleep for the fixed cost (measured clock only)."""
        return self.profile.overhead if self.name == "measured" else 0.0

    def report(
        self, server_round: int, batch_size: int, steps: int, compute_s: float, fixed_s: float
    ) -> tuple[float, float]:
        """(compute-s, overhead-s) to report: measured as lived, or the model's."""
        if self.name == "measured":
            return compute_s, fixed_s
        model = self.profile.time_model(server_round)
        return model.compute_s(batch_size, steps), self.profile.overhead


def clock_label(clock: str, profiles: list[SpeedProfile], who: str = "silo") -> str:
    """A clock as outputs name it: `clock`, and where profiles follow step-time curves,
    which: "model (curves: silo-0 h200/cnn, silo-2 cpu1/cnn)" (`who`: silo, rank)."""
    curves = [f"{who}-{i} {p.curve.name}" for i, p in enumerate(profiles) if p.curve is not None]
    return f"{clock} (curves: {', '.join(curves)})" if curves else clock


# The LB-BSP paper's federated testbed (Section 5.5): m4.4xlarge, c4.2xlarge, c5.2xlarge,
# c4.xlarge, c5.xlarge. CPU training throughput is taken as vCPUs x per-core speed, the
# per-core speed as the processor's base clock relative to m4's 2.3 GHz (c4: 2.9 GHz, 1.26;
# c5: 3.0 GHz, 1.30): 16, 10.1, 10.4, 5.0, 5.2. A derivation, not a measurement: by it the
# slowest silo is c4.xlarge, where the paper names c5.xlarge; both are ~3.2x slower than
# m4.4xlarge, whose uniform-round idle share is then ~69% (the paper: "over one third").
EC2_5 = (16.0, 10.1, 10.4, 5.0, 5.2)


def preset(name: str, base_speed: float = BASE_SPEED) -> list[float]:
    """Relative speeds × base_speed: 'ec2-5' (the paper's 5 silos), 'hetero-K:N' (N silos
    spaced geometrically with max/min = K, as the dynamic-batching paper's levels 2, 4, 8),
    or a comma list '1,2,4'."""
    if name == "ec2-5":
        top = max(EC2_5)
        return [base_speed * v / top for v in EC2_5]
    if name.startswith("hetero-"):
        try:
            level, count = name[len("hetero-") :].split(":")
            return [float(v) for v in np.geomspace(float(level), 1.0, int(count)) * base_speed]
        except ValueError as error:
            raise ValueError(f"preset {name!r}: use hetero-K:N, e.g. hetero-4:5") from error
    try:
        values = [float(v) for v in name.split(",")]
    except ValueError as error:
        raise ValueError(
            f"unknown speeds {name!r}: use ec2-5, hetero-K:N or a list like 1,2,4"
        ) from error
    if any(not (math.isfinite(v) and v > 0) for v in values):
        raise ValueError(f"speeds must all be > 0, got {name!r}")
    return [v * base_speed for v in values]


CURVE_PREFIX = "curve:"  # an entry of a speeds list that names a step-time curve


def silo_speeds(text: str, base_speed: float = BASE_SPEED) -> list[float | StepCurve]:
    """Each silo's speed (samples/s) or step-time curve from a `speeds` setting: a preset
    (see `preset`), or a comma list whose entries are relative speeds (× base_speed) or
    "curve:NAME" (fedlb.training's STEP_CURVES; "curve:NAME*K": its times × K)."""
    if CURVE_PREFIX not in text:
        return list(preset(text, base_speed))
    speeds: list[float | StepCurve] = []
    for entry in (e.strip() for e in text.split(",")):
        if entry.startswith(CURVE_PREFIX):
            speeds.append(step_curve(entry.removeprefix(CURVE_PREFIX)))
            continue
        try:
            value = float(entry)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"speeds entry {entry!r}: give a relative speed > 0 or curve:NAME (NAME one "
                "of fedlb's step-time curves, e.g. curve:h200/cnn)"
            )
        speeds.append(value * base_speed)
    return speeds
