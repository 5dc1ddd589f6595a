"""The tuners on measured step-time curves, side by side with the best split.

A GPU silo (one NVIDIA H200) beside CPU silos of 4 and 1 threads, X = 96, τ = 300 (the
field test's federation, ../shared/notes/gpu-h200-federation.md), on the model clock:
each round's step time is the measured curve at the size the tuner gave (fedlb's shipped
curves, fedlb.training.STEP_CURVES: medians made non-decreasing, interpolated), reported
back as the silo's compute. It
prints, per model and tuner, the slowest step by round against the exhaustive best split
of X, and the balance efficiency E = T*/T_round of one-speed silos (t = B / v) under 20%
lognormal timing noise (20 seeds), where the curve tuner must not lose to the pooled one;
and the curves themselves under 10% lognormal timing noise (real hardware is noisy).

    .venv/bin/python benchmarks/curves.py [--curves measured.json] [--json out.json]

Clock: model (virtual time from the measured curves; deterministic, no sleeping).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from fedlb.balance import BatchSizeManager, StepCurve, Tuner, WorkerReport, make_tuner
from fedlb.training import STEP_CURVES

TUNERS = ("static", "pooled", "curve")
ROUNDS, TOTAL, STEPS = 10, 96, 300


def load(path: Path | None) -> dict[str, StepCurve]:
    """name ("h200/lenet5", "cpu1/cnn", ...) -> its curve: fedlb's shipped ones, or those
    of a file in the same format (made non-decreasing as fedlb makes them)."""
    if path is None:
        return dict(STEP_CURVES)
    measured: dict[str, list[tuple[int, float]]] = {}
    for row in json.loads(path.read_text())["rows"]:
        device = "h200" if row["device"] == "cuda" else f"cpu{row['threads']}"
        measured.setdefault(f"{device}/{row['model']}", []).append((row["batch"], row["step_s"]))
    return {name: StepCurve.fit(points, name) for name, points in measured.items()}


def step_s(curve: StepCurve, batch: int) -> float:
    return curve.seconds(batch)


def best(curves: list[StepCurve], total: int) -> tuple[float, tuple[int, ...]]:
    found: tuple[float, tuple[int, ...]] = (math.inf, ())
    for a in range(1, total - 1):
        for b in range(1, total - a):
            sizes = (a, b, total - a - b)
            slowest = max(step_s(c, s) for c, s in zip(curves, sizes, strict=True))
            found = min(found, (slowest, sizes))
    return found


def rounds_on_curves(tuner: Tuner, curves: dict[str, StepCurve]) -> list[float]:
    manager = BatchSizeManager({n: TOTAL // len(curves) for n in curves}, tuner)
    slowest = []
    for _ in range(ROUNDS):
        sizes = manager.sizes
        times = {n: step_s(c, sizes[n]) for n, c in curves.items()}
        slowest.append(max(times.values()))
        manager.step([WorkerReport(n, sizes[n], STEPS, STEPS * times[n]) for n in curves])
    return slowest


def ratio_on_noisy_curves(
    name: str, curves: dict[str, StepCurve], optimum: float, seeds: int = 20, noise: float = 0.1
) -> dict[str, float]:
    """Each round's reported compute is the curve's time × lognormal noise (log-sd `noise`):
    the slowest step over the best, at round 8 (median over seeds) and meaned over rounds
    8-20 (mean, and the worst seed's)."""
    at_round8, late = [], []
    for seed in range(seeds):
        rng = random.Random(seed)
        manager = BatchSizeManager({n: TOTAL // len(curves) for n in curves}, make_tuner(name))
        ratios = []
        for _ in range(20):
            sizes = manager.sizes
            times = {n: step_s(c, sizes[n]) for n, c in curves.items()}
            ratios.append(max(times.values()) / optimum)
            manager.step(
                [
                    WorkerReport(n, sizes[n], STEPS, STEPS * t * math.exp(rng.gauss(0, noise)))
                    for n, t in times.items()
                ]
            )
        at_round8.append(ratios[7])
        late.append(statistics.fmean(ratios[7:]))
    return {
        "round8_median": statistics.median(at_round8),
        "rounds8_20_mean": statistics.fmean(late),
        "rounds8_20_worst_seed": max(late),
    }


def efficiency_under_noise(name: str, speeds: list[float], seeds: int = 20) -> dict[str, float]:
    means = []
    for seed in range(seeds):
        rng = random.Random(seed)
        workers = {f"w{i}": v for i, v in enumerate(speeds)}
        manager = BatchSizeManager({w: TOTAL // len(workers) for w in workers}, make_tuner(name))
        ideal = 10 * TOTAL / sum(speeds)
        seen = []
        for _ in range(20):
            sizes = manager.sizes
            seen.append(ideal / max(10 * sizes[w] / v for w, v in workers.items()))
            noisy = [
                WorkerReport(w, sizes[w], 10, 10 * sizes[w] / v * math.exp(rng.gauss(0, 0.2)))
                for w, v in workers.items()
            ]
            manager.step(noisy)
        means.append(statistics.fmean(seen[2:]))
    return {"mean_E": statistics.fmean(means), "worst_seed_E": min(means)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--curves", type=Path, default=None, help="a curves JSON (default: fedlb's shipped ones)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    curves = load(args.curves)
    result: dict[str, Any] = {"clock": "model (measured step-time curves)", "curves": {}}
    source = args.curves.name if args.curves else "fedlb.training.STEP_CURVES"
    print(f"clock: model, step times from {source}; X = {TOTAL}, τ = {STEPS}")
    for model in ("cnn", "lenet5", "mlp"):
        names = [f"h200/{model}", f"cpu4/{model}", f"cpu1/{model}"]
        chosen = {n: curves[n] for n in names}
        optimum, split = best(list(chosen.values()), TOTAL)
        print(f"\n{model}: best split {split} -> {optimum * 1e3:.2f} ms a step")
        rows: dict[str, Any] = {"best_ms": optimum * 1e3, "best_split": split}
        for label, tuner in [
            *((t, make_tuner(t)) for t in TUNERS),
            ("curve, FL floor 0.5", make_tuner("curve", min_share=0.5)),
            ("pooled, FL floor 0.5", make_tuner("pooled", min_share=0.5)),
        ]:
            slowest = rounds_on_curves(tuner, chosen)
            ratio = slowest[7] / optimum
            rows[label] = {"ms_by_round": [s * 1e3 for s in slowest], "round8_over_best": ratio}
            shown = " ".join(f"{s * 1e3:5.2f}" for s in slowest)
            print(f"  {label:22s} {shown}   round 8 / best {ratio:.2f}x")
        for name in ("pooled", "curve"):
            noisy = ratio_on_noisy_curves(name, chosen, optimum)
            rows[f"{name}, 10% noise"] = noisy
            print(
                f"  {name + ', 10% noise':22s} round 8 / best {noisy['round8_median']:.2f}x"
                f" (median of 20 seeds); rounds 8-20 {noisy['rounds8_20_mean']:.2f}x"
                f" (worst seed {noisy['rounds8_20_worst_seed']:.2f}x)"
            )
        result["curves"][model] = rows
    print("\none speed per silo (t = B / v), 20% lognormal timing noise, 20 seeds, rounds 3-20:")
    result["noise"] = {}
    for label, speeds in [
        ("equal", [100.0] * 3),
        ("1:2:4", [100.0, 200.0, 400.0]),
        ("1..8, 5 silos", [100.0, 150.0, 200.0, 400.0, 800.0]),
    ]:
        figures = {t: efficiency_under_noise(t, speeds) for t in ("pooled", "curve")}
        result["noise"][label] = figures
        shown = ", ".join(
            f"{t} E {f['mean_E']:.3f} (worst seed {f['worst_seed_E']:.3f})"
            for t, f in figures.items()
        )
        print(f"  {label:14s} {shown}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
