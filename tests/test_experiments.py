"""Emulated silos, clocks, scenarios, and a small policy comparison end to end."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedlb.cli import app
from fedlb.experiments import (
    EmulatedClock,
    Scenario,
    ScenarioError,
    SpeedProfile,
    preset,
)
from fedlb.flower import Balancing, records_from_json_lines


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


SPEEDS = (400.0, 200.0, 100.0)  # samples/s of silos 0, 1, 2 on the model clock


def run_policy(policy, rounds=3):
    """One policy of `fedlb experiment` (POLICIES: its strategy class and arguments), run
    in-process on the model clock as the runner does, with three silos 1:2:4 slower."""
    from flwr.app import ArrayRecord

    from fedlb.deploy import RunConfig
    from fedlb.deploy.server_app import make_balancer
    from fedlb.deploy.task import federation_data, model_for
    from fedlb.experiments import POLICIES
    from tests.flower_fakes import InProcessGrid, fedlb_app, lr_config

    settings = {"num-silos": 3, "local-steps": 4, "batch-size": 16}
    config = RunConfig.from_mapping(settings)

    def clock(context):
        return EmulatedClock("model", SpeedProfile(SPEEDS[context.node_config["partition-id"]]))

    nodes = {100 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)}
    grid = InProcessGrid(nodes, settings, fedlb_app(clock=clock, config=config))
    chosen = POLICIES[policy]
    balancer = make_balancer(RunConfig.from_mapping({**settings, "tuner": chosen.tuner}))
    strategy = chosen.strategy_class(
        min_available_nodes=3,
        evaluate_every=rounds,
        **chosen.strategy_args(),
        balancing=Balancing(batch_size=16, local_steps=4, balancer=balancer, guard=chosen.guard),
    )
    pool, _ = federation_data(config)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model_for(config, pool).state_dict()),
        num_rounds=rounds,
        timeout=30,
        train_config=lr_config(0.1),
    )
    sent: dict[int, dict[int, dict]] = {}
    for msg in grid.sent:
        if msg.metadata.message_type == "train":
            config_sent = dict(msg.content["config"])
            sent.setdefault(config_sent["server-round"], {})[msg.metadata.dst_node_id] = config_sent
    return strategy, [sent[k] for k in sorted(sent)]


def test_a_policy_whose_rounds_ended_short_of_the_target_and_the_clock_is_flagged():
    """A balanced policy's rounds are shorter: with the same number of rounds it can stop
    before the others' clock, so a target it missed says nothing of time to target."""
    from fedlb.cli.experiment import ended_early

    def row(clock, ttt, reached=None):
        out = {"total_clock_s": clock, "time_to_target_s": ttt}
        return out if reached is None else {**out, "reached_target": reached}

    summary = {
        "policies": {
            "fedavg": row(1.13, 0.9, "2/2"),
            "lb-floor": row(0.70, 0.57, "2/2"),
            "lb": row(0.46, None, "1/2"),  # short of the clock and of the target
            "lb-full": row(1.10, None, "0/2"),  # at the clock: its miss is its own
        }
    }
    (note,) = ended_early(summary, rounds=12)
    assert note.startswith("lb: its 12 rounds ended at 0.46 s of clock, before fedavg's 1.13")
    assert "--rounds 30" in note  # 12 x 1.13 / 0.46, rounded up
    one_seed = {"policies": {"fedavg": row(1.0, 0.8), "lb": row(0.5, None)}}
    assert ended_early(one_seed, rounds=10)[0].endswith("(--rounds 20)")
    assert ended_early({"policies": {"lb": row(0.5, 0.4)}}, rounds=10) == []


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize(
    "policy", ["fedavg", "lb", "lb-full", "lb-tau", "lb-lr", "deadband", "quorum"]
)
def test_each_policy_does_what_it_says(policy):
    from fedlb.flower.protocol import BATCH_SIZE, LEARNING_RATE, LOCAL_STEPS

    strategy, rounds = run_policy(policy)
    records = strategy.reporter.records
    assert [r.round for r in records] == [1, 2, 3]
    last = rounds[-1]
    sizes = {node: orders[BATCH_SIZE] for node, orders in last.items()}
    steps = {node: orders[LOCAL_STEPS] for node, orders in last.items()}
    rates = {node: orders[LEARNING_RATE] for node, orders in last.items()}
    assert set(last) == {100, 101, 102}  # every policy sends every silo work
    if policy in ("fedavg", "quorum"):
        assert set(sizes.values()) == {16}
        assert set(steps.values()) == {4}
    if policy == "quorum":  # the fastest ⌈3/2⌉ = 2 updates only
        assert all({s.node for s in r.silos} == {100, 101} for r in records)
    if policy in ("lb", "lb-full", "lb-lr"):  # B follows the speeds 4:2:1, τ stays
        assert sizes[100] > sizes[101] > sizes[102]
        assert sum(sizes.values()) == 48
        assert set(steps.values()) == {4}
    if policy == "lb-full":  # LB-BSP as published: fully balanced
        assert records[-1].efficiency > 0.95
    if policy in ("lb", "lb-lr"):  # the stability guard: no silo below half the mean B
        first = {s.node: s.batch_size for s in records[1].silos}  # the first balanced round
        assert min(first.values()) == 8
        assert records[1].efficiency == pytest.approx(7 / 8, abs=0.03)
        assert strategy.guard is not None
    if policy == "deadband":  # moves toward the speeds, X kept
        assert sizes[100] >= sizes[101] >= sizes[102]
        assert sum(sizes.values()) == 48
    if policy == "lb-tau":  # τ follows the speeds, B stays (Σ τ kept)
        assert set(sizes.values()) == {16}
        assert steps[100] > steps[101] > steps[102]
        assert sum(steps.values()) == 12
        assert records[-1].efficiency > 0.95
    if policy == "lb-lr":  # η_i = η · B_i / B0
        for node, rate in rates.items():
            assert rate == pytest.approx(0.1 * sizes[node] / 16)
    else:  # the app's learning rate reaches every silo untouched
        assert set(rates.values()) == {0.1}


def test_variants_refuse_what_they_cannot_run():
    from fedlb.experiments.variants import QuorumFedAvg, StepsTunedFedAvg

    with pytest.raises(ValueError, match="tuning τ needs batch_size and local_steps"):
        StepsTunedFedAvg(balancing=Balancing(local_steps=5))
    with pytest.raises(ValueError, match="quorum must be a fraction"):
        QuorumFedAvg(quorum=1.5)


@pytest.mark.slow
def test_an_experiment_runs_on_a_two_node_ray_cluster(tmp_path):
    """A Ray head that hosts no silo (0 CPUs) and a second node with one CPU, as a cluster
    of two machines would be: Flower places ClientApp actors only where a CPU is free, so
    the experiment finishing means its silos trained on the second node; the policy is
    asynchronous FedBuff, its messages one silo at a time. Every Ray process is gone once
    the nodes are stopped."""
    import psutil
    import ray

    from fedlb.deploy import start_ray_head, start_ray_node

    with (
        start_ray_head(tmp_path / "ray", num_cpus=0) as head,
        start_ray_node(tmp_path / "ray", head.address, num_cpus=1, name="second") as second,
    ):
        ray.init(address=head.address, logging_level="ERROR")
        try:
            nodes = [n for n in ray.nodes() if n["Alive"]]
        finally:
            ray.shutdown()
        assert sorted(n["Resources"].get("CPU", 0) for n in nodes) == [0, 1]
        started = [psutil.Process(p.process.pid).children(recursive=True) for p in (head, second)]
        result = CliRunner().invoke(
            app,
            [
                "experiment",
                *("--silos", "2", "--speeds", "1,2", "--rounds", "2", "--local-steps", "3"),
                *("--batch-size", "16", "--policies", "fedbuff", "--target-accuracy", "0.2"),
                *("--ray-address", head.address, "--out", str(tmp_path / "out")),
            ],
        )
        assert result.exit_code == 0, result.output
        assert f"on the Ray cluster at {head.address}" in result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    # FedBuff (asynchronous, K = 1 of 2 silos): FedAvg's 2 rounds of work, 4 updates
    assert summary["policies"]["fedbuff"]["rounds"] == 4
    assert summary["policies"]["fedbuff"]["final_accuracy"] is not None
    _, alive = psutil.wait_procs([p for group in started for p in group], timeout=20)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def test_a_ray_address_is_host_and_port():
    assert Scenario.from_mapping({"ray-address": "10.0.0.5:6379"}).ray_address
    for wrong in ("10.0.0.5", "auto", "host:port", ":6379", "h:99999"):
        with pytest.raises(ScenarioError, match="ray-address must be host:port"):
            Scenario.from_mapping({"ray-address": wrong})


@pytest.mark.slow
def test_a_small_comparison_end_to_end(tmp_path):
    """`flwr run` on a simulation SuperLink, model clock, two policies, two seeds, digits (each
    policy's own behaviour: test_each_policy_does_what_it_says, in-process)."""
    result = CliRunner().invoke(
        app,
        [
            "experiment",
            "--silos",
            "3",
            "--speeds",
            "1,2,4",
            "--rounds",
            "3",
            "--local-steps",
            "5",
            "--batch-size",
            "16",
            "--learning-rate",
            "0.1",
            "--policies",
            "fedavg,lb",
            "--target-accuracy",
            "0.3",
            "--repeats",
            "2",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "speedup" in result.output
    assert "fedavg's time to target" in result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["clock"] == "model"
    assert set(summary["policies"]) == {"fedavg", "lb"}
    for row in summary["policies"].values():
        assert {
            "time_to_target_s",
            "best_accuracy",
            "final_accuracy",
            "mean_balance_efficiency",
            "idle_fraction",
            "rounds",
            "steady_balance_efficiency",
            "reached_target",
        } <= set(row)
        assert row["rounds"] == 3
        assert set(row["per_seed"]) == {"0", "1"}
    assert summary["seeds"] == [0, 1]
    # FedAvg's round 5·16/100 = 0.8 s; the best integer split of 48 is 7:14:27, 0.35 s
    assert summary["speedup_ceiling"] == pytest.approx(0.8 / 0.35)
    # each policy's speedup is in the file, and the console shows what the file holds
    fedavg, lb = (summary["policies"][p]["time_to_target_s"] for p in ("fedavg", "lb"))
    speedup = summary["policies"]["lb"]["speedup_over_fedavg"]
    if fedavg and lb:
        assert summary["policies"]["fedavg"]["speedup_over_fedavg"] == pytest.approx(1.0)
        assert speedup == pytest.approx(fedavg / lb)
        assert f"{speedup:.2f}x" in result.output
    else:  # one of them missed the target (over both seeds): no speedup to claim
        assert speedup is None
    for seed in (0, 1):
        folder = tmp_path / f"seed-{seed}"
        assert {"summary.json", "partition.json", "rounds.jsonl"} <= {
            p.name for p in folder.iterdir()
        }
    assert (tmp_path / "accuracy.png").stat().st_size > 5000
    assert (tmp_path / "accuracy_by_round.png").stat().st_size > 5000
    # the four runs were forks of one warm simulation server (fedlb.deploy.warm)
    superlink_log = (tmp_path / "processes" / "superlink.log").read_text()
    assert superlink_log.count("serving simulation tasks") == 1
    assert superlink_log.count("Created run") == 4
    # forked from a fork-safe server (fedlb.deploy.fork_safety): armed, never tripped
    forks = [line for line in superlink_log.splitlines() if "runs in pid" in line]
    assert len(forks) == 4, forks
    for line in forks:
        assert "(forked; tripwire armed, tripped by nothing, CUDA initialised: no" in line
    # re-summarising from rounds.jsonl at the same target gives the same summary
    from fedlb.experiments import summarise_results

    _, again = summarise_results(tmp_path, 0.3)
    assert again["policies"] == summary["policies"]
    # and from the CLI, at another target, with the plots drawn again
    (tmp_path / "accuracy_by_round.png").unlink()
    redone = CliRunner().invoke(
        app, ["experiment", "--from-results", str(tmp_path), "--target-accuracy", "0.2"]
    )
    assert redone.exit_code == 0, redone.output
    assert (tmp_path / "summary-target-0.2.json").exists()
    assert (tmp_path / "accuracy_by_round.png").stat().st_size > 5000
    # a damaged copy is refused with one line naming the line, not a traceback
    import shutil

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in ("summary.json", "rounds.jsonl"):
        shutil.copy(tmp_path / name, damaged / name)
    lines = (damaged / "rounds.jsonl").read_text().splitlines()
    lines[2] = lines[2][: len(lines[2]) // 2]
    (damaged / "rounds.jsonl").write_text("\n".join(lines) + "\n")
    refused = CliRunner().invoke(
        app, ["experiment", "--from-results", str(damaged), "--target-accuracy", "0.2"]
    )
    assert refused.exit_code == 2, refused.output
    # the usage box wraps the message anywhere in or after the folder's path (a long one
    # is folded mid-word): compared without the box and the white space
    unwrapped = "".join(refused.output.replace("│", "").split())
    assert "rounds.jsonlline3isnotanexperiment'sroundrecord" in unwrapped
    assert "Traceback" not in refused.output
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert {r["seed"] for r in rows} == {0, 1}
    rows = [r for r in rows if r["seed"] == 0]
    by = {}
    for row in rows:
        by.setdefault(row["policy"], []).append(row)
    assert all(r["clock"] == "model" for r in rows)
    # fedavg: uniform B; lb: B moves toward 1:2:4 with τ fixed, from round 2 as far as the
    # stability guard lets it (no silo below half the mean B: E = 7/8 at 1:2:4, model clock)
    assert {r["batch_size"] for r in by["fedavg"]} == {16}
    lb_late = [r for r in by["lb"] if r["round"] >= 2]
    assert min(r["efficiency"] for r in lb_late) == pytest.approx(7 / 8, abs=0.03)
    assert {r["local_steps"] for r in by["lb"]} == {5}
    sizes = {r["silo"]: r["batch_size"] for r in lb_late if r["round"] == 3}
    assert sizes["silo-2"] > sizes["silo-1"] > sizes["silo-0"]
    # the clock: lb's rounds are shorter than fedavg's
    assert (
        summary["policies"]["lb"]["total_clock_s"] < summary["policies"]["fedavg"]["total_clock_s"]
    )
    for png in ("accuracy.png", "batch_sizes.png", "round_time.png", "idle.png"):
        assert (tmp_path / "seed-0" / png).stat().st_size > 5000
    parts = json.loads((tmp_path / "seed-0" / "partition.json").read_text())
    assert len(parts) == 3
    assert np.sum([p["samples"] for p in parts]) > 1000


@pytest.mark.slow
def test_a_second_run_starts_balanced_at_the_first_runs_verdict(tmp_path):
    """--second-run: each policy runs twice with its own profiles folder; the second run,
    reported, starts from the first's stored profiles and takes up its verdict."""
    result = CliRunner().invoke(
        app,
        [
            "experiment",
            *("--silos", "3", "--speeds", "1,2,4", "--rounds", "3", "--local-steps", "5"),
            *("--batch-size", "16", "--learning-rate", "0.1", "--policies", "lb"),
            *("--second-run", "--out", str(tmp_path), "--no-page"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "each policy's second run" in result.output
    folder = tmp_path / "policies" / "lb"
    first = json.loads((folder / "first-run" / "summary.json").read_text())["stability"]
    assert first["regime"] in ("stable", "edge")
    assert first["remembered"] is None
    assert (folder / "profiles" / "verdicts.json").exists()
    second = json.loads((tmp_path / "summary.json").read_text())["policies"]["lb"]
    assert second["stability"]["remembered"].startswith(f"{first['regime']}, found ")
    rounds = records_from_json_lines((folder / "rounds.jsonl").read_text().splitlines())
    balanced = len({s.batch_size for s in rounds[0].silos}) == 3  # from round 1
    assert balanced == (first["regime"] == "stable")  # at the edge: B0, as a first run


@pytest.mark.slow
def test_experiments_run_under_he(tmp_path):
    """The Simulation Engine with CKKS: the silos' mod and the encrypted average, and the
    HE seconds in every silo's fixed cost."""
    result = CliRunner().invoke(
        app,
        [
            "experiment",
            "--silos",
            "2",
            "--speeds",
            "1,3",
            "--rounds",
            "2",
            "--local-steps",
            "5",
            "--batch-size",
            "16",
            "--policies",
            "lb",
            "--he",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "HE: CKKS" in result.output
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    assert all(0 < r["he_s"] <= r["fixed_s"] for r in rows)
    assert rows[-1]["accuracy"] is not None  # federated evaluation: the server cannot
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["scenario"]["he"] is True


def test_the_experiment_app_declares_every_run_config_key():
    """Flower drops --run-config keys its app does not declare: the experiment app's
    defaults must be exactly the keys simulation.run_config sends."""
    from fedlb.experiments.simulation import app_defaults, app_dir, run_config

    shipped = tomllib.loads((app_dir() / "pyproject.toml").read_text())
    declared = shipped["tool"]["flwr"]["app"]["config"]
    assert declared == app_defaults()
    assert set(run_config(Scenario(), "lb", Path("/x"))) == set(declared)


def test_an_experiment_never_replaces_an_earlier_runs_results_unasked(tmp_path):
    """Into a finished run's folder (an experiment's or a server's, or a symlink to one):
    refused before anything runs, the results untouched; --overwrite replaces them."""
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "rounds.jsonl").write_text('{"round": 1}\n')
    (earlier / "summary.json").write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(earlier)
    for folder in (earlier, link):
        result = CliRunner().invoke(app, ["experiment", "--rounds", "1", "--out", str(folder)])
        assert result.exit_code == 2, result.output
        said = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())  # rich's box
        assert "holds an earlier run (rounds.jsonl, summary.json)" in said
        assert "--overwrite" in said
    assert (earlier / "rounds.jsonl").read_text() == '{"round": 1}\n'
    assert (earlier / "summary.json").read_text() == "{}"


@pytest.mark.slow
def test_the_live_page_follows_an_experiments_policies(tmp_path):
    """`fedlb experiment` as a user starts it (its own process, the page on by default):
    while it runs, the page's /api/state names the policy under way and draws each
    policy's accuracy against its own clock, point for point what rounds.jsonl records."""
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    from fedlb.deploy.processes import free_port
    from fedlb.flower import accuracy_of, records_from_json_lines

    port = free_port()
    out = tmp_path / "out"
    command = [sys.executable, "-m", "fedlb.cli", "experiment", "--silos", "3", "--speeds"]
    command += ["1,2,4", "--rounds", "3", "--local-steps", "5", "--batch-size", "16"]
    command += ["--policies", "fedavg,lb", "--page-port", str(port), "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    shots = []
    try:
        while process.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=2) as r:
                    shots.append(json.loads(r.read()))
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or gone at the end
            time.sleep(0.1)
        output = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert f"live page: http://127.0.0.1:{port}/" in " ".join(output.split())
    names = [shot["run"].get("name", "") for shot in shots]
    assert any(name.endswith(": fedavg") for name in names)
    assert any(name.endswith(": lb") for name in names)
    expected = {}
    for policy in ("fedavg", "lb"):
        records = records_from_json_lines(
            (out / "policies" / policy / "rounds.jsonl").read_text().splitlines()
        )
        clock, points = 0.0, []
        for record in records:
            clock += record.round_s or 0.0
            points.append([pytest.approx(clock), pytest.approx(accuracy_of(record))])
        expected[policy] = points
        assert len(points) == 3
    seen = {p: max((s["policies"].get(p, []) for s in shots), key=len) for p in expected}
    assert seen["fedavg"] == expected["fedavg"]  # every round of the first policy, drawn
    assert seen["lb"]  # the second's as far as the last poll before the page stopped
    assert seen["lb"] == expected["lb"][: len(seen["lb"])]
