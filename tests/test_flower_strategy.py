"""LoadBalancedFedAvg driven in-process with Flower messages and fedlb's silo app (its
ClientApp with balance_mod, as fedlb's client_app builds it)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedlb.balance import BatchSizeManager, Proportional, Static
from fedlb.deploy import RunConfig, evaluate_reply, train_reply
from fedlb.deploy.task import federation_data, model_for
from fedlb.experiments.profiles import EmulatedClock, SpeedProfile
from fedlb.experiments.variants import QuorumFedAvg
from fedlb.flower import Balancing, Joining, Keeping, LoadBalancedFedAvg, RoundReporter, balance_mod
from fedlb.flower.protocol import (
    BATCH_SIZE,
    COMPUTE_S,
    EVALUATE_FIRST,
    LEARNING_RATE,
    LOCAL_STEPS,
    OVERHEAD_S,
    PREFIX,
    SERVER_ROUND,
    TRAIN_LOSS,
)
from tests.flower_fakes import InProcessGrid, fedlb_app, lr_config

pytestmark = pytest.mark.usefixtures("task_identity")

BASE = 500.0  # samples/s of a factor-1 silo (well above what real compute needs)
MODEL_SPEED = "model-speed"  # this file's node config key: the silo's speed on the model clock


def static(initial):
    """A balancer that never moves a size: plain FedAvg."""
    return BatchSizeManager(initial, Static())


def run_config(**overrides):
    values = {"num-silos": 3, "local-steps": 3, "batch-size": 16, "evaluate-every": 2}
    values.update(overrides)
    return values


def model_clock(context):
    """Silos on the model clock: they report t = o + τ·B/v for their node config's speed
    (exact, whatever else runs on this machine); silos without one report measured time."""
    speed = context.node_config.get(MODEL_SPEED)
    return None if speed is None else EmulatedClock("model", SpeedProfile(speed, overhead=0.02))


def make_grid(factors=(1, 2, 4), emulated=False, **overrides):
    """Silos `factors` times slower than BASE samples/s: on the model clock, or with
    emulated=True measured, each step padded with sleep to the silo's emulated speed."""
    key = "emulated-speed" if emulated else MODEL_SPEED
    nodes = {
        100 + i: {"partition-id": i, "num-partitions": len(factors), key: BASE / f}
        for i, f in enumerate(factors)
    }
    app = fedlb_app() if emulated else fedlb_app(clock=model_clock)
    return InProcessGrid(nodes, run_config(**overrides), app)


def initial_arrays(config):
    pool, _ = federation_data(config)
    return ArrayRecord(model_for(config, pool).state_dict())


def start(strategy, grid, rounds=3):
    config = RunConfig.from_mapping(grid.run_config)
    return strategy.start(
        grid=grid,
        initial_arrays=initial_arrays(config),
        num_rounds=rounds,
        timeout=30,
        train_config=lr_config(),
    )


def train_messages(grid):
    return [m for m in grid.sent if m.metadata.message_type == "train"]


def sent_sizes(grid):
    """[{node: B} of round 1, of round 2, ...]; None where no size was sent (the silo's own)"""
    by_round: dict[int, dict[int, int | None]] = {}
    for msg in train_messages(grid):
        config = msg.content["config"]
        by_round.setdefault(config[SERVER_ROUND], {})[msg.metadata.dst_node_id] = config.get(
            BATCH_SIZE
        )
    return [by_round[k] for k in sorted(by_round)]


def test_each_silo_gets_its_own_size_and_sizes_follow_the_speeds(tmp_path):
    grid = make_grid()
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        evaluate_every=2,
        balancing=Balancing(batch_size=16, local_steps=3),
        keeping=Keeping(reporter=RoundReporter(tmp_path)),
    )
    start(strategy, grid, rounds=4)
    train = train_messages(grid)
    assert len(train) == 12
    # a new RecordDict and ConfigRecord for every message
    assert len({id(m.content) for m in train}) == 12
    assert len({id(m.content["config"]) for m in train}) == 12
    sizes = sent_sizes(grid)
    assert sizes[0] == {100: 16, 101: 16, 102: 16}
    for by_node in sizes:
        assert sum(by_node.values()) == 48
    last = sizes[3]
    assert last[100] > last[101] > last[102]
    assert last[100] / last[102] == pytest.approx(4, rel=0.3)
    assert all(m.content["config"][LOCAL_STEPS] == 3 for m in train)
    # the app's own train config reaches every silo beside fedlb's orders
    assert all(m.content["config"][LEARNING_RATE] == 0.1 for m in train)
    # evaluation only every 2 rounds (and after the last)
    evaluated = sorted(
        {
            m.content["config"][SERVER_ROUND]
            for m in grid.sent
            if m.metadata.message_type == "evaluate"
        }
    )
    assert evaluated == [2, 4]
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    assert {r["clock"] for r in rows} == {"model"}
    late = [r for r in rows if r["round"] >= 2]
    assert min(r["efficiency"] for r in late) > 0.85
    assert all(r["accuracy"] is not None for r in rows if r["round"] in (2, 4))


def test_emulated_speeds_pad_each_step_and_are_reported():
    """The measured clock with a node config's emulated-speed: balance_mod pads each step
    with sleep to that speed, so a silo reports at least τ·B/v seconds of compute."""
    grid = make_grid(emulated=True)
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3)
    )
    start(strategy, grid, rounds=2)
    sizes = sent_sizes(grid)
    assert sum(sizes[1].values()) == 48
    for record in strategy.reporter.records:
        assert record.clock == "measured (emulated speeds)"
        assert not record.failed
        assert not record.rejected
        for silo in record.silos:
            speed = BASE / (1, 2, 4)[silo.node - 100]
            assert silo.emulated_speed == pytest.approx(speed)
            assert silo.compute_s >= 3 * silo.batch_size / speed * 0.999
            assert silo.fixed_s >= 0


def test_evaluation_rides_on_the_next_train_message(tmp_path):
    grid = make_grid()
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        evaluate_every=1,
        evaluate_with_train=True,
        balancing=Balancing(batch_size=16, local_steps=3),
        keeping=Keeping(reporter=RoundReporter(tmp_path)),
    )
    start(strategy, grid, rounds=4)
    flagged = {
        m.content["config"][SERVER_ROUND]
        for m in train_messages(grid)
        if m.content["config"].get(EVALUATE_FIRST) is True
    }
    assert flagged == {2, 3, 4}  # round r's train messages evaluate the model of round r-1
    evaluated = {
        m.content["config"][SERVER_ROUND]
        for m in grid.sent
        if m.metadata.message_type == "evaluate"
    }
    assert evaluated == {4}  # only the final model has its own evaluate phase
    records = strategy.reporter.records
    assert [r.round for r in records] == [1, 2, 3, 4]
    assert all(r.accuracy is not None for r in records)
    assert all(s.accuracy is not None for r in records for s in r.silos)
    assert records[-1].accuracy > records[0].accuracy - 0.05


def test_aggregation_is_weighted_by_dataset_size_not_samples_processed():
    grid = make_grid(partition="classes:3")
    captured = {}

    def keep(reply):
        captured[reply.metadata.src_node_id] = reply
        return reply

    grid.intercept = keep
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3)
    )
    config = RunConfig.from_mapping(grid.run_config)
    arrays = initial_arrays(config)
    messages = strategy.configure_train(1, arrays, lr_config(), grid)
    grid.push_messages(messages)
    replies = grid.pull_messages([m.metadata.message_id for m in messages])
    aggregated, metrics = strategy.aggregate_train(1, replies)
    sizes = {n: r.content["metrics"]["num-examples"] for n, r in captured.items()}
    assert len(set(sizes.values())) > 1  # non-uniform dataset sizes
    total = sum(sizes.values())
    for key in aggregated:
        expected = sum(
            captured[n].content["arrays"][key].numpy() * sizes[n] / total for n in captured
        )
        np.testing.assert_allclose(aggregated[key].numpy(), expected, rtol=1e-6, atol=1e-7)
    assert metrics[TRAIN_LOSS] > 0


def test_the_metric_aggregation_functions_see_only_the_apps_metrics():
    """FedAvg's train_metrics_aggr_fn and evaluate_metrics_aggr_fn are honoured, and see
    what the app reported: fedlb's report keys are taken out first."""
    seen: dict[str, list[dict]] = {"train": [], "evaluate": []}

    def aggregation(kind):
        def aggregate(records, weighting_key):
            assert weighting_key == "num-examples"
            seen[kind].append([dict(r["metrics"]) for r in records])
            return MetricRecord({f"{kind}-calls": len(seen[kind])})

        return aggregate

    grid = make_grid()
    on_the_wire = set()

    def note(reply):
        if reply.metadata.message_type == "train":
            on_the_wire.update(reply.content["metrics"].keys())
        return reply

    grid.intercept = note
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        evaluate_every=1,
        train_metrics_aggr_fn=aggregation("train"),
        evaluate_metrics_aggr_fn=aggregation("evaluate"),
        balancing=Balancing(batch_size=16, local_steps=3),
    )
    result = start(strategy, grid, rounds=2)
    assert len(seen["train"]) == 2
    assert len(seen["evaluate"]) == 2
    for kind, calls in seen.items():
        for records in calls:
            assert len(records) == 3
            for metrics in records:
                assert metrics["num-examples"] > 0  # the app's own metrics are there ...
                assert not [k for k in metrics if k.startswith(PREFIX)], (kind, metrics)
    assert all(TRAIN_LOSS in m for records in seen["train"] for m in records)
    # ... while the replies on the wire did carry fedlb's report
    assert {BATCH_SIZE, LOCAL_STEPS, COMPUTE_S, OVERHEAD_S} <= on_the_wire
    # what the functions returned is Flower's Result, with fedlb's balance figures beside
    assert result.train_metrics_clientapp[2]["train-calls"] == 2
    assert {"fedlb.efficiency", "fedlb.round-s"} <= set(result.train_metrics_clientapp[2])
    assert result.evaluate_metrics_clientapp[2]["evaluate-calls"] == 2


def test_fraction_train_samples_the_silos_of_each_round():
    grid = make_grid(factors=(1, 1, 2, 2), **{"num-silos": 4})
    random.seed(3)  # FedAvg samples with Python's random, as in a stock run
    strategy = LoadBalancedFedAvg(
        fraction_train=0.5,
        fraction_evaluate=0.5,
        min_available_nodes=4,
        evaluate_every=1,
        balancing=Balancing(batch_size=16, local_steps=3),
    )
    start(strategy, grid, rounds=4)
    chosen = [set(by_node) for by_node in sent_sizes(grid)]
    assert len(chosen) == 4
    assert all(len(nodes) == 2 for nodes in chosen)  # ⌊0.5 · 4⌋ of the 4 silos
    assert len({frozenset(nodes) for nodes in chosen}) > 1  # not the same two every round
    evaluated: dict[int, set[int]] = {}
    for msg in grid.sent:
        if msg.metadata.message_type == "evaluate":
            evaluated.setdefault(msg.content["config"][SERVER_ROUND], set()).add(
                msg.metadata.dst_node_id
            )
    assert sorted(evaluated) == [1, 2, 3, 4]
    assert all(len(nodes) == 2 for nodes in evaluated.values())
    for record, nodes in zip(strategy.reporter.records, chosen, strict=True):
        assert {s.node for s in record.silos} == nodes  # only the sampled ones trained
        assert not record.failed  # and nobody was expected who was not asked
    # each silo brought its B0 when first sampled: X = 16 per silo seen
    seen = set().union(*chosen)
    assert set(strategy.current_sizes()) == seen
    assert sum(strategy.current_sizes().values()) == 16 * len(seen)


def run_rounds(strategy, grid, changes, rounds):
    grid.before_round = dict(changes)
    strategy.start(
        grid=grid,
        initial_arrays=initial_arrays(RunConfig.from_mapping(grid.run_config)),
        num_rounds=rounds,
        timeout=0.3,
        train_config=lr_config(),
    )
    return strategy.reporter.records, grid


def test_a_silo_that_vanishes_is_left_out_and_rejoins_with_its_b0(caplog):
    """X is the sum of the B0 the present silos brought: a silo that vanishes takes its
    B0 out (the rest is re-divided), one that comes back runs its B0 for a round and
    brings it back (a fresh speed estimate, balanced from its next round)."""
    grid = make_grid()
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3)
    )

    def kill_102(g):  # SIGKILL: it stops answering, the SuperLink still lists it a while
        g.drop = {102}

    def superlink_lets_go_and_it_restarts_as_103(g):
        info = g.nodes.pop(102)
        g.drop = set()
        g.nodes[103] = info

    with caplog.at_level("INFO"):
        records, grid = run_rounds(
            strategy, grid, {3: kill_102, 5: superlink_lets_go_and_it_restarts_as_103}, 7
        )
    sizes = sent_sizes(grid)
    assert sizes[0] == {100: 16, 101: 16, 102: 16}
    assert sizes[1][100] > sizes[1][101] > sizes[1][102]  # balanced after round 1
    assert set(sizes[2]) == {100, 101, 102}  # round 3: sent, no reply
    assert any("node-102: no reply" in f for f in records[2].failed)
    assert any("missed round 3" in e for e in records[2].events)
    assert any("left" in e for e in records[2].events)
    assert set(sizes[3]) == {100, 101}
    assert sum(sizes[3].values()) == 32  # its B0 went with it
    assert sizes[3][100] > sizes[3][101]  # the rest re-divided in proportion
    # it comes back (a new node id without a silo key): its B0 again, a fresh estimate
    assert set(sizes[4]) == {100, 101, 103}
    assert sizes[4][103] == 16
    assert sum(sizes[4].values()) == 48
    assert any("joined with its B0 = 16" in e for e in records[4].events)
    assert sizes[5][100] > sizes[5][101] > sizes[5][103]  # balanced from its next round
    assert sum(sizes[5].values()) == 48
    assert strategy.manager.estimators["103"].observations == 3  # rounds 5-7 only
    assert records[6].efficiency > 0.85
    # the membership changes are logged as they happen, through Flower's logger
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if m.startswith("fedlb: silo-2 missed round 3")]
    assert [m for m in said if m.startswith("fedlb: silo-2 left")]
    assert [m for m in said if m.startswith("fedlb: silo-2 joined with its B0 = 16")]


def test_one_partition_one_vote():
    """Two silos claiming one partition (started twice, or restarted while the old
    SuperNode is still listed): only the node that holds it counts; the other is refused
    and not sampled while the holder takes part, and takes the partition over once the
    holder is gone."""
    grid = make_grid()
    grid.nodes[103] = dict(grid.nodes[102])  # silo-2 started a second time
    strategy = LoadBalancedFedAvg(
        min_available_nodes=4, balancing=Balancing(batch_size=16, local_steps=3)
    )

    def holder_killed(g):  # SIGKILL: it stops answering, still listed for a while
        g.drop = {102}

    records, grid = run_rounds(strategy, grid, {4: holder_killed}, 6)
    sizes = sent_sizes(grid)
    assert set(sizes[0]) == {100, 101, 102, 103}  # round 1: nobody holds silo-2 yet
    assert [s.node for s in records[0].silos if s.silo == "silo-2"] == [102]
    assert any("node-103: claims partition 2" in f for f in records[0].failed)
    assert any("refused (one partition, one vote)" in e for e in records[0].events)
    assert set(sizes[1]) == set(sizes[2]) == {100, 101, 102}  # the duplicate is not sampled
    assert sum(sizes[1].values()) == 48  # X: the three partitions' B0
    assert all(len([s for s in r.silos if s.silo == "silo-2"]) == 1 for r in records[:3])
    # round 4: the holder misses the round and is left out; the newcomer takes over
    assert 103 not in sizes[3]
    assert set(sizes[4]) == {100, 101, 103}
    assert [s.node for s in records[4].silos if s.silo == "silo-2"] == [103]
    assert any("silo-2 is now node-103" in e for e in records[4].events)
    assert not any("claims partition" in f for r in records[1:] for f in r.failed)


def test_a_silo_that_missed_a_round_but_stays_connected_is_tried_again():
    grid = make_grid()
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        balancing=Balancing(batch_size=16, local_steps=3),
        joining=Joining(rejoin_grace=0.0),
    )

    def stall_102(g):
        g.drop = {102}

    def recover(g):
        g.drop = set()

    records, grid = run_rounds(strategy, grid, {2: stall_102, 3: recover}, 4)
    sizes = sent_sizes(grid)
    assert any("silo-2 left" in e for e in records[1].events)  # missed round 2
    assert set(sizes[2]) == {100, 101, 102}  # grace 0: tried again at once
    assert sizes[2][102] == 16  # with its B0
    assert sum(sizes[2].values()) == 48
    assert any("tried again" in e for e in records[2].events)
    assert strategy.manager.estimators["102"].observations == 2  # restarted at round 3


@pytest.mark.timeout(60)
def test_when_every_silo_is_left_out_the_server_waits_out_the_grace():
    grid = make_grid(factors=(1,), **{"num-silos": 1})
    strategy = LoadBalancedFedAvg(
        min_available_nodes=1,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        balancing=Balancing(batch_size=16, local_steps=3),
        joining=Joining(rejoin_grace=1.0),
    )

    def stall(g):
        g.drop = {100}

    def recover(g):
        g.drop = set()

    records, grid = run_rounds(strategy, grid, {2: stall, 3: recover}, 3)
    sizes = sent_sizes(grid)
    assert [set(s) for s in sizes] == [{100}, {100}, {100}]  # round 3 waited for it
    assert any("tried again" in e for e in records[2].events)


def test_much_slower_silo_shrinks_to_min_batch_and_is_told_to_leave():
    grid = make_grid(factors=(1, 1, 30))  # its share of X = 48 would be < 1 sample
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        balancing=Balancing(
            batch_size=16,
            local_steps=3,
            balancer=lambda initial: BatchSizeManager(initial, Proportional(min_batch=4)),
        ),
    )
    records, grid = run_rounds(strategy, grid, {}, 3)
    sizes = sent_sizes(grid)
    assert sizes[-1][102] == 4
    assert sum(sizes[-1].values()) == 48
    told = [e for r in records for e in r.events if "should leave" in e]
    assert len(told) == 1
    assert told[0].startswith("silo-2")


def is_train_from(reply, node):
    return reply.metadata.src_node_id == node and reply.metadata.message_type == "train"


def with_metrics(reply, **changes):
    metrics = MetricRecord(dict(reply.content["metrics"]))
    for key, value in changes.items():
        if value is None:
            del metrics[key]
        else:
            metrics[key] = value
    return Message(
        RecordDict({"arrays": reply.content["arrays"], "metrics": metrics}),
        reply_to=_original(reply),
    )


def _original(reply):
    """A stand-in for the message `reply` answers (same ids), to build a new reply."""
    fake = Message(RecordDict(), dst_node_id=reply.metadata.src_node_id, message_type="train")
    fake.metadata.__dict__["_message_id"] = reply.metadata.reply_to_message_id
    return fake


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({COMPUTE_S: math.nan}, "not finite numbers"),
        ({COMPUTE_S: -1.0}, f"{COMPUTE_S} must be in 0..1e+06 s, got -1"),
        ({COMPUTE_S: 0.0}, "which no machine trains"),
        ({COMPUTE_S: 1e-298}, "faster than 1e+09 samples/s"),  # the probe's: E was 0.048
        ({OVERHEAD_S: 1.8e305}, f"{OVERHEAD_S} must be in 0..1e+06 s"),
        ({OVERHEAD_S: None}, f"missing metric(s) {OVERHEAD_S}"),
        ({BATCH_SIZE: 999}, "batch size 999 is not the"),
        ({LOCAL_STEPS: 2.5}, f"{LOCAL_STEPS} must be a whole number"),
    ],
)
def test_a_bad_report_is_dropped_but_its_update_is_used(changes, reason, caplog):
    grid = make_grid()
    second_round = {"seen": 0}

    def tamper(reply):
        if not is_train_from(reply, 101):
            return reply
        second_round["seen"] += 1
        return with_metrics(reply, **changes) if second_round["seen"] == 2 else reply

    grid.intercept = tamper
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3)
    )
    with caplog.at_level("WARNING"):
        start(strategy, grid, rounds=2)
    first, second = strategy.reporter.records
    assert not first.rejected
    assert any(reason in r for r in second.rejected), second.rejected
    assert all(r.startswith("silo-1: ") for r in second.rejected)
    assert {s.node for s in second.silos} == {100, 101, 102}  # its update still counted
    assert strategy.current_sizes()[101] == sent_sizes(grid)[1][101]  # its size is kept
    assert sum(strategy.current_sizes().values()) == 48
    assert reason in caplog.text


def test_a_silo_whose_first_report_is_unusable_joins_with_its_next(caplog):
    """The balancer starts from the first usable reports; a silo whose first report
    cannot be used runs its B0 again and brings it to X with its first usable one."""
    grid = make_grid()
    seen = []

    def spoil_first(reply):
        if not is_train_from(reply, 101):
            return reply
        seen.append(1)
        return with_metrics(reply, **{COMPUTE_S: math.nan}) if len(seen) == 1 else reply

    grid.intercept = spoil_first
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3)
    )
    with caplog.at_level("WARNING"):
        start(strategy, grid, rounds=3)
    assert any("report of node 101 dropped" in m.getMessage() for m in caplog.records)
    first, second, _ = strategy.reporter.records
    assert {s.node for s in first.silos} == {100, 101, 102}  # its update still counted
    sizes = sent_sizes(grid)
    assert sizes[1][101] == 16  # its B0 again
    assert sum(sizes[1].values()) == 48
    assert any("silo-1 joined with its B0 = 16" in e for e in second.events)
    assert sizes[2][100] > sizes[2][101] > sizes[2][102]
    assert sum(strategy.current_sizes().values()) == 48


def test_a_silo_that_never_sends_a_usable_update_runs_its_b0():
    grid = make_grid()

    def spoil(reply):
        if not is_train_from(reply, 102):
            return reply
        arrays = {
            k: _arr(np.full(v.shape, np.nan, dtype=np.float32))
            for k, v in reply.content["arrays"].items()
        }
        return Message(
            RecordDict({"arrays": ArrayRecord(arrays), "metrics": reply.content["metrics"]}),
            reply_to=_original(reply),
        )

    grid.intercept = spoil
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3)
    )
    start(strategy, grid, rounds=3)
    assert [by_node[102] for by_node in sent_sizes(grid)] == [16, 16, 16]
    assert 102 not in strategy.current_sizes()  # never measured: not balanced
    assert sum(strategy.current_sizes().values()) == 32
    for record in strategy.reporter.records:
        assert {s.node for s in record.silos} == {100, 101}
        assert any(f.startswith("node-102: update rejected") for f in record.failed)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda a: {k: np.zeros((3, 3), dtype=np.float32) for k in a},  # wrong shapes
        lambda a: {k: np.full(v.shape, np.nan, dtype=np.float32) for k, v in a.items()},
        lambda a: dict(list(a.items())[:1]),  # missing keys
    ],
)
def test_a_malformed_update_is_rejected_and_the_server_lives_on(tamper):
    grid = make_grid()
    calls = {"seen": 0}

    def corrupt(reply):
        if not is_train_from(reply, 102):
            return reply
        calls["seen"] += 1
        if calls["seen"] < 2:  # its first round is fine: it has a balanced size
            return reply
        arrays = {k: v.numpy() for k, v in reply.content["arrays"].items()}
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({k: _arr(v) for k, v in tamper(arrays).items()}),
                    "metrics": reply.content["metrics"],
                }
            ),
            reply_to=_original(reply),
        )

    grid.intercept = corrupt
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        balancing=Balancing(batch_size=16, local_steps=3),
        pack_model=False,  # the arrays as the app sent them: each tampered on its own
    )
    result = start(strategy, grid, rounds=3)
    assert result.arrays is not None
    records = strategy.reporter.records
    assert not records[0].failed
    for record in records[1:]:
        assert [f for f in record.failed if f.startswith("node-102: update rejected")]
        assert {s.node for s in record.silos} == {100, 101}
    kept = sent_sizes(grid)[1][102]
    if any("NaN or infinite" in f for f in records[1].failed):
        # a blow-up before the guard's verdict puts the run at the edge: uniform sizes
        assert sent_sizes(grid)[2][102] == 16
        assert strategy.current_sizes()[102] == 16
        return
    assert sent_sizes(grid)[2][102] == kept  # no report from it: size kept
    assert strategy.current_sizes()[102] == kept


def _arr(value):
    from flwr.app import Array

    return Array(np.asarray(value))


def test_a_static_balancer_is_plain_fedavg():
    grid = make_grid()
    fedavg = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3, balancer=static)
    )
    start(fedavg, grid, rounds=2)
    assert set(fedavg.current_sizes().values()) == {16}
    assert sent_sizes(grid) == [{100: 16, 101: 16, 102: 16}] * 2


def own_loader_app(batch_sizes):
    """fedlb's silo app whose silos each build their DataLoader at their own batch size
    (as any app's silos may), from the partition id."""
    app = ClientApp(mods=[balance_mod()])

    def config_of(context):
        own = batch_sizes[context.node_config["partition-id"]]
        return RunConfig.from_mapping({**context.run_config, "batch-size": own})

    @app.train()
    def train(msg, context):
        return train_reply(msg, context, config_of(context))

    @app.evaluate()
    def evaluate(msg, context):
        return evaluate_reply(msg, context, config_of(context))

    return app


def test_round_one_runs_each_silos_own_batch_size_and_sizes_the_balancer():
    """No batch_size or local_steps given: round 1 sends no size and no steps, each silo
    draws its own loader's B0 for its own loop's steps, and the balancer is made from
    those first reports (X = Σ B0_i)."""
    own = {0: 8, 1: 16, 2: 24}
    nodes = {100 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)}
    grid = InProcessGrid(nodes, run_config(), own_loader_app(own))
    made = []

    def balancer(initial):
        made.append(dict(initial))
        return BatchSizeManager(initial, Static())

    strategy = LoadBalancedFedAvg(min_available_nodes=3, balancing=Balancing(balancer=balancer))
    start(strategy, grid, rounds=2)
    first = [m for m in train_messages(grid) if m.content["config"][SERVER_ROUND] == 1]
    assert len(first) == 3
    for msg in first:
        assert BATCH_SIZE not in msg.content["config"]
        assert LOCAL_STEPS not in msg.content["config"]
    assert made == [{"100": 8, "101": 16, "102": 24}]  # made once, from round 1's reports
    assert strategy.manager.total == 48
    assert sent_sizes(grid)[1] == {100: 8, 101: 16, 102: 24}
    first_record, second_record = strategy.reporter.records
    assert {s.node: s.batch_size for s in first_record.silos} == {100: 8, 101: 16, 102: 24}
    # τ_i: each silo's own loop (one pass over its data at B0_i), kept in round 2
    steps = {s.node: s.local_steps for s in first_record.silos}
    assert steps[100] > steps[101] > steps[102]
    assert {s.node: s.local_steps for s in second_record.silos} == steps


def test_a_silo_with_its_own_data_file(tmp_path):
    from fedlb.data import load_digits

    digits = load_digits()
    own = tmp_path / "hospital.npz"
    np.savez(own, x=digits.x[:200], y=digits.y[:200])
    grid = make_grid()
    grid.nodes[102] = {"data-path": str(own), MODEL_SPEED: BASE / 4}
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3)
    )
    start(strategy, grid, rounds=2)
    record = strategy.reporter.records[-1]
    assert not record.failed
    by_node = {s.node: s for s in record.silos}
    assert by_node[102].num_examples == 160  # 200 minus the 20% it holds out
    assert by_node[102].silo == "node-102"  # no partition: named by its node


def test_a_data_file_that_does_not_fit_the_model_is_an_error_reply(tmp_path):
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((50, 3, 4), dtype=np.float32), y=np.zeros(50))
    grid = make_grid()
    grid.nodes[102] = {"data-path": str(wrong)}
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3)
    )
    result = start(strategy, grid, rounds=1)
    assert result.arrays is not None  # the other two silos carried the round
    failed = " ".join(strategy.reporter.records[-1].failed)
    assert "samples have shape (3, 4)" in failed
    assert "takes (1, 8, 8)" in failed


def test_four_hospitals_as_four_silos(tmp_path):
    """A tabular dataset with natural silos: heart-disease split by hospital."""
    rng = np.random.default_rng(0)
    header = (
        "id,age,sex,dataset,cp,trestbps,chol,fbs,restecg,thalch,exang,oldpeak,slope,ca,thal,num"
    )
    hospitals = ["Cleveland", "Hungary", "Switzerland", "VA Long Beach"]
    rows = [header]
    for i in range(160):
        rows.append(
            f"{i},{rng.integers(30, 75)},{rng.choice(['Male', 'Female'])},{hospitals[i % 4]},"
            f"asymptomatic,{rng.integers(100, 180)},{rng.integers(150, 300)},FALSE,normal,"
            f"{rng.integers(90, 190)},TRUE,{rng.uniform(0, 3):.1f},flat,0,normal,"
            f"{rng.integers(0, 3)}"
        )
    (tmp_path / "heart_disease_uci.csv").write_text("\n".join(rows) + "\n")
    nodes = {
        200 + i: {"partition-id": i, "num-partitions": 4, "emulated-speed": 200.0 * (i + 1)}
        for i in range(4)
    }
    settings = run_config(
        **{
            "num-silos": 4,
            "dataset": "heart-disease",
            "data-dir": str(tmp_path),
            "partition": "natural",
        }
    )
    grid = InProcessGrid(nodes, settings)
    strategy = LoadBalancedFedAvg(
        min_available_nodes=4, balancing=Balancing(batch_size=8, local_steps=3)
    )
    start(strategy, grid, rounds=2)
    record = strategy.reporter.records[-1]
    assert not record.failed
    # 160 patients, 20% held out for the server, each hospital's rest split 80/20
    examples = [s.num_examples for s in record.silos]
    assert len(examples) == 4
    assert all(20 <= n <= 32 for n in examples)


def test_quorum_keeps_the_fastest_two_of_three():
    """The experiment-only variant (fedlb.experiments.variants): every silo trains, only
    the ⌈0.6 · 3⌉ = 2 fastest updates are averaged."""
    grid = make_grid()
    strategy = QuorumFedAvg(
        quorum=0.6,
        min_available_nodes=3,
        balancing=Balancing(batch_size=16, local_steps=3, balancer=static),
    )
    start(strategy, grid, rounds=2)
    assert [set(by_node) for by_node in sent_sizes(grid)] == [{100, 101, 102}] * 2
    for record in strategy.reporter.records:
        assert {s.node for s in record.silos} == {100, 101}  # 102 is 4x slower
        assert any("node-102: not among the quorum" in f for f in record.failed)
    with pytest.raises(ValueError, match="quorum must be a fraction"):
        QuorumFedAvg(quorum=0.0)


def test_the_strategy_reads_like_fedavg_and_its_option_groups_refuse_bad_values():
    """FedAvg's arguments first, in FedAvg's order and with its defaults; then fedlb's,
    keyword only, in a few documented groups; a bad value is refused with its name."""
    import inspect

    from flwr.serverapp.strategy import FedAvg

    ours = inspect.signature(LoadBalancedFedAvg.__init__).parameters
    theirs = inspect.signature(FedAvg.__init__).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, parameter in theirs.items():
        assert ours[name].default == parameter.default, name
    own = [p for p in ours.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(ours) - 1 <= 20  # FedAvg takes ~10; ours reads like it
    assert {p.name for p in own} >= {"balancing", "joining", "keeping"}
    with pytest.raises(ValueError, match="batch_size must be None or an integer >= 1"):
        Balancing(batch_size=0)
    with pytest.raises(ValueError, match="local_steps must be None or an integer >= 1"):
        Balancing(local_steps=True)
    with pytest.raises(ValueError, match="rejoin_grace must be a finite number >= 0"):
        Joining(rejoin_grace=float("nan"))
    with pytest.raises(ValueError, match="evaluate_every must be >= 1"):
        LoadBalancedFedAvg(evaluate_every=0)
    assert LoadBalancedFedAvg(balancing=Balancing(guard=False)).guard is None
    assert LoadBalancedFedAvg().guard is not LoadBalancedFedAvg().guard  # one guard each


def test_the_model_travels_packed_and_ends_where_an_unpacked_run_does():
    """fedlb.flower.packing: one float32 array on the wire (and its layout in the
    config) from round 2, once each silo's reply showed its balance_mod (which unpacks
    it), the app and the server seeing the usual arrays; the same model, bit for bit, as
    a run that sends every array on its own. A packed reply of the wrong size is rejected
    like any malformed update, and that silo gets the model unpacked next."""
    from fedlb.flower.packing import LAYOUT, PACKED

    results = {}
    for packed in (True, False):
        grid = make_grid()
        replied = []

        def look(reply, replied=replied):
            if reply.content.array_records:  # a train reply (evaluation: metrics only)
                replied.append(list(reply.content["arrays"].keys()))
            return reply

        grid.intercept = look
        strategy = LoadBalancedFedAvg(
            min_available_nodes=3,
            balancing=Balancing(batch_size=16, local_steps=3),
            pack_model=packed,
        )
        results[packed] = start(strategy, grid, rounds=3).arrays
        sent = [m for m in grid.sent if m.metadata.message_type == "train"]
        assert len(sent) == 9
        assert not any(LAYOUT in m.content["config"] for m in sent[:3])  # round 1
        assert all((LAYOUT in m.content["config"]) == packed for m in sent[3:])
        assert len(replied) == 9
        assert all(keys != [PACKED] for keys in replied[:3])
        assert all((keys == [PACKED]) == packed for keys in replied[3:])
    for key, array in results[False].items():
        assert np.array_equal(array.numpy(), results[True][key].numpy()), key

    grid = make_grid()

    def shorten(reply):
        if not is_train_from(reply, 102) or PACKED not in reply.content["arrays"]:
            return reply
        flat = reply.content["arrays"][PACKED].numpy()
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({PACKED: _arr(flat[:-1])}),
                    "metrics": reply.content["metrics"],
                }
            ),
            reply_to=_original(reply),
        )

    grid.intercept = shorten
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3)
    )
    assert start(strategy, grid, rounds=3).arrays is not None
    rejected = [
        {s.node for s in record.silos}
        for record in strategy.reporter.records
        if [f for f in record.failed if f.startswith("node-102: update rejected")]
    ]
    assert rejected == [{100, 101}]  # round 2's packed reply; round 3 went unpacked


def test_the_round_under_way_is_written_as_its_replies_arrive(tmp_path):
    """RoundReporter.progress gets each train round as it goes: sent to every silo,
    nobody replied right after the push, every silo once the replies are in (what the
    live page shows before the round's record); an evaluation does not overwrite it."""
    import json as json_module

    from fedlb.flower import RUN_FILES

    reporter = RoundReporter(tmp_path)
    calls = []
    written = reporter.progress

    def progress(server_round, sent, replied):
        calls.append((server_round, sorted(sent), sorted(replied)))
        written(server_round, sent, replied)

    reporter.progress = progress
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        balancing=Balancing(batch_size=16, local_steps=3),
        keeping=Keeping(reporter=reporter),
    )
    start(strategy, make_grid(), rounds=2)
    silos = ["silo-0", "silo-1", "silo-2"]
    nodes = ["node-100", "node-101", "node-102"]  # round 1: no silo has said its partition
    assert calls == [(1, nodes, []), (1, nodes, nodes), (2, silos, []), (2, silos, silos)]
    last = json_module.loads((tmp_path / RUN_FILES.progress).read_text())
    assert last["round"] == 2
    assert sorted(last["replied"]) == silos
    assert all(s >= 0 for s in last["replied"].values())
