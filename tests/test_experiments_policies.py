"""The policies an experiment compares, each run in-process on emulated silos: each does
what it says, a run that ended short of its target is flagged, variants refuse what they
cannot run."""

from __future__ import annotations

import pytest

from fedlb.experiments import EmulatedClock, SpeedProfile
from fedlb.flower import Balancing

SPEEDS = (400.0, 200.0, 100.0)  # samples/s of silos 0, 1, 2 on the model clock


def run_policy(policy, rounds=3):
    """One policy of `fedlb experiment` (POLICIES: its strategy class and arguments), run
    in-process on the model clock as the runner does, with three silos 1:2:4 slower."""
    from flwr.app import ArrayRecord

    from fedlb.deploy import RunConfig
    from fedlb.deploy.server_app import make_balancer
    from fedlb.deploy.task import federation_data, model_for
    from fedlb.experiments import POLICIES
    from tests.flower_fakes import InProcessGrid, fedlb_app, lr_config

    settings = {"num-silos": 3, "local-steps": 4, "batch-size": 16}
    config = RunConfig.from_mapping(settings)

    def clock(context):
        return EmulatedClock("model", SpeedProfile(SPEEDS[context.node_config["partition-id"]]))

    nodes = {100 + i: {"partition-id": i, "num-partitions": 3} for i in range(3)}
    grid = InProcessGrid(nodes, settings, fedlb_app(clock=clock, config=config))
    chosen = POLICIES[policy]
    balancer = make_balancer(RunConfig.from_mapping({**settings, "tuner": chosen.tuner}))
    strategy = chosen.strategy_class(
        min_available_nodes=3,
        evaluate_every=rounds,
        **chosen.strategy_args(),
        balancing=Balancing(batch_size=16, local_steps=4, balancer=balancer, guard=chosen.guard),
    )
    pool, _ = federation_data(config)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model_for(config, pool).state_dict()),
        num_rounds=rounds,
        timeout=30,
        train_config=lr_config(0.1),
    )
    sent: dict[int, dict[int, dict]] = {}
    for msg in grid.sent:
        if msg.metadata.message_type == "train":
            config_sent = dict(msg.content["config"])
            sent.setdefault(config_sent["server-round"], {})[msg.metadata.dst_node_id] = config_sent
    return strategy, [sent[k] for k in sorted(sent)]


def test_a_policy_whose_rounds_ended_short_of_the_target_and_the_clock_is_flagged():
    """A balanced policy's rounds are shorter: with the same number of rounds it can stop
    before the others' clock, so a target it missed says nothing of time to target."""
    from fedlb.cli.experiment import ended_early

    def row(clock, ttt, reached=None):
        out = {"total_clock_s": clock, "time_to_target_s": ttt}
        return out if reached is None else {**out, "reached_target": reached}

    summary = {
        "policies": {
            "fedavg": row(1.13, 0.9, "2/2"),
            "lb-floor": row(0.70, 0.57, "2/2"),
            "lb": row(0.46, None, "1/2"),  # short of the clock and of the target
            "lb-full": row(1.10, None, "0/2"),  # at the clock: its miss is its own
        }
    }
    (note,) = ended_early(summary, rounds=12)
    assert note.startswith("lb: its 12 rounds ended at 0.46 s of clock, before fedavg's 1.13")
    assert "--rounds 30" in note  # 12 x 1.13 / 0.46, rounded up
    one_seed = {"policies": {"fedavg": row(1.0, 0.8), "lb": row(0.5, None)}}
    assert ended_early(one_seed, rounds=10)[0].endswith("(--rounds 20)")
    assert ended_early({"policies": {"lb": row(0.5, 0.4)}}, rounds=10) == []


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize(
    "policy", ["fedavg", "lb", "lb-full", "lb-tau", "lb-lr", "deadband", "quorum"]
)
def test_each_policy_does_what_it_says(policy):
    from fedlb.flower.protocol import BATCH_SIZE, LEARNING_RATE, LOCAL_STEPS

    strategy, rounds = run_policy(policy)
    records = strategy.reporter.records
    assert [r.round for r in records] == [1, 2, 3]
    last = rounds[-1]
    sizes = {node: orders[BATCH_SIZE] for node, orders in last.items()}
    steps = {node: orders[LOCAL_STEPS] for node, orders in last.items()}
    rates = {node: orders[LEARNING_RATE] for node, orders in last.items()}
    assert set(last) == {100, 101, 102}  # every policy sends every silo work
    if policy in ("fedavg", "quorum"):
        assert set(sizes.values()) == {16}
        assert set(steps.values()) == {4}
    if policy == "quorum":  # the fastest ⌈3/2⌉ = 2 updates only
        assert all({s.node for s in r.silos} == {100, 101} for r in records)
    if policy in ("lb", "lb-full", "lb-lr"):  # B follows the speeds 4:2:1, τ stays
        assert sizes[100] > sizes[101] > sizes[102]
        assert sum(sizes.values()) == 48
        assert set(steps.values()) == {4}
    if policy == "lb-full":  # LB-BSP as published: fully balanced
        assert records[-1].efficiency > 0.95
    if policy in ("lb", "lb-lr"):  # the stability guard: round 2 its look (every silo at
        # its own B, the slow silos' steps cut), then no silo below half the mean B
        look = {s.node: (s.batch_size, s.local_steps) for s in records[1].silos}
        assert {b for b, _ in look.values()} == {16}
        assert look[100][1] == 4 > look[102][1]
        first = {s.node: s.batch_size for s in records[2].silos}  # the first balanced round
        assert min(first.values()) == 8
        assert records[2].efficiency == pytest.approx(7 / 8, abs=0.03)
        assert strategy.guard is not None
    if policy == "deadband":  # moves toward the speeds, X kept
        assert sizes[100] >= sizes[101] >= sizes[102]
        assert sum(sizes.values()) == 48
    if policy == "lb-tau":  # τ follows the speeds, B stays (Σ τ kept)
        assert set(sizes.values()) == {16}
        assert steps[100] > steps[101] > steps[102]
        assert sum(steps.values()) == 12
        assert records[-1].efficiency > 0.95
    if policy == "lb-lr":  # η_i = η · B_i / B0
        for node, rate in rates.items():
            assert rate == pytest.approx(0.1 * sizes[node] / 16)
    else:  # the app's learning rate reaches every silo untouched
        assert set(rates.values()) == {0.1}


def test_variants_refuse_what_they_cannot_run():
    from fedlb.experiments.variants import QuorumFedAvg, StepsTunedFedAvg

    with pytest.raises(ValueError, match="tuning τ needs batch_size and local_steps"):
        StepsTunedFedAvg(balancing=Balancing(local_steps=5))
    with pytest.raises(ValueError, match="quorum must be a fraction"):
        QuorumFedAvg(quorum=1.5)
