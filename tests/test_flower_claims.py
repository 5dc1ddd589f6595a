"""What a silo claims about its data (its example count, FedAvg's weight) is bounded,
pinned and, where the operator asks, capped: one silo claiming 10^18 examples does not
take over the model (issue 51, item 1)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedlb.flower import Balancing, Joining, Keeping, LoadBalancedFedAvg
from fedlb.flower.claims import MOST_EXAMPLES, capped
from tests.strategy_helpers import is_train_from, make_grid, start, with_metrics

pytestmark = pytest.mark.usefixtures("task_identity")

NODES = (100, 101, 102)  # silo-0, silo-1, silo-2


def claiming(node: int, count: float, from_round: int = 1):
    """An interceptor: `node`'s train replies claim `count` examples from `from_round`."""
    seen = {"train": 0}

    def change(reply):
        if not is_train_from(reply, node):
            return reply
        seen["train"] += 1
        if seen["train"] < from_round:
            return reply
        return with_metrics(reply, **{"num-examples": count})

    return change


def run(tmp_path, intercept=None, rounds=3, **joining):
    grid = make_grid()
    grid.intercept = intercept
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        balancing=Balancing(batch_size=16, local_steps=3, guard=False),
        joining=Joining(**joining),
        keeping=Keeping(audit_dir=tmp_path / "audit"),
    )
    start(strategy, grid, rounds=rounds)
    return strategy


def audited(tmp_path, server_round: int) -> tuple[dict[int, float], np.ndarray, np.ndarray]:
    """(weight by node, the weighted average of the kept updates' first array as
    recomputed, the aggregate's) of a round's audit file."""
    with np.load(tmp_path / "audit" / f"round-{server_round}.npz") as saved:
        weights = {int(k.split("/")[1]): float(saved[k]) for k in saved if k.startswith("weight/")}
        key = next(k.split("/", 2)[2] for k in saved if k.startswith("update/"))
        total = sum(weights.values())
        average = sum(w * saved[f"update/{n}/{key}"] for n, w in weights.items()) / total
        return weights, average, saved[f"aggregate/{key}"]


def test_a_silo_claiming_ten_to_the_eighteen_is_left_out_and_said(tmp_path):
    strategy = run(tmp_path, claiming(101, 1e18))
    for number, record in enumerate(strategy.reporter.records, start=1):
        assert any(
            line.startswith("silo-1: left out of the average: num-examples is 1e+18, not a count")
            for line in record.failed
        ), record.failed
        weights, average, aggregate = audited(tmp_path, number)
        assert set(weights) == {100, 102}  # the honest silos' average, nothing of silo-1's
        np.testing.assert_allclose(aggregate, average, rtol=1e-5, atol=1e-7)
    first = strategy.reporter.records[0].events
    assert any(e.startswith("the silos claim num-examples: silo-0 ") for e in first), first


def test_a_dominant_claim_is_said_and_a_cap_bounds_its_share(tmp_path):
    said = run(tmp_path / "said", claiming(101, 10**9), rounds=1)
    events = " ".join(said.reporter.records[0].events)
    assert "silo-1 outweighs all other silos together: 100% of round 1's average" in events
    assert "Joining(max_share=0.5)" in events

    capped_run = run(tmp_path, claiming(101, 10**9), rounds=2, max_share=0.5)
    for number in (1, 2):
        weights, average, aggregate = audited(tmp_path, number)
        assert weights[101] / sum(weights.values()) == pytest.approx(0.5)
        assert weights[100] < 10**6
        assert weights[102] < 10**6
        np.testing.assert_allclose(aggregate, average, rtol=1e-5, atol=1e-7)
    assert "(50%, capped)" in " ".join(capped_run.reporter.records[0].events)


def test_a_changed_claim_is_refused_and_weighs_the_pinned_count(tmp_path):
    strategy = run(tmp_path, claiming(101, 5, from_round=2))
    weights_1, _, _ = audited(tmp_path, 1)
    for number in (2, 3):
        weights, average, aggregate = audited(tmp_path, number)
        assert weights[101] == weights_1[101] != 5  # its first claim holds
        np.testing.assert_allclose(aggregate, average, rtol=1e-5, atol=1e-7)
    second, third = strategy.reporter.records[1:]
    assert {s.node for s in second.silos} == set(NODES)  # its update and report still count
    assert any("silo-1 claims num-examples = 5, not the" in e for e in second.events)
    assert not any("claims num-examples" in e for e in third.events)  # said once
    assert strategy.state_dict()["examples"]["silo-1"] == weights_1[101]


def test_declared_counts_are_the_operators_word(tmp_path):
    strategy = run(tmp_path, rounds=2, examples={"silo-0": 7})
    for number in (1, 2):
        weights, _, _ = audited(tmp_path, number)
        assert weights[100] == 7
    events = " ".join(strategy.reporter.records[0].events)
    assert "silo-0 claims num-examples =" in events
    assert "not the 7 declared for it" in events


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="max_share must be"):
        Joining(max_share=0)
    with pytest.raises(ValueError, match="declared for silo-0 must be a whole number"):
        LoadBalancedFedAvg(joining=Joining(examples={"silo-0": -3}))
    with pytest.raises(ValueError, match="declared for silo-0 must be a whole number"):
        LoadBalancedFedAvg(joining=Joining(examples={"silo-0": MOST_EXAMPLES + 1}))


@given(
    st.lists(st.integers(0, 10**12), min_size=2, max_size=8),
    st.floats(0.05, 1.0),
)
def test_a_cap_holds_where_it_can_and_leaves_the_others_alone(counts, cap):
    by_node = dict(enumerate(counts))
    weights = capped(by_node, cap)
    total = sum(weights.values())
    assert all(0 <= weights[n] <= by_node[n] for n in by_node)
    if total > 0 and cap * len(counts) >= 1:
        assert max(weights.values()) / total <= cap + 1e-9
        lowered = [n for n in by_node if weights[n] < by_node[n]]
        for n in by_node:
            if n not in lowered:
                assert weights[n] == by_node[n]


def test_fedlb_servers_run_settings_declare_counts_and_cap_shares():
    """max-share and silo-examples (fedlb server --max-share / --silo-examples, or the
    app's run config) reach the strategy's claims."""
    from fedlb.deploy import RunConfig
    from fedlb.deploy.run_config import ConfigError
    from fedlb.deploy.server_app import build_strategy
    from fedlb.flower import RoundReporter

    config = RunConfig.from_mapping({"max-share": 0.4, "silo-examples": "silo-0=600, silo-2=9"})
    strategy = build_strategy(config, RoundReporter())
    assert strategy.claims.max_share == 0.4
    assert strategy.claims.pinned == {"silo-0": 600, "silo-2": 9}
    assert build_strategy(RunConfig(), RoundReporter()).claims.max_share is None
    with pytest.raises(ConfigError, match=r"silo-examples must list label=count pairs.*got 'x'"):
        RunConfig.from_mapping({"silo-examples": "silo-0=600,x"})
    with pytest.raises(ConfigError, match=r"max-share must be in \[0, 1\]"):
        RunConfig.from_mapping({"max-share": 1.5})
