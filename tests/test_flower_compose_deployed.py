"""Other strategies balanced on real Flower processes: Flower's quickstart-pytorch with its
FedAvg replaced by FedAdam, FedProx, server-side DP fixed clipping around FedAvg, or a
subclass with its own aggregate_train (tests/apps/adopt.py STRATEGIES), wrapped as
`LoadBalanced(<that strategy>)` with the client's balance_mod() and balanced_loader(),
submitted with the user's own `flwr run`:

- on Flower's simulation (a SuperLink started with --simulation, the speeds 4 : 2 : 1 from
  the run config), each of the four;
- deployed (a SuperLink and three SuperNodes of emulated speeds 4 : 2 : 1 as real
  processes), FedAvg, FedProx and FedAdam one after another on the same federation.

Each run completes, its sizes follow the speeds in the round after the first with X and τ
kept, and the strategy's behaviour shows in its log. Accuracy beside stock, over seeds, is
benchmarks/strategies.py's (docs/strategies.md)."""

from __future__ import annotations

import re

import pytest

from fedlb.deploy import processes as deploy
from tests.apps.adopt import adopt
from tests.dropin_helpers import BALANCE, DEPLOYED_SPEEDS, _flwr_run, balance_lines

pytestmark = pytest.mark.slow

SPEEDS = "240,120,60"  # samples/s by partition-id: 4 : 2 : 1


# The silos report the model clock's seconds (τ·B/v, no sleeping): their sizes are the
# speeds' alone, whatever else this machine runs (on two cores shared by three ClientApps
# and a test suite, a measured round 1 can make the fastest silo look the slowest). The
# measured clock on these processes: test_flower_dropin_flwr_run.py's deployed and simulated runs.
def check_look(silos: dict[str, tuple[int, int, int]], own: dict[str, int]) -> None:
    """Round 2, the stability guard's look: every silo at its own B (32), the slow silos'
    steps cut, none more than its own."""
    assert {b for b, _, _ in silos.values()} == {32}, silos
    steps = {silo: t for silo, (_, _, t) in silos.items()}
    assert all(steps[silo] <= own[silo] for silo in own), (steps, own)
    assert steps["silo-0"] > steps["silo-2"], steps


def check_balanced(output: str, rounds: int) -> dict[int, dict[str, tuple[int, int, int]]]:
    """Every round on record; round 1 at the app's own B0, round 2 the guard's look (B 32
    each, the slow silos' steps cut); from round 3 the look's verdict: at the edge, the
    steps lever (B 32 each, no silo more steps than its own), else sizes that follow the
    speeds with τ kept; X = Σ B0 in every round."""
    found = balance_lines(output)
    assert sorted(found) == list(range(1, rounds + 1)), output[-3000:]
    assert {b for b, _, _ in found[1].values()} == {32}  # round 1: the app's own B0
    own = {silo: t for silo, (_, _, t) in found[1].items()}
    check_look(found[2], own)
    edge = "the stability guard's look: at the edge of stability" in output
    assert edge or "the stability guard's look: calm" in output, output[-3000:]
    for number, silos in found.items():
        assert sum(b for b, _, _ in silos.values()) == 96  # X kept
        steps = {silo: t for silo, (_, _, t) in silos.items()}
        if number <= 2:
            continue
        if edge:  # the edge lever: the app's own sizes, the slow silos' steps cut
            assert {b for b, _, _ in silos.values()} == {32}
            assert all(steps[silo] <= own[silo] for silo in own)
        else:  # the probe and after: sizes follow the speeds, τ kept
            sizes = {silo: b for silo, (b, _, _) in silos.items()}
            assert sizes["silo-0"] > sizes["silo-1"] > sizes["silo-2"], sizes
            assert steps == own
    return found


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["fedadam", "fedprox", "dp-server-fixed", "own-aggregation"])
def test_quickstart_with_another_strategy_balanced_on_flowers_simulation(
    tmp_path, monkeypatch, strategy
):
    monkeypatch.chdir(tmp_path)  # the ServerApp saves final_model.pt where it runs
    app, _ = adopt("quickstart_pytorch", tmp_path, strategy=strategy)
    output, status = _simulated(app, tmp_path)
    assert status == "finished:completed", output[-3000:]
    check_balanced(output, 3)
    assert {m.group(2) for m in BALANCE.finditer(output)} == {"model"}
    assert "Balancing (fedlb): LoadBalanced" in output  # the summary names the chain
    if strategy == "own-aggregation":
        assert [f"OwnFedAvg.aggregate_train: round {k}" in output for k in (1, 2, 3)] == [True] * 3
    if strategy == "dp-server-fixed":
        assert output.count("central DP noise with") == 3  # its noise, every round
    if strategy == "fedadam":
        assert "FedAdam returned the model in other dtypes than the app's" in output
        assert "update rejected" not in output
    # the app's metrics as Flower prints them: no fedlb report key, the round's figures only
    assert "'fedlb.compute-s'" not in output
    assert "'fedlb.partition-id'" not in output
    assert "'fedlb.efficiency'" in output


@pytest.mark.timeout(900)
def test_fedavg_fedprox_and_fedadam_deployed_on_real_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "home-cli"
    link = deploy.start_superlink(tmp_path, warm=True)
    nodes = []
    outputs = {}
    try:
        deploy.write_connection(home, f"127.0.0.1:{link.control_port}")
        address = f"127.0.0.1:{link.port}"
        for i, speed in enumerate(DEPLOYED_SPEEDS):
            config = {
                "partition-id": i,
                "num-partitions": 6,
                "emulated-speed": speed,
                "emulated-clock": "model",
            }
            nodes.append(deploy.launch_supernode(tmp_path, f"silo-{i}", address, config, warm=True))
        for node in nodes:
            deploy.supernode_ready(node)
        options = ["--run-config", "num-server-rounds=2"]
        for strategy in ("fedavg", "fedprox", "fedadam"):
            app, _ = adopt("quickstart_pytorch", tmp_path / strategy, strategy=strategy)
            output, status = _flwr_run(home, app, options, 400)
            assert status == "finished:completed", (strategy, output[-3000:])
            outputs[strategy] = output
    finally:
        for node in nodes:
            node.stop()
        link.stop()
    for strategy, output in outputs.items():
        rounds = balance_lines(output)
        assert sorted(rounds) == [1, 2], (strategy, output[-3000:])
        assert {b for b, _, _ in rounds[1].values()} == {32}
        check_look(rounds[2], {silo: t for silo, (_, _, t) in rounds[1].items()})
        assert "the stability guard's look" in output, (strategy, output[-3000:])
        assert "'train_loss'" in output
    assert "Proximal mu: 0.1" in outputs["fedprox"]  # FedProx's own summary
    assert "FedAdam returned the model in other dtypes" in outputs["fedadam"]
    assert "update rejected" not in outputs["fedadam"]


HOSTILE_MOD = '''

def _hostile(msg, context, call_next):
    """Partition 1 claims 10^18 examples in every train reply (issue 51's probe)."""
    reply = call_next(msg, context)
    if msg.metadata.message_type == "train" and context.node_config["partition-id"] == 1:
        reply.content["metrics"]["num-examples"] = 10**18
    return reply
'''


@pytest.mark.timeout(900)
def test_a_silo_claiming_ten_to_the_eighteen_examples_is_left_out_on_flowers_simulation(
    tmp_path, monkeypatch
):
    """The probe's first finding, on Flower's own processes: one silo's ClientApp claims
    num-examples = 10^18 from round 1. Its update is left out of every round with one
    line, the first round's claims are said, and the run completes balanced on the other
    two (the average itself: tests/test_flower_claims.py, from the audit files)."""
    monkeypatch.chdir(tmp_path)
    app, _ = adopt("quickstart_pytorch", tmp_path)
    client = next(app.glob("*/client_app.py"))
    text = client.read_text()
    client.write_text(
        text.replace(
            "app = ClientApp(mods=[balance_mod()])",
            HOSTILE_MOD.lstrip("\n") + "\napp = ClientApp(mods=[_hostile, balance_mod()])",
        )
    )
    output, status = _simulated(app, tmp_path)
    assert status == "finished:completed", output[-3000:]
    left_out = re.findall(
        r"round (\d): silo-1: left out of the average: num-examples is 1e\+18, not a", output
    )
    assert sorted(set(left_out)) == ["1", "2", "3"], output[-3000:]
    assert "the silos claim num-examples: silo-0 " in output
    found = balance_lines(output)
    assert set(found[2]) == {"silo-0", "silo-2"}  # the honest silos' round
    assert "Traceback" not in output


def _simulated(app, tmp_path):
    """(output, status) of `flwr run` of `app` for 3 rounds on Flower's simulation (3
    supernodes at SPEEDS, the model clock)."""
    project = app / "pyproject.toml"
    project.write_text(
        project.read_text().replace(
            "[tool.flwr.app.config]\n",
            "[tool.flwr.app.config]\n"
            'fedlb-emulated-speeds = ""\n'
            'fedlb-emulated-clock = "measured"\n',
        )
    )
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
                f'num-server-rounds=3 fedlb-emulated-speeds="{SPEEDS}" '
                'fedlb-emulated-clock="model"',
            ],
            timeout=800,
        )
    finally:
        link.stop()
    return output, status
