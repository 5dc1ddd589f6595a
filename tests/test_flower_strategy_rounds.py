"""LoadBalancedFedAvg driven in-process with Flower messages and fedlb's silo app (its
ClientApp with balance_mod, as fedlb's client_app builds it): a round's sizes, speeds,
evaluation, aggregation and metrics, the strategy's options, the packed model and the
round written as it runs."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedlb.deploy import RunConfig
from fedlb.flower import Balancing, Joining, Keeping, LoadBalancedFedAvg, RoundReporter
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
from tests.flower_fakes import lr_config
from tests.strategy_helpers import (
    BASE,
    _arr,
    _original,
    initial_arrays,
    is_train_from,
    make_grid,
    sent_sizes,
    start,
    static,
    train_messages,
)

pytestmark = pytest.mark.usefixtures("task_identity")


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
    # round 2 is the stability guard's look (every silo at its own B, the slow silos' steps
    # cut: whole steps of τ = 3 finish together only roughly); balanced from round 3
    late = [r for r in rows if r["round"] >= 3]
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
            assert silo.compute_s >= silo.local_steps * silo.batch_size / speed * 0.999
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


def test_a_static_balancer_is_plain_fedavg():
    grid = make_grid()
    fedavg = LoadBalancedFedAvg(
        min_available_nodes=3, balancing=Balancing(batch_size=16, local_steps=3, balancer=static)
    )
    start(fedavg, grid, rounds=2)
    assert set(fedavg.current_sizes().values()) == {16}
    assert sent_sizes(grid) == [{100: 16, 101: 16, 102: 16}] * 2


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
        if [f for f in record.failed if f.startswith("silo-2: update rejected")]
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
