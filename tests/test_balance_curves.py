"""StepCurve (a measured step-time curve) and T* / E over curves (fedlb.balance)."""

from __future__ import annotations

import heapq
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlb.balance import StepCurve, balance_efficiency, ideal_round_time, ideal_sizes

GPU_LIKE = StepCurve(((1, 0.0014), (32, 0.0015), (1024, 0.002), (4096, 0.0029)), "gpu", "m")
CPU_LIKE = StepCurve(((1, 0.0016), (32, 0.0039), (1024, 0.155)), "cpu", "m")


def test_seconds_interpolate_linearly_between_points_and_hold_the_ends():
    curve = StepCurve(((4, 1.0), (8, 2.0), (16, 2.0)))
    assert curve.seconds(4) == 1.0
    assert curve.seconds(8) == 2.0
    assert curve.seconds(6) == pytest.approx(1.5)  # linear in B between points
    assert curve.seconds(12) == 2.0  # a flat stretch stays flat
    assert curve.seconds(1) == curve.seconds(0.5) == 1.0  # below the first: its seconds
    # beyond the last: linear in B through the origin (the last throughput held)
    assert curve.seconds(32) == pytest.approx(4.0)
    assert curve.seconds(160) == pytest.approx(20.0)
    assert curve.samples_per_s(16) == pytest.approx(8.0)
    assert curve.samples_per_s(64) == pytest.approx(8.0)


def test_scaled_multiplies_every_time_and_names_it():
    slow = CPU_LIKE.scaled(20)
    assert slow.name == "cpu*20"
    assert slow.model == "m"
    for batch in (1, 7, 32, 500, 5000):
        assert slow.seconds(batch) == pytest.approx(20 * CPU_LIKE.seconds(batch))
    assert CPU_LIKE.scaled(0.5, name="fast").name == "fast"
    with pytest.raises(ValueError, match="finite and > 0"):
        CPU_LIKE.scaled(0)


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ((), "at least one"),
        (((2, 1.0), (1, 2.0)), "must increase"),
        (((1, 1.0), (1, 2.0)), "must increase"),
        (((1, 2.0), (2, 1.0)), "must not fall"),
        (((0, 1.0),), "whole numbers >= 1"),
        (((1.5, 1.0),), "whole numbers >= 1"),
        (((1, 0.0),), "finite and > 0"),
        (((1, float("nan")),), "finite and > 0"),
    ],
)
def test_bad_points_are_refused(points, message):
    with pytest.raises(ValueError, match=message):
        StepCurve(points)


def test_a_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="finite and > 0"):
        GPU_LIKE.seconds(0)


measurements = st.lists(
    st.tuples(st.integers(1, 64), st.floats(1e-4, 1.0, allow_nan=False)), min_size=1, max_size=12
)


@given(measurements)
def test_fit_is_non_decreasing_and_keeps_the_mean(measured):
    curve = StepCurve.fit(measured)
    seconds = [s for _, s in curve.points]
    assert seconds == sorted(seconds)
    assert [b for b, _ in curve.points] == sorted({b for b, _ in measured})
    # isotonic regression keeps each pooled block's mean, so the weighted total is kept:
    # every measurement counts once, at its batch size's fitted value
    fitted = dict(curve.points)
    assert sum(fitted[b] for b, _ in measured) == pytest.approx(sum(s for _, s in measured))


def test_fit_leaves_non_decreasing_points_alone_and_pools_a_dip():
    assert StepCurve.fit([(1, 1.0), (2, 2.0), (4, 3.0)]).points == ((1, 1.0), (2, 2.0), (4, 3.0))
    # the H200's lenet5 noise: 1.84 ms at B=2 above 1.57 at 4 and 1.36 at 8, pooled
    pooled = StepCurve.fit([(1, 1.43), (2, 1.84), (4, 1.57), (8, 1.36), (16, 3.0)])
    assert [s for _, s in pooled.points] == pytest.approx([1.43, 1.59, 1.59, 1.59, 3.0])


@given(measurements, st.floats(0.01, 10_000), st.floats(0.01, 10_000))
def test_seconds_never_fall_as_the_batch_grows(measured, a, b):
    curve = StepCurve.fit(measured)
    small, large = sorted((a, b))
    assert curve.seconds(small) <= curve.seconds(large)


def brute_force(curves, total, taus, overheads, min_batch):
    """T* by trying every integer split."""
    names = list(curves)
    best = float("inf")
    for split in itertools.product(range(min_batch, total + 1), repeat=len(names)):
        if sum(split) != total:
            continue
        best = min(
            best,
            max(
                overheads[n] + taus[n] * curves[n].seconds(b)
                for n, b in zip(names, split, strict=True)
            ),
        )
    return best


# curves with plateaus (a GPU's flat stretch) and steps: points at 1, 2, 4, ... non-decreasing
def curves_strategy(draw_count):
    steps = st.lists(st.sampled_from([0.0, 0.0, 0.001, 0.01, 0.1, 1.0]), min_size=1, max_size=5)

    def build(first_and_steps):
        first, increases = first_and_steps
        seconds, points = first, []
        for k, increase in enumerate(increases):
            seconds += increase
            points.append((2**k, seconds))
        return StepCurve(tuple(points))

    return st.lists(
        st.tuples(st.floats(0.001, 1.0), steps).map(build), min_size=2, max_size=draw_count
    )


@settings(max_examples=150, deadline=None)
@given(
    curves_strategy(3),
    st.integers(0, 9),
    st.integers(1, 2),
    st.lists(st.sampled_from([0.0, 0.005, 0.5]), min_size=3, max_size=3),
    st.lists(st.integers(1, 3), min_size=3, max_size=3),
)
def test_t_star_over_curves_is_the_brute_force_optimum(curves, extra, min_batch, fixed, steps):
    named = {f"w{i}": c for i, c in enumerate(curves)}
    total = min_batch * len(named) + extra
    taus = {n: steps[i] for i, n in enumerate(named)}
    overheads = {n: fixed[i] for i, n in enumerate(named)}
    sizes = ideal_sizes({}, total, taus, overheads, min_batch, curves=named)
    assert sum(sizes.values()) == total
    assert min(sizes.values()) >= min_batch
    ideal = ideal_round_time({}, total, taus, overheads, min_batch, curves=named)
    assert ideal == pytest.approx(brute_force(named, total, taus, overheads, min_batch))
    assert balance_efficiency({}, sizes, taus, overheads, min_batch=min_batch, curves=named) == (
        pytest.approx(1.0)
    )


def test_a_one_point_curve_is_a_linear_worker_and_mixes_with_speeds():
    speeds = {"a": 400.0, "b": 200.0, "c": 100.0}
    linear = {n: StepCurve(((1, 1.0 / v),)) for n, v in speeds.items()}
    for total in (3, 7, 48, 1001):
        expected = ideal_round_time(speeds, total, 5, {"a": 0.1, "b": 0.0, "c": 0.2})
        on_curves = ideal_round_time({}, total, 5, {"a": 0.1, "b": 0.0, "c": 0.2}, curves=linear)
        mixed = ideal_round_time(
            {"a": 400.0, "c": 100.0}, total, 5, {"a": 0.1, "b": 0.0, "c": 0.2}, curves=linear
        )
        assert on_curves == pytest.approx(expected)
        assert mixed == pytest.approx(expected)


def test_a_flat_gpu_takes_the_load_off_a_linear_cpu():
    """X = 96 on the H200 note's federation shape: the GPU-like curve is flat, so the
    best split gives it nearly everything, and E of the uniform split says how far off."""
    curves = {"gpu": GPU_LIKE, "cpu4": CPU_LIKE.scaled(0.6), "cpu1": CPU_LIKE}
    sizes = ideal_sizes({}, 96, curves=curves)
    assert sizes["gpu"] > 80
    assert sizes["cpu1"] <= sizes["cpu4"]
    uniform = dict.fromkeys(curves, 32)
    efficiency = balance_efficiency({}, uniform, curves=curves)
    assert efficiency == pytest.approx(
        ideal_round_time({}, 96, curves=curves) / CPU_LIKE.seconds(32)
    )
    assert efficiency < 0.5


def greedy(times, total, min_batch):
    """The textbook greedy from min_batch: each unit to whoever finishes earliest."""
    sizes = [min_batch] * len(times)
    heap = [(t(min_batch + 1), i) for i, t in enumerate(times)]
    heapq.heapify(heap)
    for _ in range(total - min_batch * len(times)):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        heapq.heappush(heap, (times[i](sizes[i] + 1), i))
    return max(t(b) for t, b in zip(times, sizes, strict=True))


@pytest.mark.parametrize("total", [4, 97, 5_000, 40_000])
def test_large_totals_take_the_bisection_and_match_the_greedy(total):
    curves = {
        "gpu": GPU_LIKE,
        "cpu": CPU_LIKE,
        "flat": StepCurve(((1, 0.003), (2048, 0.003))),
        "slow": CPU_LIKE.scaled(3),
    }
    taus = {"gpu": 10, "cpu": 10, "flat": 10, "slow": 10}
    overheads = {"gpu": 0.5, "cpu": 0.0, "flat": 0.01, "slow": 0.0}
    times = [(lambda b, c=c, n=n: overheads[n] + taus[n] * c.seconds(b)) for n, c in curves.items()]
    ideal = ideal_round_time({}, total, taus, overheads, curves=curves)
    assert ideal == greedy(times, total, 1)
