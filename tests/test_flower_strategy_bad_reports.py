"""LoadBalancedFedAvg in-process with silos whose replies are damaged: a bad timing
report is dropped but its update used, a silo without a usable first report joins with
its next one (or runs its b0), and a malformed update is rejected while the server lives on."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message, RecordDict

from fedlb.flower import Balancing, LoadBalancedFedAvg
from fedlb.flower.protocol import BATCH_SIZE, COMPUTE_S, LOCAL_STEPS, OVERHEAD_S
from tests.strategy_helpers import (
    _arr,
    _original,
    is_train_from,
    make_grid,
    sent_sizes,
    start,
    with_metrics,
)

pytestmark = pytest.mark.usefixtures("task_identity")


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
        assert any(
            f.startswith("node-102: update rejected") for f in record.failed
        )  # never said its partition


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
        assert [f for f in record.failed if f.startswith("silo-2: update rejected")]
        assert {s.node for s in record.silos} == {100, 101}
    kept = sent_sizes(grid)[1][102]
    if any("NaN or infinite" in f for f in records[1].failed):
        # a blow-up before the guard's verdict puts the run at the edge: uniform sizes
        assert sent_sizes(grid)[2][102] == 16
        assert strategy.current_sizes()[102] == 16
        return
    assert sent_sizes(grid)[2][102] == kept  # no report from it: size kept
    assert strategy.current_sizes()[102] == kept
