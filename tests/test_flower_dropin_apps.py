"""The drop-in on code fedlb did not write: Flower's quickstart-pytorch and the app
`flwr new` writes for PyTorch (tests/apps), made load-balanced by three changed lines
(tests/apps/adopt.py), run in-process through the apps' own ServerApp main and
ClientApp: they balance and keep their own loop, metrics and log; a strategy subclass,
or one with its own start(), keeps the balance."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from fedlb.flower import LoadBalancedFedAvg
from tests.apps.adopt import adopt, app_config, imported
from tests.dropin_helpers import balance_lines
from tests.flower_fakes import InProcessGrid
from tests.test_data_files import make_mnist_folder

SPEEDS = (400.0, 200.0, 100.0)  # samples/s the three silos emulate: 4:2:1


@pytest.mark.parametrize("name", ["quickstart_pytorch", "flwr_new_pytorch", "advanced_pytorch"])
def test_the_change_is_three_lines(tmp_path, name):
    _, touched = adopt(name, tmp_path)
    added = [line for line in touched if line.startswith("+")]
    assert len(added) == 3, touched
    assert any("LoadBalancedFedAvg" in line for line in added)
    assert "+app = ClientApp(mods=[balance_mod()])" in added
    assert any("balanced_loader(msg, trainloader)" in line for line in added)


@pytest.mark.slow
@pytest.mark.usefixtures("task_identity")
def test_quickstart_in_process_balances_and_keeps_its_own_loop_metrics_and_log(
    tmp_path, monkeypatch, caplog
):
    """The app's own ServerApp main and ClientApp on an in-process grid: silos of unequal
    speed (emulated, node config) and unequal dataset size (1:2:3)."""
    monkeypatch.setenv("FEDLB_APP_PARTITION_WEIGHTS", "1,2,3")
    monkeypatch.chdir(tmp_path)  # the app saves final_model.pt where it runs
    app, _ = adopt("quickstart_pytorch", tmp_path)
    nodes = {
        10 + i: {"partition-id": i, "num-partitions": 3, "emulated-speed": speed}
        for i, speed in enumerate(SPEEDS)
    }
    config = app_config(app, **{"num-server-rounds": 3, "fraction-evaluate": 1.0})
    caplog.set_level("INFO")
    with imported(app) as modules:
        grid = InProcessGrid(nodes, config, modules["client_app"].app)
        torch.manual_seed(0)
        modules["server_app"].main(grid, Context(1, 0, {}, RecordDict(), config))
    log = caplog.text
    # Flower's own round log is there, with the app's metric names
    assert "[ROUND 3/3]" in log
    assert "Strategy execution finished" in log
    assert "'train_loss'" in log
    assert "'eval_acc'" in log
    assert "Global evaluation" in log
    assert "fedlb.batch-size" not in log.split("Final results:")[1]  # the app's metrics only
    # round 1 ran as the app wrote it: B0 = its loader's 32, τ = len(its loader)
    rounds = balance_lines(log)
    first = rounds[1]
    assert {b for b, _, _ in first.values()} == {32}
    steps = {silo: s for silo, (_, _, s) in first.items()}
    assert steps["silo-0"] < steps["silo-1"] < steps["silo-2"]  # datasets of 1:2:3
    # round 2, the guard's look: every silo at its own B, the slow silos' steps cut (none
    # more than its own), X = 96 kept; at the app's own η = 0.1 its steps grew: the edge,
    # and round 3 runs the second lever too: the app's own sizes, a slow silo fewer steps
    look, last = rounds[2], rounds[3]
    assert "the stability guard's look: at the edge of stability" in log
    assert "the stability guard's probe" not in log  # no smaller batch tried
    for sizes in (look, last):
        assert sum(b for b, _, _ in sizes.values()) == 96
        assert {b for b, _, _ in sizes.values()} == {32}
        cut = {silo: s for silo, (_, _, s) in sizes.items()}
        assert all(cut[silo] <= steps[silo] for silo in steps)
        assert cut != steps
    assert "the stability guard looks at the app's own growth first: B kept at 32" in log
    # every update was aggregated, weighted by dataset size: the model file is the app's
    assert (tmp_path / "final_model.pt").exists()
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert all(m.content["config"]["lr"] == 0.1 for m in train)  # the app's own lr


@pytest.mark.usefixtures("task_identity")
def test_train_metrics_aggregation_sees_the_apps_metrics_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app, _ = adopt("flwr_new_pytorch", tmp_path)
    seen: list[set[str]] = []

    def aggregate(records: list[RecordDict], weight: str) -> MetricRecord:
        seen.extend(set(r.metric_records["metrics"].keys()) for r in records)
        return MetricRecord({"n": len(records)})

    nodes = {10 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)}
    with imported(app) as modules:
        grid = InProcessGrid(nodes, app_config(app), modules["client_app"].app)
        strategy = LoadBalancedFedAvg(fraction_train=0.5, train_metrics_aggr_fn=aggregate)
        result = strategy.start(
            grid,
            ArrayRecord(modules["task"].Net().state_dict()),
            num_rounds=2,
            train_config=ConfigRecord({"lr": 0.01}),
        )
    assert seen
    assert all(keys == {"train_loss", "num-examples"} for keys in seen)
    # fraction_train = 0.5 of 3 silos: FedAvg's count, max(int(1.5), min_train_nodes = 2)
    per_round = [len(strategy.reporter.records[k].silos) for k in range(2)]
    assert per_round == [2, 2]
    assert result.train_metrics_clientapp[2]["n"] == 2


@pytest.mark.usefixtures("task_identity")
def test_a_strategy_subclass_with_its_own_start_keeps_the_balance(tmp_path, monkeypatch, caplog):
    """advanced-pytorch's pattern: its CustomFedAvg (now inheriting LoadBalancedFedAvg)
    overrides start() with a loop of its own (W&B, best-model checkpoints, results.json)
    and configure_train (an lr schedule). Through Flower's hooks alone fedlb still
    balances, records every round (the last included), polls the loop's grid, and says
    once what the override costs."""
    monkeypatch.chdir(tmp_path)  # the app writes outputs/ and final_model.pt where it runs
    # small Fashion-MNIST-shaped IDX files: the mechanics, not the accuracy, are under test
    make_mnist_folder(tmp_path / "fashion", n_train=1200, n_test=100)
    monkeypatch.setenv("FEDLB_APP_FASHION_DIR", str(tmp_path / "fashion"))
    app, _ = adopt("advanced_pytorch", tmp_path)
    nodes = {  # on the model clock: sizes from these speeds alone, not this machine's load
        10 + i: {
            "partition-id": i,
            "num-partitions": 4,
            "emulated-speed": speed,
            "emulated-clock": "model",
        }
        for i, speed in enumerate((800.0, 400.0, 400.0, 200.0))
    }
    config = app_config(
        app, **{"num-server-rounds": 2, "fraction-train": 1.0, "fraction-evaluate": 0.5}
    )
    caplog.set_level("INFO")
    made: list[LoadBalancedFedAvg] = []
    init = LoadBalancedFedAvg.__init__

    def keep(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(LoadBalancedFedAvg, "__init__", keep)
    with imported(app) as modules:
        grid = InProcessGrid(nodes, config, modules["client_app"].app)
        torch.manual_seed(0)
        modules["server_app"].main(grid, Context(1, 0, {}, RecordDict(), config))
    log = caplog.text
    assert [r.round for r in made[0].reporter.records] == [1, 2]  # the last one too
    assert "CustomFedAvg.start() drives the rounds, not LoadBalancedFedAvg.start()" in log
    assert log.count("drives the rounds, not") == 1
    assert "send_and_receive" in vars(grid)  # the loop's own grid now polls
    rounds = balance_lines(log)
    assert sorted(rounds) == [1, 2]
    assert {b for b, _, _ in rounds[1].values()} == {32}
    # round 2: the guard's look, every silo at its own B, the slow silos' steps cut
    assert {b for b, _, _ in rounds[2].values()} == {32}
    assert rounds[2]["silo-0"][2] > rounds[2]["silo-3"][2]
    after = {silo: b for silo, (_, b, _) in rounds[2].items()}  # the probe's, next
    assert sum(after.values()) == 128
    assert after["silo-0"] > 2 * after["silo-3"]  # 4x the speed, a bigger B
    assert min(after.values()) >= 16  # the default guard: no silo below half the mean
    results = json.loads(next(tmp_path.glob("outputs/*/*/results.json")).read_text())
    assert [r["round"] for r in results] == [1, 2]  # the app's own loop ran both rounds
    assert (tmp_path / "final_model.pt").exists()


@pytest.mark.usefixtures("task_identity")
def test_a_strategy_with_its_own_start_wrapped_as_it_is_keeps_its_loop(
    tmp_path, monkeypatch, caplog
):
    """advanced-pytorch's CustomFedAvg unchanged (a FedAvg subclass with its own start()
    loop and configure_train), wrapped: `LoadBalanced(CustomFedAvg(...))`. Its own loop
    runs (its results.json, W&B calls, the lr halving), with fedlb's hooks around its
    own: balanced, every round recorded, its attributes set through the wrapper."""
    from fedlb.flower import LoadBalanced

    monkeypatch.chdir(tmp_path)
    make_mnist_folder(tmp_path / "fashion", n_train=1200, n_test=100)
    monkeypatch.setenv("FEDLB_APP_FASHION_DIR", str(tmp_path / "fashion"))
    app, touched = adopt("advanced_pytorch", tmp_path, wrap=True)
    # the server's call (its closing line unchanged), the ClientApp's mod, its loader
    assert [line for line in touched if line.startswith("+")] == [
        "+    strategy = LoadBalanced(",
        "+        CustomFedAvg(fraction_train=fraction_train, fraction_evaluate=fraction_eval)",
        "+app = ClientApp(mods=[balance_mod()])",
        "+    trainloader = balanced_loader(msg, trainloader)",
    ]
    nodes = {
        10 + i: {
            "partition-id": i,
            "num-partitions": 4,
            "emulated-speed": speed,
            "emulated-clock": "model",
        }
        for i, speed in enumerate((800.0, 400.0, 400.0, 200.0))
    }
    config = app_config(
        app, **{"num-server-rounds": 2, "fraction-train": 1.0, "fraction-evaluate": 0.5}
    )
    caplog.set_level("INFO")
    made: list[LoadBalanced] = []
    init = LoadBalanced.__init__

    def keep(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(LoadBalanced, "__init__", keep)
    with imported(app) as modules:
        grid = InProcessGrid(nodes, config, modules["client_app"].app)
        torch.manual_seed(0)
        modules["server_app"].main(grid, Context(1, 0, {}, RecordDict(), config))
    log = caplog.text
    assert "CustomFedAvg has a start() loop of its own: it runs" in log
    assert "drives the rounds" not in log  # fedlb's start() ran it: nothing lost
    assert [r.round for r in made[0].reporter.records] == [1, 2]
    inner = made[0].strategy
    assert inner.save_path is not None  # set through the wrapper, on CustomFedAvg
    assert "configure_train" not in vars(inner)  # its own hooks back after the run
    rounds = balance_lines(log)
    assert rounds[2]["silo-0"][2] > rounds[2]["silo-3"][2]  # the look: steps cut
    after = {silo: b for silo, (_, b, _) in rounds[2].items()}
    assert sum(after.values()) == 128
    assert after["silo-0"] > 2 * after["silo-3"]
    results = json.loads(next(tmp_path.glob("outputs/*/*/results.json")).read_text())
    assert [r["round"] for r in results] == [1, 2]  # its own loop's file
    assert {"fedlb.efficiency"} <= set(results[1]["train_metrics"])
