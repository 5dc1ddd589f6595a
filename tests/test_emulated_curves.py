"""Silos whose compute follows a measured step-time curve instead of B / v: the model
clock (τ·curve(B) reported, T* over the curves), the measured clock (a real step padded
to the curve), the settings that name a curve, and every output naming its clock."""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from torch.utils.data import DataLoader, TensorDataset

from fedlb.balance import StepCurve
from fedlb.deploy import ConfigError, RunConfig, SiloSettings, local_silos
from fedlb.deploy.silo_app import SiloConfigError, node_settings
from fedlb.deploy.task import federation_data, model_for
from fedlb.experiments import EmulatedClock, Scenario, ScenarioError
from fedlb.flower import (
    Balancing,
    Keeping,
    LoadBalancedFedAvg,
    RoundReporter,
    balance_mod,
    balanced_loader,
    dropin,
)
from fedlb.flower.protocol import (
    BATCH_SIZE,
    EMULATED_CURVE,
    LOCAL_STEPS,
    PROTOCOL,
    SiloReport,
    read_emulation,
    read_report,
)
from fedlb.training import STEP_CURVES, step_curve
from tests.flower_fakes import InProcessGrid, fedlb_app, lr_config

CURVES = ("h200/cnn", "cpu4/cnn", "cpu1/cnn")


def brute_force_ideal(curves: list[StepCurve], total: int, steps: int) -> float:
    """T* over every integer split of `total` (each silo >= 1)."""
    best = float("inf")
    for first in range(1, total - 1):
        for second in range(1, total - first):
            split = (first, second, total - first - second)
            best = min(best, max(steps * c.seconds(b) for c, b in zip(curves, split, strict=True)))
    return best


def start(strategy, grid, rounds):
    config = RunConfig.from_mapping(grid.run_config)
    pool, _ = federation_data(config)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model_for(config, pool).state_dict()),
        num_rounds=rounds,
        timeout=30,
        train_config=lr_config(),
    )


@pytest.mark.usefixtures("task_identity")
def test_silos_on_curves_report_the_model_clock_and_e_is_over_the_curves(tmp_path):
    """Three silos named by their node config alone (emulated-curve, emulated-clock =
    model: fedlb's drop-in path), the H200 beside two CPUs on the cnn's curves: each
    reports τ·curve(B), every record names the clock and the curves, and T* is the best
    split over the curves (checked by trying every split)."""
    settings = {"num-silos": 3, "local-steps": 3, "batch-size": 16, "model": "cnn"}
    nodes = {
        100 + i: {
            "partition-id": i,
            "num-partitions": 3,
            "emulated-curve": name,
            "emulated-clock": "model",
        }
        for i, name in enumerate(CURVES)
    }
    grid = InProcessGrid(nodes, settings, fedlb_app())
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        evaluate_every=3,
        balancing=Balancing(batch_size=16, local_steps=3),
        keeping=Keeping(reporter=RoundReporter(tmp_path)),
    )
    start(strategy, grid, rounds=3)
    curves = [STEP_CURVES[name] for name in CURVES]
    clock = "model (curves: silo-0 h200/cnn, silo-1 cpu4/cnn, silo-2 cpu1/cnn)"
    records = strategy.reporter.records
    assert [r.round for r in records] == [1, 2, 3]
    for record in records:
        assert record.clock == clock
        assert not record.failed
        total = sum(s.batch_size for s in record.silos)
        assert total == 48
        for silo in record.silos:
            curve = curves[silo.node - 100]
            assert silo.emulated_curve == curve.name
            assert silo.compute_s == pytest.approx(
                silo.local_steps * curve.seconds(silo.batch_size)
            )
            assert silo.fixed_s == 0.0
        assert record.ideal_s == pytest.approx(brute_force_ideal(curves, total, 3))
        assert record.efficiency <= 1.0 + 1e-9
    # round 1 is uniform: the slowest is the 1-thread CPU at 16, while the best split
    # hands the flat H200 most of X
    assert records[0].round_s == pytest.approx(3 * STEP_CURVES["cpu1/cnn"].seconds(16))
    assert records[0].efficiency < 0.6
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert {r["clock"] for r in rows} == {clock}
    assert {r["silo"]: r["emulated_curve"] for r in rows} == dict(
        zip(("silo-0", "silo-1", "silo-2"), CURVES, strict=True)
    )


@pytest.mark.slow
@pytest.mark.usefixtures("task_identity")
def test_a_model_clock_experiment_on_curves_with_a_speed_beside_them(tmp_path):
    """The experiment's own clock (EmulatedClock from the scenario's profiles) on curves
    and a plain speed, with fixed costs: τ·curve(B) + o reported, the clock named as the
    scenario names it, and the speedup ceiling computed over the curves."""
    scenario = Scenario.from_mapping(
        {
            "silos": 3,
            "speeds": "curve:h200/cnn*100,curve:cpu1/cnn*100,2",
            "base-speed": 100.0,
            "overheads": "0.05",
            "model": "cnn",
            "rounds": 3,
            "local-steps": 3,
            "batch-size": 16,
        }
    )
    label = "model (curves: silo-0 h200/cnn*100, silo-1 cpu1/cnn*100)"
    assert scenario.clock_label() == label
    profiles = scenario.profiles()
    assert [p.describe() for p in profiles] == [
        "curve h200/cnn*100",
        "curve cpu1/cnn*100",
        "200 samples/s",
    ]
    config = scenario.run_config()
    nodes = {100 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)}

    def clock(context):
        return EmulatedClock(scenario.clock, profiles[context.node_config["partition-id"]])

    grid = InProcessGrid(nodes, config.to_mapping(), fedlb_app(clock=clock, config=config))
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        evaluate_every=3,
        balancing=Balancing(batch_size=16, local_steps=3),
    )
    start(strategy, grid, rounds=3)
    for record in strategy.reporter.records:
        # the strategy's own record names the curves as the scenario does
        assert record.clock == label
        for silo in record.silos:
            expected = (
                profiles[silo.node - 100]
                .time_model(record.round)
                .compute_s(silo.batch_size, silo.local_steps)  # the look cuts a slow silo
            )
            assert silo.compute_s == pytest.approx(expected)
            assert silo.fixed_s == pytest.approx(0.05)
    gpu, cpu = step_curve("h200/cnn*100"), step_curve("cpu1/cnn*100")
    uniform = 0.05 + 3 * max(gpu.seconds(16), cpu.seconds(16), 16 / 200)
    best = min(
        0.05 + 3 * max(gpu.seconds(a), cpu.seconds(b), (48 - a - b) / 200)
        for a, b in itertools.product(range(1, 47), repeat=2)
        if a + b < 48
    )
    assert scenario.speedup_ceiling() == pytest.approx(uniform / best)


def test_a_scenario_refuses_a_curve_of_another_model_and_unknown_curves():
    with pytest.raises(ScenarioError, match="measured on model lenet5, but the scenario trains"):
        Scenario.from_mapping({"silos": 2, "speeds": "curve:h200/lenet5,curve:cpu1/lenet5"})
    with pytest.raises(ScenarioError, match="unknown step-time curve 'h100/mlp'"):
        Scenario.from_mapping({"silos": 2, "speeds": "curve:h100/mlp,1"})
    with pytest.raises(ScenarioError, match="give a relative speed > 0 or curve:NAME"):
        Scenario.from_mapping({"silos": 2, "speeds": "curve:h200/mlp,fast"})
    on_mlp = Scenario.from_mapping({"silos": 2, "speeds": "curve:h200/mlp,curve:cpu1/mlp"})
    assert on_mlp.clock_label() == "model (curves: silo-0 h200/mlp, silo-1 cpu1/mlp)"
    assert Scenario().clock_label() == "model"  # no curve: the clock's name alone


@pytest.fixture
def one_thread():
    """One torch thread, as silos sharing a machine run (node config threads=1): with
    two, a tiny step on a loaded machine can spin for 50 ms, longer than any pad."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class SteppedClock:
    """`time` as fedlb.flower.dropin reads it, on the test's clock: `perf_counter` reads
    it, `sleep` moves it, `time` is the real one's (a ClientApp's age: not used here)."""

    def __init__(self) -> None:
        self.now = 50.0
        self.time = time.time

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def padded_steps(
    spec: str, batches: tuple[int, ...], compute_s: Callable[[int], float] | None = None
) -> tuple[dict[int, list[float]], dict[int, SiloReport]]:
    """Real SGD steps of a small model through balance_mod and balanced_loader on the
    measured clock with a node config's emulated-curve `spec`, 9 steps at each of
    `batches`: {B: each step as the app's loop lives it, from one batch to the next},
    {B: the silo's report}. `compute_s(B)`: on a SteppedClock, what each step's compute
    moves it by (None: the real clock moves on its own)."""
    model = torch.nn.Linear(64, 10)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(600, 64), torch.randint(0, 10, (600,)))
    clock = dropin.time
    lived: dict[int, list[float]] = {}
    reports: dict[int, SiloReport] = {}

    def handler(msg: Message, context: Context) -> Message:
        loader = balanced_loader(msg, DataLoader(data, batch_size=16))
        starts = []
        for x, y in loader:  # asking for the next batch pads the step before it
            starts.append(clock.perf_counter())
            optimiser.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimiser.step()
            if compute_s is not None:
                clock.sleep(compute_s(loader.batch_size))  # type: ignore[attr-defined]
        # from one step's start to the next's: the step as the app's loop lives it
        lived[loader.batch_size] = [b - a for a, b in itertools.pairwise(starts)]
        return Message(RecordDict({"metrics": MetricRecord({"own": 1})}), reply_to=msg)

    for batch in batches:
        message = Message(
            RecordDict(
                {
                    "config": ConfigRecord(
                        {BATCH_SIZE: batch, LOCAL_STEPS: 9, "server-round": 1, PROTOCOL: 1}
                    )
                }
            ),
            dst_node_id=1,
            message_type="train",
        )
        context = Context(1, 1, {"partition-id": 0, "emulated-curve": spec}, RecordDict(), {})
        reply = balance_mod()(message, context, handler)
        reports[batch] = read_report(reply.content["metrics"])
    return lived, reports


@pytest.mark.usefixtures("task_identity", "one_thread")
def test_the_measured_clock_pads_a_real_step_to_the_curve():
    """balance_mod and balanced_loader on the measured clock with a node config's
    emulated-curve: each real SGD step, as the app's loop lives it (from one batch to the
    next), lasts at least the curve's seconds at B (sleep never returns early; a busy
    machine only adds, so no upper bound is asserted on this clock: how close the padding
    comes is the next test's, on the test's own clock)."""
    spec = "cpu1/mlp*40"  # ~9-32 ms a step: well above this small model's real compute
    curve = step_curve(spec)
    lived, reports = padded_steps(spec, (16, 300))
    for batch, walls in lived.items():
        target = curve.seconds(batch)
        # the median: a step lived from batch to batch also moves by the batches' loading
        assert statistics.median(walls) >= target * 0.99
        report = reports[batch]
        assert report.emulated_curve == spec
        assert report.emulated_speed == 0.0
        assert not report.model_clock
        assert report.compute_s >= 9 * target * 0.999


@pytest.mark.usefixtures("task_identity", "one_thread")
def test_the_measured_clock_pads_each_step_to_the_curve_and_no_further(monkeypatch):
    """The same on the test's clock (SteppedClock: each step's compute moves it by a fixed
    amount, the padding's sleep by what it sleeps): a step faster than the curve lasts
    exactly the curve's seconds at B, one slower lasts what it took (nothing padded), and
    the silo reports the lived steps' sum."""
    spec = "cpu1/mlp*40"
    curve = step_curve(spec)
    monkeypatch.setattr(dropin, "time", SteppedClock())
    slow = 2 * curve.seconds(300)  # slower than the curve's 300: not padded
    lived, reports = padded_steps(spec, (16, 300, 200), {16: 0.001, 300: slow, 200: 0.0}.get)
    for batch, took in ((16, 0.001), (300, slow), (200, 0.0)):
        target = max(curve.seconds(batch), took)
        assert lived[batch] == pytest.approx([target] * 8, abs=1e-9), batch
        assert reports[batch].compute_s == pytest.approx(9 * target, abs=1e-9), batch
    assert lived[300][0] > 1.5 * lived[16][0]


@pytest.mark.usefixtures("task_identity")
def test_a_silo_refuses_a_curve_of_another_model():
    """fedlb's silo app knows the run's model: a curve measured on another is refused
    before it trains, and the round's record says why."""
    nodes = {
        100 + i: {"partition-id": i, "num-partitions": 2, "emulated-curve": "h200/lenet5"}
        for i in range(2)
    }
    grid = InProcessGrid(nodes, {"num-silos": 2, "local-steps": 2, "batch-size": 8}, fedlb_app())
    strategy = LoadBalancedFedAvg(
        min_available_nodes=2, balancing=Balancing(batch_size=8, local_steps=2)
    )
    start(strategy, grid, rounds=1)
    (record,) = strategy.reporter.records
    assert len(record.failed) == 2
    assert all("measured on model lenet5, but the run trains mlp" in f for f in record.failed)


@pytest.mark.parametrize(
    ("node", "run", "expected"),
    [
        ({"emulated-curve": "h200/cnn"}, {}, ("h200/cnn", 0.0)),
        ({}, {"fedlb-emulated-curves": "h200/cnn, ,cpu1/cnn*20"}, ("cpu1/cnn*20", 0.0)),
        ({}, {"fedlb-emulated-curves": "h200/cnn,,cpu1/cnn"}, ("cpu1/cnn", 0.0)),
        ({}, {"fedlb-emulated-curves": "h200/cnn"}, "no entry for this silo's partition-id 2"),
        (
            {"emulated-speed": 100.0, "emulated-curve": "h200/cnn"},
            {},
            "both set: a silo emulates a speed or a step-time curve, not both",
        ),
        ({}, {"fedlb-emulated-speeds": "1,1,1", "fedlb-emulated-curves": ",,x"}, "both set"),
        ({"emulated-curve": 3}, {}, "must name a step-time curve"),
        # a node's own setting wins over the run config's list
        ({"emulated-curve": "cpu4/cnn"}, {"fedlb-emulated-curves": "a,b,c"}, ("cpu4/cnn", 0.0)),
        ({"emulated-speed": 0.0}, {"fedlb-emulated-curves": ",,cpu4/cnn"}, ("cpu4/cnn", 0.0)),
    ],
)
def test_a_silo_reads_its_curve_from_its_node_or_the_run_config(node, run, expected):
    node = {"partition-id": 2, **node}
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            read_emulation(node, run)
    else:
        emulation = read_emulation(node, run)
        assert (emulation.curve, emulation.speed) == expected
        assert emulation.clock == "measured"


def test_a_reported_curve_travels_as_bytes_and_garbage_is_no_curve():
    report = SiloReport(4, 2, 0.5, 0.1, emulated_curve="h200/lenet5*20")
    metrics = MetricRecord(report.metrics())
    assert metrics[EMULATED_CURVE] == list(b"h200/lenet5*20")
    assert read_report(metrics) == report
    for garbage in ([300], [0xFF, 0xFE], [1.5], [10], list(range(256)) * 2):
        metrics[EMULATED_CURVE] = garbage
        assert read_report(metrics).emulated_curve == ""


def test_silo_settings_name_a_curve_and_refuse_one_beside_a_speed():
    silo = SiloSettings.from_mapping(
        {"partition-id": 0, "num-partitions": 2, "emulated-curve": "cpu4/cnn*5"}
    )
    assert silo.node_config()["emulated-curve"] == "cpu4/cnn*5"
    assert silo.emulation == "emulated curve cpu4/cnn*5 (clock: measured, sleep-padded)"
    with pytest.raises(ConfigError, match="unknown step-time curve 'gpu'"):
        SiloSettings.from_mapping({"partition-id": 0, "num-partitions": 2, "emulated-curve": "gpu"})
    with pytest.raises(ConfigError, match="not both"):
        SiloSettings.from_mapping(
            {"partition-id": 0, "num-partitions": 2, "emulated-curve": "h200/cnn", "slowdown": 2.0}
        )
    with pytest.raises(SiloConfigError, match="not both"):
        node_settings(
            {
                "partition-id": 0,
                "num-partitions": 2,
                "emulated-speed": 5,
                "emulated-curve": "h200/cnn",
            }
        )
    demo = local_silos([], curves=["h200/cnn", "cpu1/cnn"])
    assert [s.node_config()["emulated-curve"] for s in demo] == ["h200/cnn", "cpu1/cnn"]
    assert [s.num_partitions for s in demo] == [2, 2]
    with pytest.raises(ConfigError, match="not both"):
        local_silos([1.0], curves=["h200/cnn"])


def test_cluster_ranks_on_curves_are_paced_named_and_judged_over_their_curves():
    from fedlb.experiments import ClusterScenario, ClusterScenarioError
    from fedlb.experiments.cluster_run import _pace

    job = ClusterScenario.from_mapping(
        {"nproc": 3, "speeds": "curve:h200/mlp*50,curve:cpu1/mlp*50,1", "iterations": 5}
    )
    assert job.clock_label() == "measured (curves: rank-0 h200/mlp*50, rank-1 cpu1/mlp*50)"
    assert ClusterScenario().clock_label() == "measured (emulated speeds)"
    gpu, cpu = step_curve("h200/mlp*50"), step_curve("cpu1/mlp*50")
    pace = _pace(job, 1, lambda: 1.0)
    assert pace(0.0, 300) == pytest.approx(cpu.seconds(300))
    assert pace(1.0, 300) == 1.0  # a step slower than the curve is not padded
    assert _pace(job, 1, lambda: 0.5)(0.0, 300) == pytest.approx(2 * cpu.seconds(300))
    assert _pace(job, 2, lambda: 1.0)(0.0, 100) == pytest.approx(100 / 200)  # the linear rank
    best = min(
        max(gpu.seconds(a), cpu.seconds(b), (96 - a - b) / 200)
        for a, b in itertools.product(range(1, 95), repeat=2)
        if a + b < 96
    )
    # T*: over the curves; the linear rank at the speed measured for it
    assert job.ideal_s(3, 96, {"0": 1.0, "1": 1.0, "2": 200.0}) == pytest.approx(best)
    uniform = max(gpu.seconds(32), cpu.seconds(32), 32 / 200)
    assert job.ceiling() == pytest.approx(uniform / best)
    with pytest.raises(ClusterScenarioError, match="measured on model cnn, but the job trains"):
        ClusterScenario.from_mapping({"nproc": 2, "speeds": "curve:h200/cnn,1"})
    # a model that cannot take the dataset's samples is refused before any rank starts
    with pytest.raises(ClusterScenarioError, match="model lenet5 needs 28x28 or 32x32 images"):
        ClusterScenario.from_mapping({"nproc": 2, "model": "lenet5", "dataset": "digits"})


@pytest.mark.usefixtures("task_identity")
def test_a_drop_in_silo_takes_its_curve_from_the_run_config_by_partition_id():
    """Flower's simulation gives a node no config of its own: the run config's
    fedlb-emulated-curves names each partition's curve, fedlb-emulated-clock the clock."""
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))

    def handler(msg: Message, context: Context) -> Message:
        for _ in balanced_loader(msg, DataLoader(data, batch_size=8)):
            pass
        return Message(RecordDict({"metrics": MetricRecord({"own": 1})}), reply_to=msg)

    message = Message(
        RecordDict(
            {
                "config": ConfigRecord(
                    {BATCH_SIZE: 40, LOCAL_STEPS: 5, "server-round": 2, PROTOCOL: 1}
                )
            }
        ),
        dst_node_id=1,
        message_type="train",
    )
    run = {"fedlb-emulated-curves": "h200/lenet5,,cpu1/lenet5*3", "fedlb-emulated-clock": "model"}
    replies = {
        partition: read_report(
            balance_mod()(
                message, Context(1, 1, {"partition-id": partition}, RecordDict(), run), handler
            ).content["metrics"]
        )
        for partition in (0, 1, 2)
    }
    assert replies[0].emulated_curve == "h200/lenet5"
    assert replies[0].compute_s == pytest.approx(5 * STEP_CURVES["h200/lenet5"].seconds(40))
    assert replies[2].compute_s == pytest.approx(15 * STEP_CURVES["cpu1/lenet5"].seconds(40))
    assert replies[0].model_clock
    assert replies[2].model_clock
    assert replies[1].emulated_curve == ""  # an empty entry: its real speed, measured
    assert not replies[1].model_clock
