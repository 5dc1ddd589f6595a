"""Emulated silos and clocks, and the scenarios built on them: speed traces, the model
clock, presets, bad and shipped scenarios, the speedup ceiling, seeds combined."""

from __future__ import annotations

import pytest

from fedlb.experiments import EmulatedClock, Scenario, ScenarioError, SpeedProfile, preset


def test_speed_traces():
    assert SpeedProfile(100).speed_at(7) == 100
    step = SpeedProfile(100, trace="step:5:0.5")
    assert [step.speed_at(r) for r in (4, 5, 9)] == [100, 50, 50]
    periodic = SpeedProfile(100, trace="periodic:2:0.25")
    assert [periodic.speed_at(r) for r in range(1, 7)] == [100, 100, 25, 25, 100, 100]
    walk = SpeedProfile(100, trace="walk:0.3", seed=4)
    values = [walk.speed_at(r) for r in range(1, 30)]
    assert values == [SpeedProfile(100, trace="walk:0.3", seed=4).speed_at(r) for r in range(1, 30)]
    assert len(set(values)) > 10
    assert all(25 <= v <= 400 for v in values)
    for bad in ("jump", "step:5", "periodic:x:1", "walk"):
        with pytest.raises(ValueError, match="trace"):
            SpeedProfile(100, trace=bad)


def test_model_clock_reports_the_model_and_measured_paces():
    profile = SpeedProfile(200.0, overhead=0.5)
    model = EmulatedClock("model", profile)
    assert model.report(1, batch_size=20, steps=10, compute_s=0.01, fixed_s=0.001) == (1.0, 0.5)
    assert model.pace(1) is None
    assert model.fixed_cost(1) == 0.0
    measured = EmulatedClock("measured", profile)
    assert measured.pace(1)(0.001, 20) == pytest.approx(0.1)
    assert measured.fixed_cost(1) == 0.5
    with pytest.raises(ValueError, match="clock must be one of"):
        EmulatedClock("wall", profile)


def test_presets():
    ec2 = preset("ec2-5", 100.0)
    assert len(ec2) == 5
    assert max(ec2) == 100.0
    hetero = preset("hetero-4:5", 10.0)
    assert max(hetero) / min(hetero) == pytest.approx(4)
    assert preset("1,2", 3.0) == [3.0, 6.0]
    with pytest.raises(ValueError, match="hetero-K:N"):
        preset("hetero-4", 1.0)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"silo": 3}, "unknown scenario key"),
        ({"rounds": "3"}, "rounds must be int"),
        ({"clock": "wall"}, "clock must be one of"),
        ({"policies": "fedavg,magic"}, "unknown policies ['magic']"),
        ({"silos": 3, "speeds": "1,2"}, "give 2 silos, not 3"),
        ({"overheads": "1,2"}, "overheads has 2 values for 4 silos"),
        ({"traces": "jump"}, "unknown speed trace"),
        ({"partition": "shards"}, "unknown partition"),
        ({"target-accuracy": 1.5}, "target-accuracy must be in"),
        ({"speeds": "1,0,3,6"}, "speeds must all be > 0"),
        ({"speeds": "1,-2,3,6"}, "speeds must all be > 0"),
        ({"base-speed": 0.0}, "base-speed must be > 0"),
        ({"overheads": "0,0,-1,0"}, "silo 2 (speeds, overheads, traces"),
        ({"silos": 2000, "speeds": "hetero-2:2000"}, "cannot be split among 2000 silos"),
        ({"partition": "classes:11"}, "classes_per_silo must be in [1, 10]"),
    ],
)
def test_bad_scenarios_are_refused(values, message):
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_mapping(values).check_data()  # what `fedlb experiment` checks first
    assert message in str(caught.value)


def test_the_shipped_scenarios_parse():
    from pathlib import Path

    for path in sorted(Path("scenarios").glob("*.toml")):
        scenario = Scenario.from_file(path)
        assert scenario.policy_names()


def test_the_speedup_ceiling_is_uniform_over_ideal_round_time():
    # speeds 100 and 300 samples/s, τ = 10, B0 = 16: FedAvg's round 10·16/100 = 1.6 s; the
    # best split of 32 is 8 : 24, 0.8 s each: the ceiling is 2x. With 0.4 s fixed cost each:
    # (0.4 + 1.6) / (0.4 + 0.8) = 1.67x.
    values = {"silos": 2, "speeds": "1,3", "base-speed": 100.0, "local-steps": 10, "batch-size": 16}
    values["rounds"] = 3
    assert Scenario.from_mapping(values).speedup_ceiling() == pytest.approx(2.0)
    fixed = Scenario.from_mapping({**values, "overheads": "0.4"})
    assert fixed.speedup_ceiling() == pytest.approx(2.0 / 1.2)
    # the fast silo slows 3x from round 2: uniform rounds 1.6, 1.6, 1.6; ideal 0.8, 1.6, 1.6
    step = Scenario.from_mapping({**values, "traces": "static,step:2:0.333333333"})
    assert step.speedup_ceiling() == pytest.approx(4.8 / 4.0, rel=1e-3)


def test_seeds_combine_into_means_with_spread_and_reach():
    from fedlb.experiments.results import combine_seeds

    scenario = Scenario.from_mapping({"policies": "fedavg,lb", "repeats": 2, "seed": 5})
    assert scenario.seeds() == [5, 6]

    def one(ttt_lb, final_lb, regime):
        row = {"time_to_target_s": None, "final_accuracy": 0.5, "rounds": 4, "stability": None}
        verdict = {"regime": regime, "decided_in_round": 3, "probe_dispersion": 0.1}
        return {
            "speedup_ceiling": 2.0,
            "policies": {
                "fedavg": row,
                "lb": {
                    **row,
                    "time_to_target_s": ttt_lb,
                    "final_accuracy": final_lb,
                    "stability": verdict,
                },
            },
        }

    combined = combine_seeds(scenario, {5: one(10.0, 0.6, "stable"), 6: one(20.0, 0.8, "edge")})
    lb, fedavg = combined["policies"]["lb"], combined["policies"]["fedavg"]
    assert lb["time_to_target_s"] == pytest.approx(15.0)
    assert lb["final_accuracy"] == pytest.approx(0.7)
    assert lb["final_accuracy_std"] == pytest.approx(0.1414, abs=1e-4)
    assert lb["reached_target"] == "2/2"
    assert fedavg["time_to_target_s"] is None
    assert fedavg["reached_target"] == "0/2"
    assert set(lb["per_seed"]) == {"5", "6"}
    assert combined["seeds"] == [5, 6]
    assert combined["speedup_ceiling"] == 2.0
    assert lb["stability"] == {"stable": 1, "edge": 1}  # the guard's verdicts, counted
    assert fedavg["stability"] == {}
