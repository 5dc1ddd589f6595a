"""End to end: a real SuperLink and real SuperNodes on loopback, fedlb's app submitted
with `flwr run`, everything stopped by PID afterwards: three silos at speed factors 1, 2
and 4, the next run starting balanced at the first's verdict, `fedlb demo` on measured
step-time curves."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.flower_deploy_helpers import BASE_SPEED, probe_public_door, record_port, run_settings

pytestmark = pytest.mark.slow


def test_three_silos_with_speed_factors_1_2_4(tmp_path):
    """From Python, without the CLI (the deployment as a library): the server's and the
    silos' settings from the example files with the caller's values on top, the silos
    started once the SuperLink is up, `run_server` blocking until the run ends and
    stopping what it started."""
    from pathlib import Path

    from fedlb.deploy import run_server, server_settings, silo_settings, start_silo

    out = tmp_path / "out"
    silos = []

    def start_silos(ready):  # once the SuperLink is up, before round 1; side by side
        from concurrent.futures import ThreadPoolExecutor

        settings = [
            silo_settings(
                Path(f"silos/silo-{i}.toml"),
                {
                    "server": ready.address,
                    "slowdown": float(factor),
                    "base-speed": BASE_SPEED,
                    "workdir": str(tmp_path / f"silo-{i}"),
                },
            )
            for i, factor in enumerate((1, 2, 4))
        ]
        with ThreadPoolExecutor(len(settings)) as pool:
            silos.extend(pool.map(start_silo, settings))

    rounds = []
    probed = []

    def on_round(record):  # a stranger on the public port tries to list and stop the run
        rounds.append(record)
        if record.round == 1:
            control = json.loads((out / "server.json").read_text())["control"]
            probed.append(probe_public_door(f"127.0.0.1:{record_port(out)}", control))

    server, run = server_settings(
        Path("server/server.toml"),
        {"port": 0, "out-dir": str(out), "run-timeout": 400.0},
        {k: v for k, v in run_settings(out, **{"keep-updates": 1}).items() if k != "out-dir"},
    )
    try:
        outcome = run_server(server, run, on_ready=start_silos, on_round=on_round)
    finally:
        for silo in silos:
            silo.stop()
    assert outcome.ok, (outcome.status, outcome.log_path.read_text()[-3000:])
    assert probed == [outcome.run_id]  # the live run, which the stranger did not stop
    assert len(outcome.records) == 3
    assert [r.round for r in rounds] == [1, 2, 3]
    assert outcome.model_path == out / "model.pt"
    pids = [p["pid"] for p in json.loads((out / "server.json").read_text())["processes"]]
    pids += [silo.pid for silo in silos]

    sizes = {r.round: {s.silo: s.batch_size for s in r.silos} for r in outcome.records}
    assert sizes[1] == {"silo-0": 16, "silo-1": 16, "silo-2": 16}  # uniform start
    for by_silo in sizes.values():
        assert sum(by_silo.values()) == 48  # X preserved
    last = sizes[3]
    assert last["silo-0"] > last["silo-1"] > last["silo-2"]
    assert last["silo-0"] / last["silo-2"] >= 2.5  # toward 4 : 2 : 1
    assert min(last.values()) >= 8  # the stability guard: no silo below half the mean B
    assert outcome.records[-1].efficiency > 0.8  # 27:14:7 is E = 1; the floor's 26:14:8 ~0.86
    assert all(not r.rejected and not r.failed for r in outcome.records)
    assert outcome.records[-1].accuracy is not None

    # The aggregate is the dataset-size-weighted mean of the updates the server received.
    for k in (1, 2, 3):
        with np.load(out / "updates" / f"round-{k}.npz") as saved:
            nodes = [name.split("/")[1] for name in saved.files if name.startswith("weight/")]
            weights = {n: float(saved[f"weight/{n}"]) for n in nodes}
            assert len(set(weights.values())) >= 1
            keys = [n.split("/", 1)[1] for n in saved.files if n.startswith("aggregate/")]
            total = sum(weights.values())
            for key in keys:
                expected = sum(saved[f"update/{n}/{key}"] * weights[n] / total for n in nodes)
                np.testing.assert_allclose(
                    saved[f"aggregate/{key}"], expected, rtol=1e-5, atol=1e-6
                )

    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 3
    assert set(summary["final_sizes"]) == {"silo-0", "silo-1", "silo-2"}
    assert sum(summary["final_sizes"].values()) == 48
    for pid in pids:  # everything we started is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_next_run_starts_balanced_at_the_first_runs_verdict(tmp_path, monkeypatch):
    """Real processes, run twice with one profiles folder (as a deployment would be): the
    second run's guard takes up the first run's verdict instead of probing, though its
    out-dir and seed differ; stable, its round 1 is balanced from the silos' stored
    profiles at full balance, at the edge it runs at B0 as a first run's."""
    from pathlib import Path

    from fedlb.deploy import run_server, server_settings, silo_settings, start_silo

    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))  # every process's

    def run(name, seed):
        out, silos = tmp_path / name, []

        def start_silos(ready):
            for i, factor in enumerate((1, 2, 4)):
                values = {
                    "server": ready.address,
                    "slowdown": float(factor),
                    "base-speed": BASE_SPEED,
                    "workdir": str(tmp_path / f"{name}-silo-{i}"),
                }
                silos.append(start_silo(silo_settings(Path(f"silos/silo-{i}.toml"), values)))

        server, settings = server_settings(
            Path("server/server.toml"),
            {"port": 0, "out-dir": str(out), "run-timeout": 400.0},
            {k: v for k, v in run_settings(out, seed=seed).items() if k != "out-dir"},
        )
        try:
            outcome = run_server(server, settings, on_ready=start_silos)
        finally:
            for silo in silos:
                silo.stop()
        assert outcome.ok, (outcome.status, outcome.log_path.read_text()[-3000:])
        return outcome, json.loads((out / "summary.json").read_text())["stability"]

    first, judged = run("first", seed=0)
    assert judged["regime"] in ("stable", "edge")
    assert judged["remembered"] is None
    assert {s.batch_size for s in first.records[0].silos} == {16}  # round 1 uniform
    second, taken = run("second", seed=1)
    assert taken["remembered"].startswith(f"{judged['regime']}, found ")
    assert taken["decided_in_round"] is None  # no probe ran
    said = [e for e in second.records[0].events if "takes up the last run's verdict" in e]
    assert len(said) == 1  # in round 1's table, as the log says it
    sizes = {s.silo: s.batch_size for s in second.records[0].silos}
    if judged["regime"] == "stable":  # balanced from round 1, below the floor's 8: 27:14:7
        assert sizes["silo-0"] > sizes["silo-1"] > sizes["silo-2"]
        assert 4 <= sizes["silo-2"] < 8
    else:
        assert set(sizes.values()) == {16}


def test_fedlb_demo_on_measured_step_time_curves(tmp_path):
    """`fedlb demo --curves`: real SuperLink and SuperNode processes, the silos emulating
    the H200 and the CPU at 4 and 1 threads on the cnn's curves (× 20: this machine is
    slower than an H200), the run training the curves' model. Every output names the
    clock and the curves, and each silo's steps lasted at least its curve's time."""
    import subprocess
    import sys

    from fedlb.training import step_curve

    specs = ("h200/cnn*20", "cpu4/cnn*20", "cpu1/cnn*20")
    out = tmp_path / "out"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "fedlb.cli", "demo", "--curves", ",".join(specs)),
            *("--num-rounds", "2", "--local-steps", "4", "--evaluate-every", "2"),
            *("--out-dir", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    clock = "measured (curves: silo-0 h200/cnn*20, silo-1 cpu4/cnn*20, silo-2 cpu1/cnn*20)"
    for i, spec in enumerate(specs):
        assert f"local silo-{i}: emulated curve {spec} (clock: measured, sleep-padded)" in said
    assert " ".join(said.split()).count(f"clock: {clock}") == 2  # each round's table title
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert {row["clock"] for row in rows} == {clock}
    for row in rows:
        curve = step_curve(row["emulated_curve"])
        assert row["emulated_curve"] == specs[int(row["silo"].removeprefix("silo-"))]
        assert row["compute_s"] >= row["local_steps"] * curve.seconds(row["batch_size"]) * 0.999
        assert row["efficiency"] <= 1.0 + 1e-9  # T* over the curves bounds every round
    assert "cnn" in said
