"""The StabilityGuard's floor on every silo's share of the mean batch: half the mean at
first, raised only on a blow-up once the verdict is in; its state round-trips, bad
arguments are refused, set_min_share raises the small sizes."""

from __future__ import annotations

import math

import pytest

from fedlb.balance import BatchSizeManager, PooledProportional, StabilityGuard
from tests.balance_guard_helpers import EQUAL, UNEQUAL, judged


def test_a_fixed_floor_is_half_the_mean_batch_and_rises_only_on_a_blow_up():
    guard = StabilityGuard(probe=0.0)  # the probe off: the default before it
    assert guard.floor == 0.5
    assert guard.regime == "fixed"
    calm = {"a": 1.0, "b": 1.1, "c": 0.9}
    for _ in range(5):  # calm rounds, or scattered ones, do not move the default floor
        verdict = guard.check(calm, {"a": 2.0, "b": 2.1, "c": 1.9}, {"a": 16, "b": 26, "c": 54})
        assert not verdict.diverged
        verdict = guard.check({"a": 1.0, "b": 2.5, "c": 0.4}, {"a": 9.0, "b": 9.0, "c": 9.0})
    assert guard.floor == 0.5
    verdict = guard.check({"a": 1.0, "b": 1.2, "c": 6.0})  # c: 5.5x the others' median
    assert set(verdict.diverged) == {"c"}
    assert "5.5x" in verdict.diverged["c"]
    assert (verdict.floor_before, verdict.floor) == (0.5, 0.75)
    verdict = guard.check({"a": math.nan, "b": 1.0, "c": 1.0})
    assert "not finite" in verdict.diverged["a"]
    verdict = guard.check({"a": 1.0, "b": 1.0}, {"a": math.inf})
    assert "training loss is inf" in verdict.diverged["a"]
    assert guard.floor == 1.0  # the top: uniform sizes
    assert guard.check({"a": 1.0, "b": 99.0}).floor == 1.0
    assert guard.regime == "fixed"


def test_after_the_verdict_only_a_blow_up_moves_the_floor():
    even = {"a": 1.0, "b": 1.05, "c": 0.95}
    guard = StabilityGuard()
    assert judged(guard, [(even, EQUAL), (even, UNEQUAL), (even, UNEQUAL)]).floor == 0.25
    verdict = guard.check({"a": 6.0, "b": 1.2, "c": 1.0}, None, UNEQUAL)
    assert (verdict.look, verdict.floor) == ("diverged", 0.5)  # a blow-up raises it
    assert guard.check({"a": 0.5, "b": 1.0, "c": 1.6}, None, UNEQUAL).floor == 0.5

    restored = StabilityGuard()
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()
    assert (restored.regime, restored.floor) == ("stable", 0.5)


def test_state_round_trips_and_bad_arguments_are_refused():
    guard = StabilityGuard()
    guard.check({"a": 1.0, "b": 1.5}, None, {"a": 32, "b": 32})
    guard.check({"a": 1.5, "b": 2.28}, None, {"a": 20, "b": 44})  # calm: confirming next
    assert guard.baseline_sizes == {"a": 32, "b": 32}
    assert not guard.net_of_noise  # its steps grew 1.5x: the confirmation is read as measured
    copy = StabilityGuard()
    copy.load_state_dict(guard.state_dict())
    assert copy.state_dict() == guard.state_dict()
    assert (copy.regime, copy.floor, copy.probed, copy.confirming) == (
        "undecided",
        0.5,
        True,
        True,
    )
    assert copy.check({"a": 1.0, "b": 1.5}, None, {"a": 20, "b": 44}).regime == "stable"
    for bad, why in (
        ({"floors": (0.5, 0.25)}, "floors must rise"),
        ({"floors": (0.5, 1.5)}, "within"),
        ({"start": 9}, "start must index floors"),
        ({"ratio": 1.0}, "ratio must be"),
        ({"probe": 1.0}, "probe must lie"),
        ({"confirm": -0.1}, "confirm must lie"),
        ({"growth": 1.0}, "growth must be"),
        ({"clear": 4.0}, "clear must lie"),
        ({"quiet": -0.1}, "quiet must lie"),
        ({"quiet": math.nan}, "quiet must lie"),
        ({"edge_floor": 1.5}, "edge_floor must lie"),
        ({"stable_floor": math.nan}, "stable_floor must lie"),
    ):
        with pytest.raises(ValueError, match=why):
            StabilityGuard(**bad)


def test_set_min_share_raises_the_small_sizes_and_keeps_x():
    manager = BatchSizeManager({"a": 14, "b": 27, "c": 55}, PooledProportional())
    sizes = manager.set_min_share(0.5)
    assert sum(sizes.values()) == 96
    assert sizes["a"] == 16
    assert sizes["b"] < sizes["c"]
    assert manager.set_min_share(1.0) == {"a": 32, "b": 32, "c": 32}
