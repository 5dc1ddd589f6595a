"""The asynchronous peers (FedBuff, FedCompass) driven in-process on the model clock:
their event order, what each server update applies, and the work they stop at."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fedlb.experiments.asynchronous import Arrival, FedBuff, FedCompass, staleness_weight
from fedlb.flower import Balancing, Joining
from fedlb.flower.protocol import SiloReport
from tests.strategy_helpers import BASE, make_grid, start

pytestmark = pytest.mark.usefixtures("task_identity")

FACTORS = (1, 2, 4)  # silo i is FACTORS[i] times slower than BASE samples/s
B0, TAU, ROUNDS = 16, 4, 3
OVERHEAD = 0.02  # the fixed seconds model_clock gives every silo


def grid_model_keys():
    from fedlb.deploy import RunConfig
    from tests.strategy_helpers import initial_arrays, run_config

    return initial_arrays(RunConfig.from_mapping(run_config())).keys()


def busy_s(silo) -> float:
    return silo.compute_s + silo.fixed_s


def run(strategy_class, **args):
    grid = make_grid(FACTORS, **{"local-steps": TAU, "batch-size": B0})
    strategy = strategy_class(
        min_available_nodes=3,
        balancing=Balancing(batch_size=B0, local_steps=TAU),
        joining=Joining(expected_silos=3),
        **args,
    )
    result = start(strategy, grid, rounds=ROUNDS)
    return strategy, result


TOLERANCE = 1e-3  # the events give send times to the millisecond


def arrivals(record):
    """(silo, arrival time) of each update a server update applied, from its events."""
    times = []
    for silo, event in zip(record.silos, record.events, strict=True):
        sent_at = float(event.split("sent at ")[1].split(" s")[0])
        times.append((silo.silo, sent_at + busy_s(silo)))
    return times


def test_staleness_weights_are_fedbuffs():
    assert staleness_weight(0) == 1.0
    assert staleness_weight(3) == pytest.approx(0.5)


def test_fedbuff_applies_k_updates_in_the_order_the_silos_deliver_them():
    strategy, result = run(FedBuff)
    records = strategy.reporter.records
    clock = 0.0
    last_arrival = 0.0
    for record in records:
        assert len(record.silos) == 2  # K = ⌈3/2⌉
        assert record.efficiency is None
        assert record.idle_fraction == 0.0
        clock += record.round_s
        for _, at in arrivals(record):
            assert at <= clock + TOLERANCE  # applied once it is in, not before
            assert at >= last_arrival - TOLERANCE  # events in time order
        last_arrival = max(at for _, at in arrivals(record))
        assert last_arrival == pytest.approx(clock, abs=TOLERANCE)  # the K-th triggers it
    # FedAvg's work: 3 silos x 3 rounds of τ steps, applied K updates of τ steps at a time
    assert len(records) == math.ceil(3 * ROUNDS / 2)
    assert sum(s.local_steps for r in records for s in r.silos) == len(records) * 2 * TAU
    # the fast silo delivers more often than the slow one: asynchronous FL's bias
    count = {
        label: sum(s.silo == label for r in records for s in r.silos)
        for label in ("silo-0", "silo-2")
    }
    assert count["silo-0"] > count["silo-2"]  # silo-0 is the fast one
    assert set(result.arrays.keys()) == set(grid_model_keys())


def test_fedbuff_moves_the_model_by_the_mean_of_staleness_weighted_deltas():
    strategy = FedBuff(balancing=Balancing(batch_size=B0, local_steps=TAU))
    base = {"w": torch.zeros(3)}
    older = {"w": torch.ones(3)}
    strategy.version = 2

    def arrival(version, values):
        content = RecordDict(
            {"arrays": ArrayRecord({"w": torch.tensor(values)}), "metrics": MetricRecord({})}
        )
        report = SiloReport(batch_size=B0, local_steps=TAU, compute_s=1.0, overhead_s=0.0)
        message = Message(content, dst_node_id=1, message_type="train")
        return Arrival(1.0, version, 0.0, 1, version, message, report)

    fresh = arrival(2, [1.0, 2.0, 3.0])  # from the current model: staleness 0
    stale = arrival(1, [3.0, 3.0, 3.0])  # from an older one: staleness 1, Δ = 2
    model = strategy._apply(base, [fresh, stale], {2: base, 1: older})
    expected = (torch.tensor([1.0, 2.0, 3.0]) + torch.full((3,), 2.0) / math.sqrt(2)) / 2
    assert torch.allclose(model["w"], expected)


def test_fedcompass_groups_silos_to_arrive_together():
    strategy, _ = run(FedCompass)
    records = strategy.reporter.records
    steps = [s.local_steps for r in records for s in r.silos]
    assert set(steps) <= set(range(TAU // 2, 2 * TAU + 1))
    assert len(set(steps)) > 1  # τ_i follow the speeds
    grouped = [r for r in records if len({s.silo for s in r.silos}) > 1]
    assert grouped, [r.events for r in records]
    for record in grouped:  # a group's members arrive within a step of each other
        times = [at for _, at in arrivals(record)]
        slowest_step = max(FACTORS) * B0 / BASE
        assert max(times) - min(times) <= slowest_step + TOLERANCE
    # the slow silo (silo-2) runs fewer steps than the fast one (silo-0)
    by_silo = {}
    for record in grouped:
        for s in record.silos:
            by_silo.setdefault(s.silo, []).append(s.local_steps)
    if "silo-0" in by_silo and "silo-2" in by_silo:
        assert min(by_silo["silo-0"]) >= max(by_silo["silo-2"])
    assert sum(steps) >= 3 * ROUNDS * TAU


def test_the_peers_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="needs batch_size and local_steps"):
        FedBuff()
    with pytest.raises(ValueError, match="buffer size K must be >= 1"):
        FedBuff(buffer_size=0, balancing=Balancing(batch_size=B0, local_steps=TAU))
    with pytest.raises(ValueError, match="τ_min <= τ_max"):
        FedCompass(min_steps=5, max_steps=2, balancing=Balancing(batch_size=B0, local_steps=4))
