"""Experiments run end to end through `fedlb experiment`: a small policy comparison, on a
two-node Ray cluster, under HE, a second run starting at the first's verdict, the app's
run config keys, earlier results kept, the live page following the policies."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedlb.cli import app
from fedlb.experiments import Scenario, ScenarioError
from fedlb.flower import records_from_json_lines


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
    # fedavg: uniform B; lb: round 2 the stability guard's look (every silo at B0 = 16, the
    # slow silos' steps cut: τ 5 / 4 / 2), then B moves toward 1:2:4 with τ fixed, as far as
    # the guard lets it (no silo below half the mean B: E = 7/8 at 1:2:4, model clock)
    assert {r["batch_size"] for r in by["fedavg"]} == {16}
    lb_late = [r for r in by["lb"] if r["round"] >= 2]
    assert min(r["efficiency"] for r in lb_late) == pytest.approx(7 / 8, abs=0.03)
    assert {r["local_steps"] for r in by["lb"] if r["round"] != 2} == {5}
    assert {r["batch_size"] for r in by["lb"] if r["round"] == 2} == {16}
    assert {r["local_steps"] for r in by["lb"] if r["round"] == 2} == {2, 4, 5}
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
