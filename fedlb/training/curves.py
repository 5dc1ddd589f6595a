"""The step-time curves fedlb ships, by name, and a step paced to one (the measured clock).

`step-curves-h200-cpu.json` beside this module is an unchanged copy of a measurement made
on 2026-11-26; its own keys say what ("what": one SGD step of fedlb's mlp, lenet5 and cnn
from build_model, median of 15 after 5 warm-ups), where ("where": one NVIDIA H200, driver
580.159.04, torch 2.11.0+cu130, timed with CUDA events; the CPU rows on the same machine's
16 cores at 1 and 4 torch threads) and when ("date"), and "shapes" the inputs (mlp: 64
features, digits' own; lenet5: 1x28x28; cnn: 3x32x32). Each (device, threads, model)
series is one curve of `STEP_CURVES`, named "<hardware>/<model>" (hardware: h200, cpu1,
cpu4), fitted non-decreasing (`StepCurve.fit`); the raw medians stay in the file.

A setting names a curve as "NAME", or "NAME*K": its times × K, hardware K times slower than
the one measured. The measured clock needs K where this machine is slower than the curve's
hardware (a step cannot be padded below its own real compute: an H200's 1.4 ms LeNet-5
step is out of a laptop core's reach); curves all × K pose the same balance problem, K
times longer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from fedlb.balance import StepCurve
from fedlb.security import StoredFileError, read_json_object

CURVES_FILE = Path(__file__).with_name("step-curves-h200-cpu.json")
# (device, torch threads) of the file's rows -> the hardware part of a curve's name
_HARDWARE = {("cuda", None): "h200", ("cpu", 1): "cpu1", ("cpu", 4): "cpu4"}
# what each hardware name stands for (help texts and docs)
CURVE_HARDWARE = {
    "h200": "one NVIDIA H200 (CUDA events)",
    "cpu1": "the H200 machine's CPU, 1 torch thread",
    "cpu4": "the H200 machine's CPU, 4 torch threads",
}


def _load(path: Path) -> dict[str, StepCurve]:
    measured: dict[str, list[tuple[int, float]]] = {}
    models: dict[str, str] = {}
    try:
        rows = read_json_object(path)["rows"]
    except (StoredFileError, KeyError) as error:  # fedlb's own file: the install is damaged
        why = error.reason if isinstance(error, StoredFileError) else "no rows"
        raise StoredFileError(path, f"{why}; it ships with fedlb: reinstall fedlb") from None
    for row in rows:
        name = f"{_HARDWARE[(row['device'], row['threads'])]}/{row['model']}"
        measured.setdefault(name, []).append((int(row["batch"]), float(row["step_s"])))
        models[name] = row["model"]
    return {name: StepCurve.fit(points, name, models[name]) for name, points in measured.items()}


# the one table of curve names, every entry point's (settings, scenarios, the CLI's help)
STEP_CURVES: dict[str, StepCurve] = _load(CURVES_FILE)


def step_curve(spec: str) -> StepCurve:
    """The curve a setting names: "NAME" of `STEP_CURVES`, or "NAME*K" (its times × K,
    named so). ValueError names the curves there are."""
    name, star, factor = spec.strip().partition("*")
    curve = STEP_CURVES.get(name.strip())
    if curve is None:
        raise ValueError(
            f"unknown step-time curve {name.strip()!r}: fedlb ships {', '.join(STEP_CURVES)} "
            "(NAME*K: its times x K)"
        )
    if not star:
        return curve
    try:
        times = float(factor)
    except ValueError:
        times = math.nan
    if not (math.isfinite(times) and times > 0):
        raise ValueError(f"step-time curve {spec.strip()!r}: K of NAME*K must be a number > 0")
    return curve.scaled(times)


@dataclass(frozen=True)
class EmulatedCurve:
    """Emulate hardware whose step of B samples takes `curve.seconds(B)`: each step is
    padded with sleep to that (the `measured` clock: real compute, wall-clock faithful).

    A step whose real compute already takes longer is not padded (this machine cannot keep
    up with the curve: name it NAME*K); a silo's balance_mod then says so in its log.
    """

    curve: StepCurve

    def __call__(self, real_s: float, batch_size: int) -> float:
        return max(real_s, self.curve.seconds(batch_size))
