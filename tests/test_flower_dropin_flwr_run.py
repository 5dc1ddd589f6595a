"""The drop-in on Flower's apps (tests/apps) run as their authors run them with
`flwr run`: the `flwr new` PyTorch app in Flower's simulation, and quickstart-pytorch
deployed on a SuperLink with SuperNodes of unequal speed and dataset size."""

from __future__ import annotations

import pytest

from fedlb.deploy import processes as deploy
from tests.apps.adopt import adopt, declare_emulation
from tests.dropin_helpers import BALANCE, COMPUTE, DEPLOYED_SPEEDS, _flwr_run, balance_lines


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flwr_new_app_in_flowers_simulation(tmp_path, monkeypatch):
    """`flwr run` on a simulation SuperLink: the `flwr new` app (its Adam loop, its
    fraction-train 0.5, its own metrics) on silos with datasets of 1:2:3, made
    heterogeneous by the run config alone (`fedlb-emulated-speeds`, by partition-id)."""
    monkeypatch.setenv("FEDLB_APP_PARTITION_WEIGHTS", "1,2,3")
    monkeypatch.chdir(tmp_path)  # the ServerApp saves final_model.pt where it runs
    app, _ = adopt("flwr_new_pytorch", tmp_path)
    declare_emulation(app)  # Flower takes --run-config only for keys the app declares
    link = deploy.start_superlink(tmp_path, extra_args=["--simulation"])
    home = tmp_path / "home-cli"
    try:
        deploy.write_connection(home, f"127.0.0.1:{link.control_port}")
        output, status = _flwr_run(
            home,
            app,
            [
                "--federation-config",
                "num-supernodes=3 client-resources-num-cpus=1",
                "--run-config",
                'num-server-rounds=4 fedlb-emulated-speeds="600,300,150"',
            ],
            timeout=400,
        )
    finally:
        link.stop()
    assert status == "finished:completed", output[-3000:]
    assert "[ROUND 4/4]" in output
    assert "'eval_acc'" in output
    assert "'train_loss'" in output
    rounds = balance_lines(output)
    assert sorted(rounds) == [1, 2, 3, 4]
    assert all(len(silos) == 2 for silos in rounds.values())  # fraction-train 0.5 of 3
    assert {m.group(2) for m in BALANCE.finditer(output)} == {"measured (emulated speeds)"}
    speeds = {"silo-0": 600.0, "silo-1": 300.0, "silo-2": 150.0}
    for silo, b, steps, compute in COMPUTE.findall(output):  # padded to its speed
        assert float(compute) >= 0.95 * int(steps) * int(b) / speeds[silo] - 0.01
    steps: dict[str, int] = {}  # each silo's first round: its own τ (the edge lever cuts
    for number in sorted(rounds):  # a slow silo's later on)
        for silo, (_, _, s) in rounds[number].items():
            steps.setdefault(silo, s)
    assert steps["silo-0"] * 2 < steps["silo-2"]  # each silo's τ from its dataset
    # X is the sum of the B0 the silos brought: 96 once all three have run
    latest: dict[str, int] = {}
    for number in sorted(rounds):
        latest.update({silo: after for silo, (_, after, _) in rounds[number].items()})
    assert len(latest) < 3 or sum(latest.values()) == 96


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quickstart_deployed_on_unequal_silos(tmp_path, monkeypatch):
    """A warm SuperLink and three warm SuperNodes (fedlb.deploy.warm: Flower's own app,
    forked per run and per message) of emulated speeds 4:2:1 running the quickstart,
    submitted with the user's own `flwr run`: the balance follows the
    speeds (round 2, the guard's look, cuts the slow silos' steps), its metrics and log
    are kept. (Speeds low enough that three
    fresh training processes on two cores still run slower than emulated: the padding,
    not the contention, sets their pace.)"""
    monkeypatch.chdir(tmp_path)  # the ServerApp saves final_model.pt where it runs
    app, _ = adopt("quickstart_pytorch", tmp_path)
    home = tmp_path / "home-cli"
    link = deploy.start_superlink(tmp_path, warm=True)
    nodes = []
    try:
        deploy.write_connection(home, f"127.0.0.1:{link.control_port}")
        address = f"127.0.0.1:{link.port}"
        for i, speed in enumerate(DEPLOYED_SPEEDS):  # all started, then waited for
            # 3 of 6 partitions: ~190 samples and 6 steps per silo, rounds of a few seconds
            config = {"partition-id": i, "num-partitions": 6, "emulated-speed": speed}
            nodes.append(deploy.launch_supernode(tmp_path, f"silo-{i}", address, config, warm=True))
        for node in nodes:
            deploy.supernode_ready(node)
        output, status = _flwr_run(home, app, ["--run-config", "num-server-rounds=2"], timeout=400)
    finally:
        for node in nodes:
            node.stop()
        link.stop()
    assert status == "finished:completed", output[-3000:]
    assert "[ROUND 2/2]" in output
    assert "'train_loss'" in output
    assert "'eval_acc'" in output
    rounds = balance_lines(output)
    assert sorted(rounds) == [1, 2]
    assert all(m.group(2) == "measured (emulated speeds)" for m in BALANCE.finditer(output))
    assert {b for b, _, _ in rounds[1].values()} == {32}
    # round 2, the stability guard's look: every silo at its own B, the slowest silo's
    # steps cut by its speed (ideal 6 / 6 / 3; measured, so noisy)
    assert {b for b, _, _ in rounds[2].values()} == {32}, rounds
    assert rounds[2]["silo-0"][2] > rounds[2]["silo-2"][2], rounds
    assert "the stability guard's look" in output
