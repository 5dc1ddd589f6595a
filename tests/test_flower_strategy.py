"""LoadBalancedFedAvg driven in-process with Flower messages and fedlb's silo handlers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedlb.balance import Static
from fedlb.flower import LoadBalancedFedAvg, RoundReporter, RunConfig
from fedlb.flower.task import federation_data, model_for
from tests.flower_fakes import InProcessGrid, lr_config

pytestmark = pytest.mark.usefixtures("task_identity")

BASE = 500.0  # samples/s of an emulated factor-1 silo (well above what real compute needs)


def run_config(**overrides):
    values = {"num-silos": 3, "local-steps": 3, "batch-size": 16, "evaluate-every": 2}
    values.update(overrides)
    return values


def make_grid(factors=(1, 2, 4), **overrides):
    nodes = {
        100 + i: {"partition-id": i, "num-partitions": len(factors), "emulated-speed": BASE / f}
        for i, f in enumerate(factors)
    }
    return InProcessGrid(nodes, run_config(**overrides))


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


def test_each_silo_gets_its_own_size_and_sizes_follow_the_speeds(tmp_path):
    grid = make_grid()
    strategy = LoadBalancedFedAvg(
        batch_size=16,
        local_steps=3,
        min_available_nodes=3,
        evaluate_every=2,
        reporter=RoundReporter(tmp_path),
    )
    start(strategy, grid, rounds=4)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(train) == 12
    # a new RecordDict and ConfigRecord for every message
    assert len({id(m.content) for m in train}) == 12
    assert len({id(m.content["config"]) for m in train}) == 12
    by_round = {}
    for m in train:
        by_round.setdefault(m.content["config"]["server-round"], {})[m.metadata.dst_node_id] = (
            m.content["config"]["batch-size"]
        )
    assert by_round[1] == {100: 16, 101: 16, 102: 16}
    for sizes in by_round.values():
        assert sum(sizes.values()) == 48
    last = by_round[4]
    assert last[100] > last[101] > last[102]
    assert last[100] / last[102] == pytest.approx(4, rel=0.3)
    assert all(m.content["config"]["local-steps"] == 3 for m in train)
    assert all(m.content["config"]["learning-rate"] == 0.1 for m in train)
    # evaluation only every 2 rounds (and after the last)
    evaluated = sorted(
        {
            m.content["config"]["server-round"]
            for m in grid.sent
            if m.metadata.message_type == "evaluate"
        }
    )
    assert evaluated == [2, 4]
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    assert {r["clock"] for r in rows} == {"measured (emulated speeds)"}
    late = [r for r in rows if r["round"] >= 3]
    assert min(r["efficiency"] for r in late) > 0.85
    assert all(r["accuracy"] is not None for r in rows if r["round"] in (2, 4))


def test_evaluation_rides_on_the_next_train_message(tmp_path):
    grid = make_grid()
    strategy = LoadBalancedFedAvg(
        batch_size=16,
        local_steps=3,
        min_available_nodes=3,
        evaluate_every=1,
        evaluate_with_train=True,
        reporter=RoundReporter(tmp_path),
    )
    start(strategy, grid, rounds=4)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    flagged = {
        m.content["config"]["server-round"]
        for m in train
        if m.content["config"].get("evaluate") is True
    }
    assert flagged == {2, 3, 4}  # round r's train messages evaluate the model of round r-1
    evaluated = {
        m.content["config"]["server-round"]
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
    strategy = LoadBalancedFedAvg(batch_size=16, local_steps=3, min_available_nodes=3)
    config = RunConfig.from_mapping(grid.run_config)
    arrays = initial_arrays(config)
    messages = strategy.configure_train(1, arrays, ConfigRecord(), grid)
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
    assert metrics["train-loss"] > 0


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


def sent_sizes(grid):
    """[{node: B} of round 1, of round 2, ...]"""
    by_round: dict[int, dict[int, int]] = {}
    for msg in grid.sent:
        if msg.metadata.message_type == "train":
            config = msg.content["config"]
            by_round.setdefault(config["server-round"], {})[msg.metadata.dst_node_id] = config[
                "batch-size"
            ]
    return [by_round[k] for k in sorted(by_round)]


def test_a_silo_that_vanishes_is_left_out_and_rejoins_with_a_fair_share(caplog):
    grid = make_grid()
    strategy = LoadBalancedFedAvg(batch_size=16, local_steps=3, min_available_nodes=3)

    def kill_102(g):  # SIGKILL: it stops answering, the SuperLink still lists it a while
        g.drop = {102}

    def superlink_lets_go_and_it_restarts_as_103(g):
        info = g.nodes.pop(102)
        g.drop = set()
        g.nodes[103] = info

    with caplog.at_level("INFO", logger="fedlb.flower"):
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
    assert sum(sizes[3].values()) == 48
    # it comes back (a new node id without a silo key): a fair share, a fresh estimate
    assert set(sizes[4]) == {100, 101, 103}
    assert sizes[4][103] == 48 // 3
    assert sum(sizes[4].values()) == 48
    assert any("joined with a fair share B = 16" in e for e in records[4].events)
    assert sizes[6][100] > sizes[6][101] > sizes[6][103]  # balanced again
    assert strategy.manager.estimators["103"].observations == 3  # rounds 5-7 only
    assert records[6].efficiency > 0.85
    assert "X = 48 re-divided" in caplog.text


def test_a_silo_that_missed_a_round_but_stays_connected_is_tried_again():
    grid = make_grid()
    strategy = LoadBalancedFedAvg(
        batch_size=16, local_steps=3, min_available_nodes=3, rejoin_grace=0.0
    )

    def stall_102(g):
        g.drop = {102}

    def recover(g):
        g.drop = set()

    records, grid = run_rounds(strategy, grid, {2: stall_102, 3: recover}, 4)
    sizes = sent_sizes(grid)
    assert set(sizes[2]) == {100, 101, 102}  # grace 0: tried again at once
    assert sizes[2][102] == 16  # with a fair share
    assert any("tried again" in e for e in records[2].events)
    assert strategy.manager.estimators["102"].observations == 2  # restarted at round 3


@pytest.mark.timeout(60)
def test_when_every_silo_is_left_out_the_server_waits_out_the_grace():
    grid = make_grid(factors=(1,))
    strategy = LoadBalancedFedAvg(
        batch_size=16, local_steps=3, min_available_nodes=1, rejoin_grace=1.0
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
    from fedlb.balance import Proportional

    grid = make_grid(factors=(1, 1, 30))  # its share of X = 48 would be < 1 sample
    strategy = LoadBalancedFedAvg(
        batch_size=16, local_steps=3, min_available_nodes=3, tuner=Proportional(min_batch=4)
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
        ({"compute-s": math.nan}, "not finite numbers"),
        ({"compute-s": -1.0}, "compute_s must be > 0"),
        ({"overhead-s": None}, "missing metric(s) overhead-s"),
        ({"batch-size": 999}, "is not the"),
    ],
)
def test_a_bad_report_is_dropped_but_its_update_is_used(changes, reason, caplog):
    grid = make_grid()
    grid.intercept = lambda r: with_metrics(r, **changes) if is_train_from(r, 101) else r
    strategy = LoadBalancedFedAvg(batch_size=16, local_steps=3, min_available_nodes=3)
    with caplog.at_level("WARNING", logger="fedlb.flower"):
        start(strategy, grid, rounds=1)
    record = strategy.reporter.records[-1]
    assert any(reason in r for r in record.rejected), record.rejected
    assert {s.node for s in record.silos} == {100, 101, 102}  # its update still counted
    assert strategy.current_sizes()[101] == 16
    assert "dropped" in caplog.text


def test_a_silo_whose_dataset_size_changes_has_that_report_dropped(caplog):
    grid = make_grid()
    seen = []

    def grow(reply):
        if not is_train_from(reply, 101):
            return reply
        seen.append(1)
        if len(seen) < 2:
            return reply
        return with_metrics(reply, **{"num-examples": reply.content["metrics"]["num-examples"] + 5})

    grid.intercept = grow
    strategy = LoadBalancedFedAvg(batch_size=16, local_steps=3, min_available_nodes=3)
    with caplog.at_level("WARNING", logger="fedlb.flower"):
        start(strategy, grid, rounds=3)
    second, third = strategy.reporter.records[1:]
    assert any("num-examples changed from" in r for r in second.rejected), second.rejected
    assert {s.node for s in second.silos} == {100, 101, 102}  # its update still counted
    assert not third.rejected  # said once: the new size holds from then on


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

    def corrupt(reply):
        if not is_train_from(reply, 102):
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
    strategy = LoadBalancedFedAvg(batch_size=16, local_steps=3, min_available_nodes=3)
    result = start(strategy, grid, rounds=2)
    assert result.arrays is not None
    record = strategy.reporter.records[-1]
    assert any(f.startswith("node-102") for f in record.failed)
    assert strategy.current_sizes()[102] == 16  # no report from it: size kept


def _arr(value):
    from flwr.app import Array

    return Array(np.asarray(value))


def test_static_tuner_is_plain_fedavg_and_probe_sizes_round_one():
    grid = make_grid()
    fedavg = LoadBalancedFedAvg(batch_size=16, local_steps=3, min_available_nodes=3, tuner=Static())
    start(fedavg, grid, rounds=2)
    assert set(fedavg.current_sizes().values()) == {16}
    grid = make_grid()
    probed = LoadBalancedFedAvg(batch_size=16, local_steps=3, min_available_nodes=3, probe_steps=2)
    start(probed, grid, rounds=1)
    first = [
        m
        for m in grid.sent
        if m.metadata.message_type == "train" and m.content["config"]["server-round"] == 1
    ]
    sizes = {m.metadata.dst_node_id: m.content["config"]["batch-size"] for m in first}
    assert sizes[100] > sizes[102]  # round 1 already balanced by the probe
    assert probed.reporter.records[0].round == 0


def test_a_silo_with_its_own_data_file(tmp_path):
    from fedlb.data import load_digits

    digits = load_digits()
    own = tmp_path / "hospital.npz"
    np.savez(own, x=digits.x[:200], y=digits.y[:200])
    grid = make_grid()
    grid.nodes[102] = {"data-path": str(own), "emulated-speed": BASE / 4}
    strategy = LoadBalancedFedAvg(batch_size=16, local_steps=3, min_available_nodes=3)
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
    strategy = LoadBalancedFedAvg(batch_size=16, local_steps=3, min_available_nodes=3)
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
    strategy = LoadBalancedFedAvg(batch_size=8, local_steps=3, min_available_nodes=4)
    start(strategy, grid, rounds=2)
    record = strategy.reporter.records[-1]
    assert not record.failed
    # 160 patients, 20% held out for the server, each hospital's rest split 80/20
    examples = [s.num_examples for s in record.silos]
    assert len(examples) == 4
    assert all(20 <= n <= 32 for n in examples)


def test_quorum_keeps_the_fastest_two_of_three():
    grid = make_grid()
    strategy = LoadBalancedFedAvg(
        batch_size=16, local_steps=3, min_available_nodes=3, tuner=Static(), quorum=0.6
    )
    start(strategy, grid, rounds=2)
    for record in strategy.reporter.records:
        assert {s.node for s in record.silos} == {100, 101}  # 102 is 4x slower
        assert any("node-102: not among the quorum" in f for f in record.failed)
