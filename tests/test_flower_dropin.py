"""The drop-in on code fedlb did not write: Flower's quickstart-pytorch and the app
`flwr new` writes for PyTorch (tests/apps), made load-balanced by three changed lines
(tests/apps/adopt.py), run as their authors run them: in-process through the apps' own
ServerApp main and ClientApp, in Flower's simulation (`flwr run`), and deployed on a
SuperLink with SuperNodes of unequal speed and dataset size."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedlb.deploy import processes as deploy
from fedlb.deploy.control import Control
from fedlb.flower import LoadBalancedFedAvg, balance_mod, balanced_loader
from fedlb.flower.protocol import BATCH_SIZE, COMPUTE_S, LOCAL_STEPS, PARTITION_ID, PROTOCOL
from tests.apps.adopt import adopt, app_config, imported
from tests.flower_fakes import InProcessGrid
from tests.test_data_files import make_mnist_folder

SPEEDS = (400.0, 200.0, 100.0)  # samples/s the three silos emulate: 4:2:1
DEPLOYED_SPEEDS = (120.0, 60.0, 30.0)  # the same, slower: each silo is its own process
BALANCE = re.compile(r"fedlb: round (\d+) balance \[([^\]]+)\]: (.*?); round .* E = ([\d.–]+)")
SIZE = re.compile(r"(silo-\d+) B=(\d+)→(\d+) τ=(\d+)")
COMPUTE = re.compile(r"(silo-\d+) B=(\d+)→\d+ τ=(\d+) \(([\d.]+)\+")


def balance_lines(log: str) -> dict[int, dict[str, tuple[int, int, int]]]:
    """round -> silo -> (B, next B, τ), from fedlb's balance lines in a run's log."""
    rounds: dict[int, dict[str, tuple[int, int, int]]] = {}
    for match in BALANCE.finditer(log):
        rounds[int(match.group(1))] = {
            silo: (int(b), int(after), int(steps))
            for silo, b, after, steps in SIZE.findall(match.group(3))
        }
    return rounds


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
    # τ stays each silo's own; round 2 (the guard's probe) moves B toward speed / τ as
    # far as its floor of half the mean batch, X = 96 kept; at the quickstart's own
    # η = 0.1 the probe finds the edge of stability, and round 3 is at the app's own sizes
    probe, last = rounds[2], rounds[3]
    for sizes in (probe, last):
        assert {silo: s for silo, (_, _, s) in sizes.items()} == steps
        assert sum(b for b, _, _ in sizes.values()) == 96
    assert probe["silo-0"][0] > probe["silo-1"][0] >= probe["silo-2"][0] >= 16
    assert "the stability guard's probe: at the edge of stability" in log
    assert {b for b, _, _ in last.values()} == {32}
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
    after = {silo: b for silo, (_, b, _) in rounds[1].items()}
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
    after = {silo: b for silo, (_, b, _) in rounds[1].items()}
    assert sum(after.values()) == 128
    assert after["silo-0"] > 2 * after["silo-3"]
    results = json.loads(next(tmp_path.glob("outputs/*/*/results.json")).read_text())
    assert [r["round"] for r in results] == [1, 2]  # its own loop's file
    assert {"fedlb.efficiency"} <= set(results[1]["train_metrics"])


class NoisyModelClock:
    """Equal silos on the model clock with the timing noise real hardware adds: every
    report's compute is τ·B/v times exp(N(0, σ²)), its fixed cost o times exp(N(0, σ_o²)),
    drawn from one seeded generator (the in-process grid asks the silos in order, so a run
    is the same on any machine, busy or not). σ = 0.2 and σ_o = 0.5 are the default
    tuner's own prior noise (fedlb.balance.pooled) and benchmarks/noise_floor.py's; what
    the quickstart's real millisecond steps measure on this machine, quiet or busy, is
    benchmarks/equal_silos.py's to print."""

    name = "model"
    curve_name = ""

    def __init__(self, seed: int, speed: float = 2000.0, overhead: float = 0.02) -> None:
        import numpy as np

        self.rng = np.random.default_rng(seed)
        self.speed, self.overhead = speed, overhead

    def pace(self, server_round: int) -> None:
        return None

    def fixed_cost(self, server_round: int) -> float:
        return 0.0

    def report(
        self, server_round: int, batch_size: int, steps: int, compute_s: float, fixed_s: float
    ) -> tuple[float, float]:
        compute, fixed = self.rng.lognormal(0.0, (0.2, 0.5))
        return steps * batch_size / self.speed * compute, self.overhead * fixed


def equal_silos_run(
    tmp_path: Path, silos: int, clock: NoisyModelClock | None, rounds: int = 10
) -> dict[int, dict[str, tuple[int, int, int]]]:
    """The quickstart's own ServerApp main and ClientApp on `silos` equal silos, in
    process, its reports timed by `clock` (None: the real clock, this machine's time),
    from torch seed 0: {round: {silo: (B, next B, τ)}} from fedlb's balance lines. The
    caller is in `tmp_path` (the app saves its model where it runs) with the task
    identity set."""
    from fedlb.flower import dropin

    app, _ = adopt("quickstart_pytorch", tmp_path)
    nodes = {10 + i: {"partition-id": i, "num-partitions": silos} for i in range(silos)}
    config = app_config(app, **{"num-server-rounds": rounds, "fraction-evaluate": 0.0})
    handler = _Said()
    root, level = logging.getLogger(), logging.getLogger().level
    root.addHandler(handler)
    if level > logging.INFO:
        root.setLevel(logging.INFO)
    emulated_timing = dropin.emulated_timing
    if clock is not None:  # every silo's reports from the one clock, in the grid's order
        dropin.emulated_timing = lambda emulation: (clock, None)
    try:
        with imported(app) as modules:
            grid = InProcessGrid(nodes, config, modules["client_app"].app)
            torch.manual_seed(0)
            modules["server_app"].main(grid, Context(1, 0, {}, RecordDict(), config))
    finally:
        dropin.emulated_timing = emulated_timing
        root.removeHandler(handler)
        root.setLevel(level)
    return balance_lines("\n".join(handler.said))


class _Said(logging.Handler):
    """What the run's loggers said, at INFO and above."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


@pytest.mark.parametrize("silos", [3, pytest.param(10, marks=pytest.mark.slow)])  # 10: ~25 s busy
@pytest.mark.usefixtures("task_identity")
def test_equal_silos_under_timing_noise_keep_their_sizes(tmp_path, monkeypatch, silos):
    """Noise in, nothing out: the quickstart on equal silos whose timings are noise
    (σ = 0.2 on compute, 0.5 on fixed costs: NoisyModelClock) for 10 rounds; the sizes
    stay within a factor 1.5 of each other every round. Before the default tuner's noise
    floor (the all-alike test, fedlb.balance.pooled) real millisecond timings drifted to
    1.52 and 1.59 by round 10 in 2 of 6 fresh-clone runs. On the real clock the same run
    follows whatever else the machine does (two busy processes beside it moved 3 equal
    silos to 23, 22 and 51 after round 1): benchmarks/equal_silos.py measures that, side by side."""
    monkeypatch.chdir(tmp_path)
    rounds = equal_silos_run(tmp_path, silos, NoisyModelClock(seed=0))
    assert sorted(rounds) == list(range(1, 11))
    for k, sizes in rounds.items():
        after = [b for _, b, _ in sizes.values()]
        assert len(after) == silos
        assert sum(after) == 32 * silos
        assert max(after) <= 1.5 * min(after), (k, sizes)


@pytest.mark.usefixtures("task_identity")
def test_at_its_own_batch_size_the_loader_draws_the_apps_own_batches(tmp_path):
    """Round 1 (no orders: B = the loader's 32, τ = len(loader)) of the quickstart's own
    train handler, stock and adopted, from the same torch seed: the same batches, so the
    same model bits and the same train loss."""
    replies = {}
    for balanced in (False, True):
        app, _ = adopt("quickstart_pytorch", tmp_path / str(balanced), balanced=balanced)
        config = app_config(app)
        with imported(app) as modules:
            torch.manual_seed(0)
            weights = ArrayRecord(modules["task"].Net().state_dict())
            message = Message(
                RecordDict({"arrays": weights, "config": ConfigRecord({"lr": 0.1, PROTOCOL: 1})}),
                dst_node_id=1,
                message_type="train",
            )
            context = Context(1, 1, {"partition-id": 1, "num-partitions": 3}, RecordDict(), config)
            torch.manual_seed(7)
            replies[balanced] = modules["client_app"].app(message, context)
    stock, adopted = replies[False].content, replies[True].content
    assert adopted["metrics"]["train_loss"] == stock["metrics"]["train_loss"]
    assert adopted["metrics"][LOCAL_STEPS] == 12  # ceil(383 / 32): the last batch short
    for key, array in stock["arrays"].items():
        assert (array.numpy() == adopted["arrays"][key].numpy()).all(), key


@pytest.mark.usefixtures("task_identity")
def test_balanced_loader_keeps_the_loader_and_times_the_steps():
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(100.0).unsqueeze(1), torch.zeros(100, dtype=torch.long))
    collated: list[int] = []

    def collate(batch):
        collated.append(len(batch))
        return torch.utils.data.default_collate(batch)

    loader = DataLoader(data, batch_size=10, shuffle=True, collate_fn=collate)
    message = Message(
        RecordDict({"config": ConfigRecord({BATCH_SIZE: 7, PROTOCOL: 1})}),
        dst_node_id=1,
        message_type="train",
    )

    def handler(msg: Message, context: Context) -> Message:
        balanced = balanced_loader(msg, loader)
        assert len(balanced) == 10
        assert balanced.dataset is data
        seen = [x for _ in range(2) for (x, _) in balanced]  # two passes of 10 steps
        # 100 samples at 7: 14 full batches and a short one end the epoch, as the app's
        # own loader ends it; the second pass runs on into the next epoch.
        assert [len(x) for x in seen] == [7] * 14 + [2] + [7] * 5
        assert sorted(int(i) for x in seen[:15] for i in x) == list(range(100))
        return Message(RecordDict({"metrics": MetricRecord({"own": 1})}), reply_to=msg)

    reply = balance_mod()(message, Context(1, 1, {"partition-id": 4}, RecordDict(), {}), handler)
    metrics = reply.content["metrics"]
    assert metrics["own"] == 1
    assert metrics[BATCH_SIZE] == 7
    assert metrics[LOCAL_STEPS] == 20
    assert metrics[PARTITION_ID] == 4
    assert metrics[COMPUTE_S] > 0
    assert collated == [7] * 14 + [2] + [7] * 5  # the app's own collate_fn drew every batch


@pytest.mark.usefixtures("task_identity")
def test_a_carried_stream_goes_on_across_rounds_through_the_contexts_state():
    """balanced_loader(msg, loader, context): the batch stream lives in context.state (which
    Flower keeps per run on the SuperNode), so round 2 goes on where round 1 stopped, at
    round 2's batch size; each pass over the data ends with a short batch (FLamby's stream).
    Without it, round 2 starts a fresh epoch."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(10), torch.zeros(10, dtype=torch.long))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    state = RecordDict()  # the SuperNode's, across the run's messages

    def round_of(batch_size: int, steps: int, carry: bool, server_round: int) -> list[list[int]]:
        message = Message(
            RecordDict(
                {
                    "config": ConfigRecord(
                        {
                            BATCH_SIZE: batch_size,
                            LOCAL_STEPS: steps,
                            "server-round": server_round,
                            PROTOCOL: 1,
                        }
                    )
                }
            ),
            dst_node_id=1,
            message_type="train",
        )
        drawn: list[list[int]] = []

        def handler(msg: Message, context: Context) -> Message:
            balanced = balanced_loader(msg, loader, context if carry else None)
            drawn.extend(x.tolist() for x, _ in balanced)
            return Message(RecordDict({"metrics": MetricRecord({"own": 1})}), reply_to=msg)

        balance_mod()(message, Context(1, 1, {"partition-id": 0}, state, {}), handler)
        return drawn

    torch.manual_seed(0)
    first = round_of(4, 5, carry=True, server_round=1)
    assert [len(b) for b in first] == [4, 4, 2, 4, 4]
    torch.manual_seed(1)  # a new round reseeds: the carried epoch goes on, the next is new
    second = round_of(3, 3, carry=True, server_round=2)
    assert [len(b) for b in second] == [2, 3, 3]  # epoch 2's last 2, then epoch 3 at B=3
    epoch_2 = first[3] + first[4] + second[0]
    assert sorted(epoch_2) == list(range(10))
    assert sorted(i for batch in first[:3] for i in batch) == list(range(10))
    fresh = round_of(4, 3, carry=False, server_round=3)
    assert [len(b) for b in fresh] == [4, 4, 2]


@pytest.mark.parametrize(
    ("listed", "partition", "expected"),
    [
        ("400,200,100", 2, 100.0),
        ("", 2, 0.0),  # declared but empty: real speed
        ("400,oops", 0, "must list samples/s per partition-id"),
        ("400,200", 2, "no entry for this silo's partition-id 2"),
        ("400,-1", 1, "must be a number >= 0"),
        ("400,inf", 1, "must be finite"),
    ],
)
def test_emulated_speeds_by_partition_id_from_the_run_config(listed, partition, expected):
    from fedlb.flower.protocol import read_emulation

    node, run = {"partition-id": partition}, {"fedlb-emulated-speeds": listed}
    if isinstance(expected, float):
        assert read_emulation(node, run).speed == expected
    else:
        with pytest.raises(ValueError, match=expected):
            read_emulation(node, run)
    assert read_emulation({"partition-id": 0, "emulated-speed": 7.0}, {}).speed == 7.0


@pytest.mark.usefixtures("task_identity")
def test_balanced_loader_without_the_mod_says_what_to_add():
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
    with pytest.raises(RuntimeError, match=r"ClientApp\(mods=\[balance_mod\(\)\]\)"):
        balanced_loader(Message(RecordDict(), dst_node_id=1, message_type="train"), loader)


def _flwr_run(home: Path, app: Path, options: list[str], timeout: float) -> tuple[str, str]:
    """`flwr run APP --stream`, the user's own command: (its output, the run's final status
    from the SuperLink)."""
    done = subprocess.run(
        [str(deploy.bin_dir() / "flwr"), "run", str(app), deploy.CONNECTION, "--stream", *options],
        env=deploy.flower_env(home),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = done.stdout + done.stderr
    (home / "flwr-run.log").write_text(output)
    run_id = re.search(r"run_id `(\d+)`", output)
    assert run_id is not None, output[-3000:]
    address = tomllib.loads((home / "config.toml").read_text())["superlink"][deploy.CONNECTION]
    with Control(address["address"]) as control:
        return output, control.run_status(run_id.group(1))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flwr_new_app_in_flowers_simulation(tmp_path, monkeypatch):
    """`flwr run` on a simulation SuperLink: the `flwr new` app (its Adam loop, its
    fraction-train 0.5, its own metrics) on silos with datasets of 1:2:3, made
    heterogeneous by the run config alone (`fedlb-emulated-speeds`, by partition-id)."""
    monkeypatch.setenv("FEDLB_APP_PARTITION_WEIGHTS", "1,2,3")
    monkeypatch.chdir(tmp_path)  # the ServerApp saves final_model.pt where it runs
    app, _ = adopt("flwr_new_pytorch", tmp_path)
    # Flower takes --run-config only for keys the app declares: the documented line
    project = app / "pyproject.toml"
    text = project.read_text()
    declared = text.replace(
        "[tool.flwr.app.config]\n", '[tool.flwr.app.config]\nfedlb-emulated-speeds = ""\n'
    )
    assert declared != text
    project.write_text(declared)
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
    steps = {silo: s for silos in rounds.values() for silo, (_, _, s) in silos.items()}
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
    submitted with the user's own `flwr run`: sizes follow the
    speeds, its metrics and log are kept. (Speeds low enough that three
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
    assert rounds[2]["silo-0"][0] > 1.5 * rounds[2]["silo-2"][0], rounds  # ideal 4x; noisy
