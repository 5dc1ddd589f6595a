"""One odd reply must not end a federation (issue 56, items 1, 2 and 3), in-process with
Flower's own FedAvg aggregating: a silo whose train reply adds a metric key, leaves
`train_loss` out or sends it as a list (each made FedAvg raise and the run fail), whose
ClientApp raises with terminal escapes in its message, or names a metric with them; and a
silo whose claimed weight outweighs all the others together. The same on real
processes: tests/test_deploy_odd_replies.py."""

from __future__ import annotations

import re

import pytest
from flwr.app import Error, Message
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy import FedAvg

from fedlb._markup import visible
from fedlb.flower import Balancing, Joining, LoadBalancedFedAvg
from tests.strategy_helpers import _original, is_train_from, make_grid, start, with_metrics

pytestmark = pytest.mark.usefixtures("task_identity")

LOSS = "train-loss"  # fedlb's own ClientApp's name for it (the quickstart's: train_loss)
ESCAPES = "\x1b[31mred\x1b]8;;http://evil.example\x07link\x1b]8;;\x07\x9b2J"


def from_round(node: int, first: int, change, last: int | None = None):
    """An interceptor: `change` applied to `node`'s train replies of rounds first..last."""
    seen = {"train": 0}

    def intercept(reply):
        if not is_train_from(reply, node):
            return reply
        seen["train"] += 1
        if seen["train"] < first or (last is not None and seen["train"] > last):
            return reply
        return change(reply)

    return intercept


def run(intercept, rounds=3, strategy_class=LoadBalancedFedAvg, **joining):
    grid = make_grid()
    grid.intercept = intercept
    strategy = strategy_class(
        min_available_nodes=3,
        balancing=Balancing(batch_size=16, local_steps=3, guard=False),
        joining=Joining(**joining),
    )
    result = start(strategy, grid, rounds=rounds)
    return strategy, result


def lines(strategy) -> str:
    records = strategy.reporter.records
    return "\n".join(line for r in records for line in (*r.failed, *r.events, *r.rejected))


def test_stock_fedavg_raises_on_the_same_replies():
    """The failure fedlb guards against, for the record: Flower's own FedAvg given one
    reply with an extra key."""
    grid = make_grid()
    grid.intercept = from_round(101, 1, lambda r: with_metrics(r, extra=1.0))
    with pytest.raises(InconsistentMessageReplies):
        start(FedAvg(min_available_nodes=3, fraction_evaluate=0.0), grid, rounds=1)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"extra": 1.0}, "silo-1: metric 'extra' dropped from its reply: its peers send no such"),
        ({LOSS: None}, f"silo-1: left out of the average: its metrics lack '{LOSS}'"),
        (
            {LOSS: [1.0, 2.0]},
            f"silo-1: left out of the average: its metric '{LOSS}' is a list of 2 numbers, "
            "its peers' a number",
        ),
        (
            {ESCAPES: 1.0},
            f"silo-1: metric '{visible(ESCAPES)}' dropped from its reply",
        ),
    ],
)
def test_a_reply_unlike_its_peers_is_trimmed_or_left_out_and_the_run_goes_on(change, said):
    strategy, result = run(from_round(101, 2, lambda r: with_metrics(r, **change), last=2))
    records = strategy.reporter.records
    assert [r.round for r in records] == [1, 2, 3]
    assert all(r.silos for r in records)
    assert said in lines(strategy), lines(strategy)
    kept = {s.silo for s in records[1].silos}
    assert kept == ({"silo-0", "silo-1", "silo-2"} if "dropped" in said else {"silo-0", "silo-2"})
    assert {s.silo for s in records[2].silos} == {"silo-0", "silo-1", "silo-2"}  # back in
    metrics = result.train_metrics_clientapp[2]
    assert LOSS in metrics
    assert "extra" not in metrics
    assert ESCAPES not in metrics
    assert "\x1b" not in lines(strategy)
    assert "\x9b" not in lines(strategy)


def test_two_silos_that_disagree_keep_what_the_run_agreed_before():
    """A tie (one of two silos adds a key in round 2): the keys agreed in round 1 decide."""
    grid = make_grid(factors=(1, 2), **{"num-silos": 2})
    grid.intercept = from_round(101, 2, lambda r: with_metrics(r, extra=1.0))
    strategy = LoadBalancedFedAvg(
        min_available_nodes=2, balancing=Balancing(batch_size=16, local_steps=3, guard=False)
    )
    start(strategy, grid, rounds=2)
    second = strategy.reporter.records[1]
    assert {s.silo for s in second.silos} == {"silo-0", "silo-1"}
    assert any("silo-1: metric 'extra' dropped" in e for e in second.events), second.events


def test_an_error_with_terminal_escapes_is_written_out_before_anything_logs_it(caplog):
    """A ClientApp that raised with ESC / OSC 8 / CSI in its message: the round goes on
    without it, and the reason reaches the round record, fedlb's log and FedAvg's own
    log line with its control characters written out."""

    def crashed(reply):
        return Message(Error(code=0, reason=f"ValueError: {ESCAPES}"), reply_to=_original(reply))

    with caplog.at_level("INFO", logger="flwr"):
        strategy, _ = run(from_round(101, 2, crashed, last=2))
    second = strategy.reporter.records[1]
    assert [line.split(": ", 1)[1] for line in second.failed] == [f"ValueError: {visible(ESCAPES)}"]
    logged = caplog.text
    assert "Received error in reply from node 101: ValueError: \\x1b[31mred" in logged
    assert "\x1b" not in logged
    assert "\x9b" not in logged
    assert "\x07" not in logged


def test_a_silo_that_outweighs_the_others_together_is_named_every_round():
    """9.97x the median weighs 83% and was not named; now every round says it, until a
    cap (or its declared count) is the operator's word."""
    count = 997  # the quickstart-like silos here hold 100 and 106 examples or so
    strategy, _ = run(from_round(101, 1, lambda r: with_metrics(r, **{"num-examples": count})))
    for record in strategy.reporter.records:
        said = [e for e in record.events if "outweighs all other silos together" in e]
        assert len(said) == 1, record.events
        assert said[0].startswith("silo-1 outweighs all other silos together: ")
        assert f"of round {record.round}'s average" in said[0]
        assert "--max-share" in said[0]
        assert "--silo-examples" in said[0]
    capped, _ = run(
        from_round(101, 1, lambda r: with_metrics(r, **{"num-examples": count})), max_share=0.5
    )
    assert "outweighs" not in lines(capped)
    declared, _ = run(
        from_round(101, 1, lambda r: with_metrics(r, **{"num-examples": count})),
        examples={"silo-1": count},
    )
    assert "outweighs" not in lines(declared)


def test_a_failed_reply_names_the_silo_by_its_label():
    """Issue 56, item 7: rejection lines named node-101 where the silo had said it is
    silo-1 (its label from round 1 on)."""

    def crashed(reply):
        return Message(Error(code=0, reason="ValueError: no"), reply_to=_original(reply))

    strategy, _ = run(from_round(101, 2, crashed, last=2))
    assert strategy.reporter.records[1].failed == ["silo-1: ValueError: no"]


def test_an_evaluation_reply_unlike_its_peers_is_trimmed_and_the_run_goes_on(caplog):
    """Flower's aggregate_evaluate checks replies as aggregate_train does: one silo's
    extra key in its evaluation reply made it raise at the end of the round."""

    def extra(reply):
        if reply.metadata.src_node_id == 101 and reply.metadata.message_type == "evaluate":
            reply.content["metrics"]["extra"] = 1.0
        return reply

    with caplog.at_level("WARNING", logger="flwr"):
        strategy, result = run(extra, rounds=2)
    assert [r.round for r in strategy.reporter.records] == [1, 2]
    assert re.search(r"evaluation from silo-1: metric 'extra' dropped", caplog.text)
    assert all("extra" not in m for m in result.evaluate_metrics_clientapp.values())
