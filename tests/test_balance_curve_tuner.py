"""The curve tuner (fedlb.balance.CurvePooled, "curve"): seconds per step learned over the
batch sizes a worker ran, the split on those curves once one speed is shown wrong, and
exactly the pooled tuner while it is not."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlb.balance import BatchSizeManager, PooledProportional, WorkerReport
from fedlb.balance.curved import CurvePooled
from fedlb.balance.names import make_tuner
from fedlb.balance.observed import ObservedSteps
from fedlb.training import STEP_CURVES


def step_ms(curve: str, batch: int) -> float:
    """The shipped curve (fedlb.training.STEP_CURVES: one NVIDIA H200 and its CPU at 4 and
    1 threads, measured 2026-11-26, made non-decreasing), in ms."""
    return STEP_CURVES[curve].seconds(batch) * 1000


def best_ms(curves: list[str], total: int) -> float:
    return min(
        max(step_ms(curves[0], a), step_ms(curves[1], b), step_ms(curves[2], total - a - b))
        for a in range(1, total - 1)
        for b in range(1, total - a)
    )


def run(tuner, curves: list[str], total: int = 96, rounds: int = 8, steps: int = 300):
    """Model clock: each round's slowest step (ms) under the sizes the manager gives."""
    manager = BatchSizeManager({c: total // len(curves) for c in curves}, tuner)
    slowest = []
    for _ in range(rounds):
        sizes = manager.sizes
        ms = {c: step_ms(c, sizes[c]) for c in curves}
        slowest.append(max(ms.values()))
        manager.step([WorkerReport(c, sizes[c], steps, steps * ms[c] / 1000) for c in curves])
    return slowest, manager


@pytest.mark.parametrize("model", ["cnn", "lenet5"])
def test_on_measured_gpu_and_cpu_curves_it_comes_within_10_percent_of_the_best_split(model):
    """One H200 silo beside CPU silos of 4 and 1 threads, X = 96 (the field test's
    federation): FedAvg's 32/32/32 waits for the one-thread CPU; the best split gives the
    GPU almost everything. The pooled tuner (one speed per worker) stops short (1.38x and
    1.42x in round 8); the curve tuner is within 1.10x of the exhaustive best by round 8
    on both (1.00x and 1.01x)."""
    curves = [f"h200/{model}", f"cpu4/{model}", f"cpu1/{model}"]
    best = best_ms(curves, 96)
    curve, manager = run(CurvePooled(), curves, rounds=8)
    pooled, _ = run(PooledProportional(), curves, rounds=8)
    assert curve[0] == pytest.approx(max(step_ms(c, 32) for c in curves))  # round 1 at B0
    assert curve[-1] <= 1.10 * best, (curve, best)
    assert curve[7] < pooled[7]
    assert manager.tuner.on_curves
    assert max(manager.sizes, key=manager.sizes.get) == f"h200/{model}"


def test_with_a_floor_the_gpu_gets_what_the_floor_leaves():
    """The FL stability guard's floor (no silo below half the mean batch, 16 of 96) holds
    the one-thread CPU at 16: the round waits for it (5.06 ms a step on cnn, against 1.4
    ms at the best split and 9.38 ms at FedAvg's 32/32/32), and the GPU takes most of the
    rest (any split that leaves that CPU at 16 is as fast)."""
    curves = ["h200/cnn", "cpu4/cnn", "cpu1/cnn"]
    slowest, manager = run(CurvePooled(min_share=0.5), curves)
    sizes = manager.sizes
    assert sizes["cpu1/cnn"] == 16  # held at the floor: it sets the round
    assert sizes["cpu4/cnn"] >= 16
    assert sizes["h200/cnn"] >= 60
    assert slowest[-1] == pytest.approx(step_ms("cpu1/cnn", 16))


@settings(max_examples=40, deadline=None)
@given(
    speeds=st.lists(st.floats(20.0, 2000.0), min_size=2, max_size=6),
    overhead=st.floats(0.0, 2.0),
)
def test_while_one_speed_describes_every_worker_it_is_the_pooled_tuner(speeds, overhead):
    """Workers whose step time is B / v (emulated silos, the model clock): the same sizes
    as the pooled tuner, round after round."""
    names = [f"w{i}" for i in range(len(speeds))]
    managers = [
        BatchSizeManager({n: 32 for n in names}, tuner)
        for tuner in (CurvePooled(), PooledProportional())
    ]
    for _ in range(6):
        sizes = [m.sizes for m in managers]
        assert sizes[0] == sizes[1]
        for manager in managers:
            manager.step(
                [
                    WorkerReport(n, manager.sizes[n], 10, 10 * manager.sizes[n] / v, overhead)
                    for n, v in zip(names, speeds, strict=True)
                ]
            )
    assert not managers[0].tuner.on_curves


def test_equal_workers_under_timing_noise_keep_equal_sizes():
    """Equal silos timed with 20% lognormal noise: sizes stay equal (the pooled tuner's
    guarantee is kept; one size measured per worker says nothing of curves)."""
    rng = random.Random(7)
    manager = BatchSizeManager({n: 32 for n in "abc"}, CurvePooled())
    for _ in range(15):
        manager.step(
            [WorkerReport(n, 32, 10, 10 * 32 / 100 * math.exp(rng.gauss(0, 0.2))) for n in "abc"]
        )
        assert manager.sizes == {"a": 32, "b": 32, "c": 32}


@given(st.lists(st.tuples(st.integers(1, 512), st.floats(1e-4, 1.0)), min_size=1, max_size=30))
def test_the_fitted_curve_never_makes_a_larger_batch_faster(measurements):
    observed = ObservedSteps()
    for batch, seconds in measurements:
        observed.observe(batch, seconds)
    sizes, fitted = observed.fit()
    assert fitted == sorted(fitted)
    model = observed.predictor()
    grid = [0.5, 1, 2, 3, 7, 50, 100, 511, 512, 600, 4096]
    predicted = [model.seconds(b) for b in grid]
    assert all(a <= b * (1 + 1e-12) for a, b in itertools.pairwise(predicted))
    for size, value in zip(sizes, fitted, strict=True):
        assert model.seconds(size) == pytest.approx(value)


def test_one_measured_size_is_one_speed_and_a_flat_curve_grows_cautiously():
    observed = ObservedSteps()
    observed.observe(32, 0.004)
    assert observed.seconds(64) == pytest.approx(0.008)
    assert observed.seconds(16) == pytest.approx(0.002)
    observed.observe(64, 0.004)  # flat between 32 and 64: a GPU below saturation
    assert observed.seconds(1024) == pytest.approx(0.004 * 2.0)  # (1024/64) ** 0.25
    assert observed.seconds(48) == pytest.approx(0.004)
    with pytest.raises(ValueError, match="seconds > 0"):
        observed.observe(8, math.nan)


def test_below_its_smallest_size_a_cpu_near_its_floor_shrinks_as_measured():
    """Four CPU threads on LeNet-5: 2.22 ms at B = 24, 2.46 ms at 32 (elasticity 0.36).
    A proportional guess puts B = 12 at 1.11 ms; the measured 1.72 ms is what the two
    smallest sizes' elasticity predicts, within 5%."""
    observed = ObservedSteps()
    observed.observe(32, 0.00246)
    observed.observe(24, 0.00222)
    assert observed.seconds(12) == pytest.approx(0.00172, rel=0.05)
    assert observed.seconds(12) <= observed.seconds(24)


def test_a_curve_is_claimed_only_beyond_noise_and_over_a_spread_of_sizes():
    flat = ObservedSteps()  # a GPU: 32 -> 48, time +4%
    flat.observe(32, 0.00152)
    flat.observe(48, 0.00159)
    assert flat.predictor().nonlinear(0.0)
    assert flat.predictor().nonlinear(0.1)
    assert not flat.predictor().nonlinear(0.5)  # 50% timing noise could make that up
    drifting = ObservedSteps()  # a worker slowing 2% a round, its size shrinking with it
    for round_number in range(6):
        drifting.observe(32 - round_number // 2, 0.004)
    assert not drifting.predictor().nonlinear(0.0)
    linear = ObservedSteps()
    for size in (16, 32, 64):
        linear.observe(size, size / 8000)
    assert not linear.predictor().nonlinear(0.0)


def test_a_worker_that_changed_is_seen_beyond_its_measured_sizes_too():
    """Outside the measured sizes only what holds for any hardware is trusted: no faster
    at a larger batch, no slower per sample. A 3x slower step at a smaller size breaks
    the first: the old points go."""
    observed = ObservedSteps()
    observed.observe(48, 0.006)
    observed.observe(56, 0.007)
    observed.observe(40, 0.005 * 0.9)  # within what the hardware allows: kept
    assert len(observed) == 3
    observed.observe(24, 0.009)  # 3 ms per step at 24 where 40 took 4.5 ms / 40 samples
    assert len(observed) == 1


def test_its_state_round_trips_and_it_is_in_the_table():
    curves = ["h200/cnn", "cpu4/cnn", "cpu1/cnn"]
    _, manager = run(make_tuner("curve"), curves, rounds=4)
    state = manager.state_dict()
    again = BatchSizeManager({c: 32 for c in curves}, CurvePooled())
    again.load_state_dict(state)
    assert again.tuner.state_dict() == manager.tuner.state_dict()
    reports = [
        WorkerReport(c, manager.sizes[c], 300, 0.3 * step_ms(c, manager.sizes[c])) for c in curves
    ]
    assert again.step(reports) == manager.step(reports)
