"""LoadBalancedFedAvg with the StabilityGuard, in-process: a diverged (blown-up or NaN)
update is left out of the average and raises the floor, balance_mod reports how far an
update moved the model, the verdict is in every round record, the log and the summary."""

from __future__ import annotations

import math

import pytest

from fedlb.balance import StabilityGuard
from fedlb.flower import Balancing, Keeping, LoadBalancedFedAvg, RoundReporter
from fedlb.flower.protocol import NOTICE, PROTOCOL, UPDATE_NORM
from tests.balance_guard_helpers import EQUAL, OWN, UNEQUAL, judged, scaled
from tests.strategy_helpers import make_grid, sent_sizes, start, train_messages


def run_three_silos(grid, out, rounds, guard=True):
    """LoadBalancedFedAvg (B0 = 16, τ = 3) on `grid`'s three silos for `rounds` rounds."""
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        balancing=Balancing(batch_size=16, local_steps=3, guard=guard),
        keeping=Keeping(reporter=RoundReporter(out)),
    )
    start(strategy, grid, rounds=rounds)
    return strategy


@pytest.mark.usefixtures("task_identity")
def test_the_strategy_leaves_a_blown_up_update_out_and_raises_the_floor(tmp_path):
    grid = make_grid()  # silos at speeds 4:2:1 (model clock)

    def blow_up(reply):  # silo 101's update in round 3 reports a norm 100x its peers'
        metrics = reply.content.metric_records.get("metrics") if reply.has_content() else None
        blown = grid.trained == 3 and reply.metadata.src_node_id == 101
        if blown and metrics is not None and UPDATE_NORM in metrics:
            metrics[UPDATE_NORM] = float(metrics[UPDATE_NORM]) * 100
        return reply

    grid.intercept = blow_up
    strategy = run_three_silos(grid, tmp_path, rounds=4)
    records = strategy.reporter.records
    assert [len(r.failed) for r in records] == [0, 0, 1, 0]
    assert "silo-1: update diverged, left out of the average" in records[2].failed[0]
    sizes = sent_sizes(grid)
    assert sizes[1] == {100: 16, 101: 16, 102: 16}  # round 2: the look, every silo's own B
    assert records[1].guard == "undecided"  # calm: the probe next
    assert min(sizes[2].values()) == 8  # round 3: the probe at the floor, half of 16
    assert min(sizes[3].values()) == 16  # round 4: a blow-up before the verdict: the edge,
    assert strategy.guard is not None  # uniform sizes
    assert strategy.guard.floor == 1.0


@pytest.mark.usefixtures("task_identity")
def test_without_the_guard_sizes_are_fully_balanced(tmp_path):
    grid = make_grid()
    run_three_silos(grid, tmp_path, rounds=2, guard=False)
    assert sorted(sent_sizes(grid)[1].values()) == [7, 14, 27]


@pytest.mark.usefixtures("task_identity")
def test_balance_mod_reports_how_far_the_update_moved_the_model():
    import numpy as np
    import torch
    from flwr.app import (
        Array,
        ArrayRecord,
        ConfigRecord,
        Context,
        Message,
        MetricRecord,
        RecordDict,
    )
    from torch.utils.data import DataLoader, TensorDataset

    from fedlb.flower import balance_mod, balanced_loader

    def record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
        return ArrayRecord({k: Array(v) for k, v in arrays.items()})

    weights = {"w": np.ones((2, 3), np.float32), "steps": np.array([7], np.int64)}
    message = Message(
        RecordDict({"arrays": record(weights), "config": ConfigRecord({PROTOCOL: 1})}),
        dst_node_id=1,
        message_type="train",
    )
    loader = DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=4)

    def handler(msg: Message, context: Context) -> Message:
        for _ in balanced_loader(msg, loader):
            pass
        moved = {"w": weights["w"] + np.float32(0.5), "steps": np.array([9], np.int64)}
        content = RecordDict({"arrays": record(moved), "metrics": MetricRecord({})})
        return Message(content, reply_to=msg)

    reply = balance_mod()(message, Context(1, 1, {}, RecordDict(), {}), handler)
    # the float arrays only: 6 entries moved by 0.5 -> sqrt(6 * 0.25)
    assert reply.content["metrics"][UPDATE_NORM] == pytest.approx(math.sqrt(1.5))


@pytest.mark.usefixtures("task_identity")
def test_an_update_holding_nan_is_left_out_and_raises_the_floor(tmp_path):
    import numpy as np
    from flwr.app import Array, ArrayRecord

    grid = make_grid()

    def poison(reply):  # silo 102's update in round 3 (the probe: its batch shrank) holds NaN
        train = reply.metadata.message_type == "train" and reply.has_content()
        if train and grid.trained == 3 and reply.metadata.src_node_id == 102:
            name, record = next(iter(reply.content.array_records.items()))
            key = next(iter(record.keys()))
            bad = np.full_like(record[key].numpy(), np.nan)
            reply.content[name] = ArrayRecord(
                {k: Array(bad) if k == key else a for k, a in record.items()}
            )
        return reply

    grid.intercept = poison
    strategy = run_three_silos(grid, tmp_path, rounds=4)
    failed = strategy.reporter.records[2].failed
    assert len(failed) == 1
    assert "NaN or infinite" in failed[0]
    assert min(sent_sizes(grid)[3].values()) == 16  # the edge: uniform sizes
    # the silo is told with its next message (its console says it), once, and only it
    notices = {
        (m.content["config"]["server-round"], m.metadata.dst_node_id): m.content["config"][NOTICE]
        for m in train_messages(grid)
        if NOTICE in m.content["config"]
    }
    assert list(notices) == [(4, 102)], notices
    assert notices[4, 102].startswith("its update of round 3 was left out of the average: ")
    assert "NaN or infinite" in notices[4, 102]


def test_a_resumed_run_goes_on_at_the_floor_it_had_reached():
    guard = StabilityGuard()
    guard.resume_at(0.75)
    assert guard.floor == 0.75
    guard.resume_at(0.0)  # a run without the guard's floor: the lowest step
    assert guard.floor == 0.0


@pytest.mark.usefixtures("task_identity")
def test_the_verdict_is_in_every_round_record_and_the_summary(tmp_path, caplog):
    caplog.set_level("INFO")
    grid = make_grid()  # silos at speeds 4:2:1 (model clock)
    strategy = run_three_silos(grid, tmp_path, rounds=4)
    records = strategy.reporter.records
    assert records[0].guard == "undecided"
    assert records[0].guard_probe is None
    # round 2: the look, every silo at its own batch size (the slow silos' steps cut):
    # growth read, no dispersion; calm here, so the probe follows
    assert sent_sizes(grid)[1] == {100: 16, 101: 16, 102: 16}
    assert [m.content["config"].get("fedlb.round-steps") for m in train_messages(grid)[3:6]]
    assert (records[1].guard, records[1].guard_probe) == ("undecided", None)
    assert records[1].guard_growth == pytest.approx(0.93, abs=0.05)
    assert any(
        e.startswith("the stability guard looks at the app's own growth") for e in records[1].events
    )
    assert any(e.startswith("the stability guard's look: calm") for e in records[1].events)
    # round 3: the probe at the floor (scattered, not grown: a second look); round 4 decides
    assert min(sent_sizes(grid)[2].values()) == 8
    assert records[2].guard_probe is not None
    assert any("the stability guard's probe" in e for e in records[2].events)
    assert records[3].guard == "stable"
    assert "the stability guard's probe" in caplog.text
    summary = strategy.reporter.summary()
    # FedAvg's E at these speeds (4:2:1, uniform sizes): 7/12 of the fast silos' time idle
    assert summary["uniform_balance_efficiency"] == pytest.approx(7 / 16, abs=0.03)
    # the run says how a fixed number of rounds ends at stock's accuracy
    assert "rounds instead of 4" in caplog.text
    assert summary["stability"] == {
        "regime": "stable",
        "decided_in_round": 4,
        "overturned_in_round": None,
        "probe_dispersion": records[3].guard_probe,
        "probe_growth": records[1].guard_growth,  # the look's
        "probe_noise_exponent": records[3].guard_noise_exponent,
        "final_floor": 0.25,
        "remembered": None,
    }


def test_the_log_says_a_clearly_calm_probe_decided_without_a_confirming_round():
    from fedlb.balance import Verdict
    from fedlb.flower.stability import regime_text

    guard = StabilityGuard(clear=1.2)  # the shortcut, off by default
    verdict = judged(guard, [(OWN, EQUAL), (scaled(OWN, 0.95), UNEQUAL)])
    assert isinstance(verdict, Verdict)
    text = regime_text(verdict, guard)
    assert text.startswith("the stability guard's probe: clearly calm: stable")
    assert "grew 0.9x" in text or "grew 1.0x" in text
    assert "grown less than 1.2x, so no confirming round" in text
    assert "at least 25% of the mean batch" in text
    calm = judged(StabilityGuard(), [(OWN, EQUAL), (scaled(OWN, 1.5), UNEQUAL)])
    assert "must confirm it" in regime_text(calm, guard)


@pytest.mark.usefixtures("task_identity")
def test_the_strategy_leaves_a_lone_nan_silo_out_and_keeps_everyones_sizes(tmp_path):
    """The probe's case on the strategy: the fastest silo (the largest batch) sends NaN in
    rounds 1 and 2; it is left out and said, and the floor does not rise for everyone."""
    import numpy as np
    from flwr.app import Array, ArrayRecord

    grid = make_grid()

    def poison(reply):
        train = reply.metadata.message_type == "train" and reply.has_content()
        if train and grid.trained in (1, 2) and reply.metadata.src_node_id == 100:
            name, record = next(iter(reply.content.array_records.items()))
            reply.content[name] = ArrayRecord(
                {k: Array(np.full_like(a.numpy(), np.nan)) for k, a in record.items()}
            )
        return reply

    grid.intercept = poison
    strategy = run_three_silos(grid, tmp_path, rounds=3)
    records = strategy.reporter.records
    for record in records[:2]:
        assert any("blew up alone" in e for e in record.events), record.events
        assert any(f.startswith("node-100") for f in record.failed), record.failed  # no label: NaN
    assert strategy.guard is not None
    assert strategy.guard.floor == 0.25  # not raised: stable at the probe after a calm look
    assert len(set(sent_sizes(grid)[2].values())) > 1  # round 3 still balanced


@pytest.mark.usefixtures("task_identity")
def test_a_stable_verdict_that_collapses_on_trial_runs_the_steps_lever_next(tmp_path):
    """Stable by round 4 (these fake silos' probe is looked at again), every silo's step
    falls to 1/20 of the round before's in round 5 with its training loss back at its
    start: the edge after all, said in the log and the round's events, and round 6 runs
    every silo at its own batch size with the slow silos' steps cut."""
    from fedlb.flower.protocol import ROUND_STEPS, SERVER_ROUND, TRAIN_LOSS_NAMES

    grid = make_grid()

    def collapse(reply):  # round 5: steps 1/20 of round 4's, the loss back at its start
        metrics = reply.content.metric_records.get("metrics") if reply.has_content() else None
        if grid.trained == 5 and metrics is not None and UPDATE_NORM in metrics:
            metrics[UPDATE_NORM] = float(metrics[UPDATE_NORM]) / 20
            for name in TRAIN_LOSS_NAMES:
                if name in metrics:
                    metrics[name] = 2.3  # ln 10: ten digits guessed at random
        return reply

    grid.intercept = collapse
    strategy = run_three_silos(grid, tmp_path, rounds=6)
    records = strategy.reporter.records
    assert [r.guard for r in records[3:]] == ["stable", "edge", "edge"]
    fell = records[4].guard_growth
    assert fell is not None
    assert fell < 1 / 3
    assert any("at the edge of stability after all" in e for e in records[4].events)
    stability = strategy.reporter.summary()["stability"]
    assert (stability["regime"], stability["decided_in_round"]) == ("edge", 4)
    assert stability["overturned_in_round"] == 5
    sizes = sent_sizes(grid)
    assert len(set(sizes[4].values())) > 1  # round 5: still balanced
    assert set(sizes[5].values()) == {16}  # round 6: every silo at its own B0
    cut = {
        m.metadata.dst_node_id: m.content["config"].get(ROUND_STEPS)
        for m in train_messages(grid)
        if m.content["config"][SERVER_ROUND] == 6
    }
    assert cut[100] == 3  # the fastest runs all its steps
    assert cut[102] is not None
    assert cut[102] < 3  # the slowest cut
