"""LoadBalancedFedAvg in-process: which silos take part in a round. A silo that
vanishes, misses a round or is far too slow is left out (and rejoins, or is told to
leave); one partition has one vote; a quorum keeps the fastest silos."""

from __future__ import annotations

import pytest

from fedlb.balance import BatchSizeManager, Proportional
from fedlb.deploy import RunConfig
from fedlb.experiments.variants import QuorumFedAvg
from fedlb.flower import Balancing, Joining, LoadBalancedFedAvg
from tests.flower_fakes import lr_config
from tests.strategy_helpers import initial_arrays, make_grid, sent_sizes, start, static

pytestmark = pytest.mark.usefixtures("task_identity")


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
    assert sizes[1] == {100: 16, 101: 16, 102: 16}  # round 2: the guard's look (own B)
    assert sizes[2][100] > sizes[2][101] > sizes[2][102]  # balanced from round 3
    assert set(sizes[2]) == {100, 101, 102}  # round 3: sent, no reply
    assert any("silo-2: no reply" in f for f in records[2].failed)  # its label (issue 56)
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
        assert any("silo-2: not among the quorum" in f for f in record.failed)
    with pytest.raises(ValueError, match="quorum must be a fraction"):
        QuorumFedAvg(quorum=0.0)


def test_a_silo_slower_than_its_emulated_speed_is_said_once():
    """One machine standing in for many pads a step only up to its real time: a silo
    emulating 400 samples/s that ran at 100 (its steps unpadded) is named, once, with both
    speeds; one that kept up, or one on the model clock (nothing padded), is not."""
    from fedlb.flower.membership import Membership
    from fedlb.flower.protocol import SiloReport

    members = Membership(expected=3, join_timeout=1.0, rejoin_grace=0.0)
    members.name(7, 2)
    slow = SiloReport(
        batch_size=32, local_steps=10, compute_s=3.2, overhead_s=0.0, emulated_speed=400.0
    )  # 320 samples in 3.2 s: 100/s
    kept_up = SiloReport(
        batch_size=32, local_steps=10, compute_s=0.82, overhead_s=0.0, emulated_speed=400.0
    )
    model = SiloReport(
        batch_size=32,
        local_steps=10,
        compute_s=3.2,
        overhead_s=0.0,
        emulated_speed=400.0,
        model_clock=True,
    )
    members.warn_below_emulation({7: slow, 8: kept_up, 9: model})
    assert members.take_events() == [
        "silo-2 ran at 100 samples/s, below its emulated 400: this machine's real compute is "
        "slower than the emulation (its steps ran unpadded), so its batch size follows the "
        "speed it ran; emulate fewer silos per machine, or lower speeds"
    ]
    members.warn_below_emulation({7: slow})
    assert members.take_events() == []  # once
