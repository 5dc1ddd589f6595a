"""The second lever at the edge of stability: the slow silos' steps cut at their own batch
size (fedlb.balance.steps), the loader's round cap, the FedNova normalization before the
wrapped strategy (fedlb.flower.edge), and the drop-in on Flower's quickstart running it
after the guard's verdict."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from hypothesis import given
from hypothesis import strategies as st

from fedlb.balance import step_weights, steps_for_round
from fedlb.flower import Balancing, balance_mod, balanced_loader
from fedlb.flower.edge import edge_text, normalize_by_steps
from fedlb.flower.protocol import BATCH_SIZE, LOCAL_STEPS, PROTOCOL, ROUND_STEPS, Orders


def test_the_slow_silos_steps_are_cut_to_the_balanced_round():
    """4 : 2 : 1 at B 32 and 12 steps each: the batch-size balanced round at X = 96 takes
    T* = 96·12/700 s; at B 32 the fast silo keeps its 12 (never more), the others 10, 5."""
    speeds = {"a": 400.0, "b": 200.0, "c": 100.0}
    sizes = dict.fromkeys(speeds, 32)
    steps = steps_for_round(speeds, sizes, dict.fromkeys(speeds, 12))
    assert steps == {"a": 12, "b": 10, "c": 5}
    longest = max(steps[w] * sizes[w] / speeds[w] for w in speeds)
    assert longest <= 12 * 32 / 100 / 2  # under half of the uniform round


def test_a_fixed_cost_shortens_a_silos_steps_and_equal_silos_keep_theirs():
    speeds = {"a": 400.0, "b": 400.0}
    sizes = {"a": 32, "b": 32}
    assert steps_for_round(speeds, sizes, {"a": 12, "b": 12}) == {"a": 12, "b": 12}
    cut = steps_for_round(speeds, sizes, {"a": 12, "b": 12}, {"a": 0.0, "b": 0.5})
    assert cut["a"] == 12
    assert cut["b"] < 12


def test_a_silo_without_a_speed_keeps_its_steps():
    steps = steps_for_round({"a": 400.0}, {"a": 32, "b": 32}, {"a": 12, "b": 12})
    assert steps == {"a": 12, "b": 12}


@given(
    st.lists(st.floats(1.0, 1e4), min_size=2, max_size=8),
    st.integers(1, 64),
    st.integers(1, 200),
)
def test_planned_steps_stay_within_one_and_the_silos_own(speeds, batch, own):
    names = [f"w{i}" for i in range(len(speeds))]
    plan = steps_for_round(
        dict(zip(names, speeds, strict=True)),
        dict.fromkeys(names, batch),
        dict.fromkeys(names, own),
    )
    assert all(1 <= plan[n] <= own for n in names)
    fastest = names[speeds.index(max(speeds))]
    assert plan[fastest] == own


def test_step_weights_are_fednovas_and_one_at_equal_steps():
    factors = step_weights({"a": 12, "b": 10, "c": 5}, {"a": 1.0, "b": 1.0, "c": 2.0})
    effective = (12 + 10 + 2 * 5) / 4
    assert factors == pytest.approx({"a": effective / 12, "b": effective / 10, "c": effective / 5})
    assert step_weights({"a": 7, "b": 7}, {"a": 3.0, "b": 1.0}) == {"a": 1.0, "b": 1.0}


def _reply(node: int, weights: dict[str, np.ndarray], examples: int) -> Message:
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in weights.items()}),
            "metrics": MetricRecord({"num-examples": examples}),
        }
    )
    sent = Message(RecordDict(), dst_node_id=node, message_type="train")
    return Message(content, reply_to=sent)


@pytest.mark.usefixtures("task_identity")
def test_normalized_updates_average_to_fednovas_step():
    """Two silos, 4 and 2 steps, equal weights: averaged as FedAvg averages, the scaled
    updates give x + τ_eff·mean(d_i), d_i each silo's update per step; integer arrays and
    arrays the model was not sent in are left as they came."""
    x = np.zeros(3, dtype=np.float32)
    sent = ArrayRecord({"w": Array(x), "count": Array(np.array([5], dtype=np.int64))})
    one = _reply(1, {"w": np.full(3, 4.0, np.float32), "count": np.array([9])}, 10)
    two = _reply(2, {"w": np.full(3, 1.0, np.float32), "count": np.array([9])}, 10)
    normalize_by_steps([one, two], sent, {1: 4, 2: 2}, lambda m: 10.0)
    averaged = (one.content["arrays"]["w"].numpy() + two.content["arrays"]["w"].numpy()) / 2
    effective = 3.0  # (4 + 2) / 2
    assert averaged == pytest.approx(np.full(3, effective * (4 / 4 + 1 / 2) / 2))
    assert one.content["arrays"]["w"].numpy().dtype == np.float32
    assert one.content["arrays"]["count"].numpy().tolist() == [9]


def test_the_edge_is_said_with_sizes_and_steps():
    text = edge_text({"silo-0": 32, "silo-1": 32}, {"silo-1": 5, "silo-0": 12})
    assert text.startswith("at the edge: B kept at 32, τ 12/5 by speed (silo-0, silo-1)")


def test_orders_carry_the_round_cap_and_refuse_a_bad_one():
    config = Orders(server_round=3, round_steps=5).into(ConfigRecord())
    assert config[ROUND_STEPS] == 5
    assert Orders.read(config).round_steps == 5
    config[ROUND_STEPS] = 0
    with pytest.raises(ValueError, match=ROUND_STEPS):
        Orders.read(config)


def test_balancing_names_its_edge_levers():
    assert Balancing().edge == "steps"
    with pytest.raises(ValueError, match="edge must be one of steps, uniform"):
        Balancing(edge="lr")


@pytest.mark.usefixtures("task_identity")
def test_the_loader_stops_at_the_rounds_cap_and_says_it_in_len():
    """A cap of 5 steps over a loop of two passes of 10: 5 batches in all, at the
    loader's own batch size, len() 5 (one pass holds them), 5 steps reported."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(100.0).unsqueeze(1), torch.zeros(100, dtype=torch.long))
    loader = DataLoader(data, batch_size=10, shuffle=True)
    message = Message(
        RecordDict({"config": ConfigRecord({PROTOCOL: 1, ROUND_STEPS: 5})}),
        dst_node_id=1,
        message_type="train",
    )

    def handler(msg: Message, context: Context) -> Message:
        balanced = balanced_loader(msg, loader)
        assert len(balanced) == 5
        seen = [x for _ in range(2) for (x, _) in balanced]
        assert [len(x) for x in seen] == [10] * 5
        return Message(RecordDict({"metrics": MetricRecord({"own": 1})}), reply_to=msg)

    reply = balance_mod()(message, Context(1, 1, {"partition-id": 0}, RecordDict(), {}), handler)
    assert reply.content["metrics"][LOCAL_STEPS] == 5
    assert reply.content["metrics"][BATCH_SIZE] == 10


@pytest.mark.usefixtures("task_identity")
def test_the_quickstart_at_its_own_learning_rate_runs_the_steps_lever_at_the_edge(tmp_path):
    """Flower's quickstart with the three drop-in lines at its own η = 0.1 over 4 : 2 : 1
    (model clock, in-process): the guard finds the edge in round 2, and from round 3 every
    silo trains at B 32 with the slow ones' steps cut (12 / 10 / 5), rounds half as long
    as uniform ones; `Balancing(edge="uniform")` keeps 12 steps each."""
    from benchmarks.app_accuracy import run_once

    row = run_once("quickstart", "default", 0, 5, {}, [400.0, 200.0, 100.0])
    assert row["regime"] == "edge"
    assert row["sizes"][3] == {"silo-0": 32, "silo-1": 32, "silo-2": 32}
    assert row["steps"][3] == {"silo-0": 12, "silo-1": 10, "silo-2": 5}
    assert row["round_s"][3] <= row["round_s"][0] / 2
    assert all(math.isfinite(a) for a in row["accuracy_by_round"])  # accuracy: benchmarks/
    uniform = run_once("quickstart", "edge:uniform", 0, 4, {}, [400.0, 200.0, 100.0])
    assert uniform["steps"][3] == {"silo-0": 12, "silo-1": 12, "silo-2": 12}


def test_the_run_setting_picks_the_lever_and_refuses_an_unknown_one():
    from fedlb.deploy.run_config import ConfigError, RunConfig
    from fedlb.deploy.server_app import build_strategy
    from fedlb.flower import RoundReporter

    config = RunConfig.from_mapping({"guard-edge": "uniform"})
    config.check()
    assert build_strategy(config, RoundReporter()).balance.edge == "uniform"
    assert build_strategy(RunConfig(), RoundReporter()).balance.edge == "steps"
    with pytest.raises(ConfigError, match="guard-edge must be one of steps, uniform"):
        RunConfig.from_mapping({"guard-edge": "lr"}).check()


def test_a_capped_round_keeps_the_silos_own_steps_in_its_profile(tmp_path, monkeypatch):
    """A round the steps lever cut measures the silo's speed, not its own τ: the profile
    keeps the steps of its last full round (a next run plans its cuts from them), and a
    silo with no profile yet stores nothing from a capped round."""
    from fedlb.flower.profiles import SiloProfile, load_profile, record_round

    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path))
    machine = {"cpu": "test"}

    def measured(steps: int) -> SiloProfile:
        return SiloProfile(
            speed=100.0, overhead_s=0.1, batch_size=32, local_steps=steps, measured_at=time.time()
        )

    record_round("silo-2", "m", machine, 1, measured(5), capped=True)
    assert load_profile("silo-2", "m", machine) is None  # nothing to keep the own τ from
    record_round("silo-2", "m", machine, 1, measured(12))  # round 1: uncut
    record_round("silo-2", "m", machine, 1, measured(5), capped=True)
    kept = load_profile("silo-2", "m", machine)
    assert kept is not None
    assert (kept.local_steps, kept.rounds) == (12, 2)
    record_round("silo-2", "m", machine, 2, measured(5), capped=True)  # a next run, cut
    again = load_profile("silo-2", "m", machine)
    assert again is not None
    assert (again.local_steps, again.rounds, again.run_id) == (12, 1, 2)


def test_the_look_runs_only_where_the_steps_lever_can():
    """The look's round runs the steps lever: without it (`edge="uniform"`) the guard
    probes in round 2 as before; a user's own guard looks too, a fixed floor never."""
    from fedlb.balance import StabilityGuard
    from fedlb.flower import LoadBalancedFedAvg

    assert LoadBalancedFedAvg().guard.looking
    assert not LoadBalancedFedAvg(balancing=Balancing(edge="uniform")).guard.looking
    own = StabilityGuard(probe=0.2)
    assert LoadBalancedFedAvg(balancing=Balancing(guard=own)).guard is own
    assert own.looking
    assert own.floor == 1.0  # all of the mean batch while the look is due
    assert not LoadBalancedFedAvg(balancing=Balancing(guard=StabilityGuard(probe=0))).guard.looking
