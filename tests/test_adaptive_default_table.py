"""benchmarks/adaptive_default.py: experiment folders of one scenario merge by seed, and
the default-vs-floor ratio is also given paired seed by seed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.adaptive_default import (
    experiment_settings,
    paired_ratio,
    table,
    with_comparisons,
)

SCENARIO = {
    "name": "s",
    "dataset": "digits",
    "model": "mlp",
    "partition": "iid",
    "learning_rate": 0.1,
    "silos": 3,
    "speeds": "1,2,4",
    "rounds": 5,
    "target_accuracy": 0.6,
    "seed": 0,
}


def run(seconds: float | None, accuracy: float = 0.7) -> dict[str, object]:
    return {
        "time_to_target_s": seconds,
        "final_accuracy": accuracy,
        "mean_balance_efficiency": 0.9,
        "stability": {"regime": "stable"},
    }


def folder(root: Path, name: str, policies: dict[str, dict[str, dict[str, object]]]) -> Path:
    path = root / name
    path.mkdir()
    summary = {
        "scenario": SCENARIO,
        "policies": {p: {"per_seed": seeds} for p, seeds in policies.items()},
    }
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_a_later_folder_adds_its_seeds_and_replaces_those_it_ran_again(tmp_path):
    first = folder(
        tmp_path,
        "a",
        {
            "lb-floor": {"0": run(10.0), "1": run(12.0)},
            "lb": {"0": run(99.0), "1": run(99.0)},  # an earlier default, run again below
        },
    )
    second = folder(
        tmp_path,
        "b",
        {"lb-floor": {"2": run(None)}, "lb": {"0": run(8.0), "1": run(10.0), "2": run(9.0)}},
    )
    (setting,) = experiment_settings([first, second])
    floor, default = setting["roles"]["floor"], setting["roles"]["default"]
    assert (floor["runs"], default["runs"]) == (3, 3)
    assert floor["reached"] == 2
    assert default["times"] == {0: 8.0, 1: 10.0, 2: 9.0}
    # seed by seed: 10/8, 12/10, and seed 2 reached only by the default (infinitely sooner)
    assert paired_ratio(floor, default) == pytest.approx(1.25)
    assert "(paired 1.25x)" in table(with_comparisons([setting]))


def test_the_paired_ratio_skips_seeds_neither_reached_and_needs_two():
    floor = {"times": {0: None, 1: 9.0, 2: 8.0}}
    default = {"times": {0: None, 1: 9.0, 2: None}}
    # seed 0: neither (skipped); seed 1: 1.0; seed 2: the floor only (0.0)
    assert paired_ratio(floor, default) == pytest.approx(0.5)
    assert paired_ratio({"times": {0: 5.0}}, {"times": {0: 4.0}}) is None
    assert math.isinf(paired_ratio({"times": {0: None, 1: None}}, {"times": {0: 1.0, 1: 2.0}}))


def test_the_paired_interval_and_the_collapse_test_say_how_sure_the_seeds_make_it():
    from benchmarks.adaptive_default import more_collapses_p, paired_interval

    seeds = range(20)
    floor = {"times": {s: 10.0 for s in seeds}}
    steady = {"times": {s: 8.0 for s in seeds}}  # every seed 1.25x: no doubt
    assert paired_interval(floor, steady) == pytest.approx((1.25, 1.25))
    mixed = {"times": {s: 8.0 if s % 2 else 12.0 for s in seeds}}  # half sooner, half later
    low, high = paired_interval(floor, mixed)
    assert low < 1.0 < high
    assert paired_interval({"times": {0: 1.0}}, {"times": {0: 1.0}}) is None  # too few
    # a seed only the default reached is an infinite ratio, not an error
    low, high = paired_interval({"times": {**floor["times"], 0: None}}, steady)
    assert (low, high) == pytest.approx((1.25, 1.25))  # 19 of 20 at 1.25x: the median
    stock = {"runs": 60, "collapsed": 0}
    assert more_collapses_p(stock, {"runs": 60, "collapsed": 0}) == pytest.approx(1.0)
    assert more_collapses_p(stock, {"runs": 60, "collapsed": 1}) == pytest.approx(0.5)
    assert more_collapses_p(stock, {"runs": 60, "collapsed": 8}) < 0.01
    assert more_collapses_p(stock, {"runs": 60, "collapsed": None}) is None


def test_a_second_run_is_its_own_setting_with_stocks_only_run_beside_it(tmp_path):
    from benchmarks.adaptive_default import app_settings

    def row(policy, seed, final, second=False):
        values = {
            "app": "quickstart",
            "policy": policy,
            "seed": seed,
            "rounds": 2,
            "overrides": {"learning-rate": 0.1},
            "speeds": [100, 400],
            "final_accuracy": final,
            "accuracy_by_round": [0.1, 0.5, final],
            "round_s": [4.0, 2.0],
            "efficiency": [0.5, 1.0],
        }
        return json.dumps({**values, "second_run": True} if second else values)

    runs = tmp_path / "runs.jsonl"
    lines = [row("stock", 0, 0.8), row("default", 0, 0.7), row("default", 0, 0.9, second=True)]
    runs.write_text("\n".join(lines) + "\n")
    first, second = app_settings([runs], target=0.6)
    assert not first["setting"].endswith("second run")
    assert second["setting"].endswith(", 2 rounds, second run")
    assert second["roles"]["default"]["final_accuracy"] == [0.9]
    assert second["roles"]["stock"] == first["roles"]["stock"]  # stock's one run, both


def test_an_experiments_second_run_takes_stock_from_its_first_run(tmp_path):
    first = folder(tmp_path, "a", {"fedavg": {"0": run(20.0)}, "lb": {"0": run(10.0)}})
    second = tmp_path / "b"
    second.mkdir()
    summary = {
        "scenario": {**SCENARIO, "second_run": True},
        "policies": {"lb": {"per_seed": {"0": run(7.0)}}},
    }
    (second / "summary.json").write_text(json.dumps(summary))
    one, two = experiment_settings([first, second])
    assert two["setting"] == one["setting"] + ", second run"
    assert two["roles"]["stock"] == one["roles"]["stock"]
    assert two["roles"]["default"]["times"] == {0: 7.0}
