"""The virtual-clock engine of the cluster schemes (fedlb/cluster/virtual*.py): its clock
follows each scheme's rule, the real tuner balances, the event order and staleness are
right, and a seed fixes the result. A tiny model on synthetic data: fast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedlb.cluster.virtual import VirtualCosts, VirtualData, VirtualJob, run_virtual

COSTS = VirtualCosts(iteration_s=0.01, allreduce_s=0.004, exchange_s=0.002)


@pytest.fixture(scope="module")
def data() -> VirtualData:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(600, 8, generator=generator)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return VirtualData(x[:500], y[:500], x[500:], y[500:])


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def job(speeds: tuple[float, ...], **kw: object) -> VirtualJob:
    settings: dict[str, object] = {"batch_size": 8, "max_seconds": 3.0, "costs": COSTS, "lr": 0.1}
    return VirtualJob(speeds, **(settings | kw))  # type: ignore[arg-type]


def test_bsp_iteration_is_the_slowest_worker_plus_fixed_costs(data):
    speeds = (100.0, 200.0, 400.0)
    result = run_virtual("bsp", job(speeds), model(), data)
    assert result.clock == "virtual"
    for entry in result.log:
        assert entry["sizes"] == [8, 8, 8]
        slowest = max(8 / v for v in speeds)
        assert entry["seconds"] == pytest.approx(slowest + COSTS.iteration_s + COSTS.allreduce_s)
    starts = [e["start"] for e in result.log]
    assert starts == pytest.approx([k * result.log[0]["seconds"] for k in range(len(starts))])
    assert result.samples == 24 * result.updates


def test_lb_ema_converges_to_sizes_proportional_to_speed(data):
    speeds = (100.0, 200.0, 300.0, 600.0)  # X = 48: the ideal split is 4, 8, 12, 24
    result = run_virtual("lb-ema", job(speeds, batch_size=12), model(), data)
    assert result.sizes == [4, 8, 12, 24]
    last = result.log[-1]
    assert sum(last["sizes"]) == 48
    # balanced: every worker computes for the same time; the tuner's exchange is charged
    assert max(last["compute_s"]) == pytest.approx(min(last["compute_s"]))
    assert last["seconds"] == pytest.approx(0.04 + 0.01 + 0.004 + 0.002)
    bsp = run_virtual("bsp", job(speeds, batch_size=12), model(), data)
    assert result.iteration_s < 0.8 * bsp.iteration_s


def test_asp_applies_gradients_in_arrival_order_with_their_staleness(data):
    speeds = (100.0, 250.0, 400.0)
    result = run_virtual("asp", job(speeds, max_seconds=1.0), model(), data)
    arrivals = [e["arrival"] for e in result.log]
    assert arrivals == sorted(arrivals)
    for k, entry in enumerate(result.log):  # the k-th push is applied as update k + 1
        assert entry["staleness"] == k - entry["read"]
        assert entry["arrival"] == pytest.approx(
            entry["start"] + 8 / speeds[entry["worker"]] + COSTS.iteration_s
        )
    # no barrier: a worker's iterations follow one another at its own pace
    fastest = [e for e in result.log if e["worker"] == 2]
    assert [e["start"] for e in fastest[1:]] == pytest.approx([e["arrival"] for e in fastest[:-1]])
    assert result.iterations[2] >= 2.5 * result.iterations[0]  # 0.09 s against 0.03 s
    assert max(e["staleness"] for e in result.log) >= 3


def test_ssp_blocks_a_worker_beyond_its_bound(data):
    speeds = (50.0, 1000.0)
    bound = 2
    result = run_virtual(f"ssp:{bound}", job(speeds, max_seconds=1.0), model(), data)
    clocks, lead = [0, 0], []
    for entry in result.log:
        clocks[entry["worker"]] += 1
        lead.append(clocks[1] - clocks[0])
    # a worker at clock c starts only while c - the slowest <= S: pushed, it leads by S + 1
    assert max(lead) == bound + 1
    asp = run_virtual("asp", job(speeds, max_seconds=1.0), model(), data)
    assert result.iterations[1] <= result.iterations[0] + bound + 1 < asp.iterations[1]


def test_backup_drops_the_slowest_gradients(data):
    speeds = (50.0, 200.0, 210.0, 220.0)
    result = run_virtual("backup:1", job(speeds, max_seconds=1.0), model(), data)
    slow = [e for e in result.log if e["worker"] == 0]
    assert slow
    assert all(e["dropped"] for e in slow)
    assert not any(e["dropped"] for e in result.log if e["worker"] != 0)
    assert result.samples == 24 * result.updates


def test_eager_solo_applies_every_gradient_once(data):
    speeds = (100.0, 300.0)
    result = run_virtual("eager-solo", job(speeds, max_seconds=1.0), model(), data)
    contributed = sum(len(e["contributors"]) for e in result.log)
    assert contributed == sum(result.iterations)
    assert min(len(e["contributors"]) for e in result.log) == 1


def test_orchestra_gives_faster_workers_more_local_steps(data):
    speeds = (100.0, 200.0, 400.0)
    result = run_virtual("orchestra:4", job(speeds, max_seconds=2.0), model(), data)
    assert result.log[0]["steps"] == [2, 2, 2]
    later = result.log[-1]["steps"]
    assert later[0] < later[1] < later[2]


def test_linear_lr_rule_scales_synchronous_updates_after_warmup(data):
    speeds = (100.0,) * 4
    same = run_virtual("bsp", job(speeds, max_seconds=0.2), model(), data)
    scaled = run_virtual(
        "bsp", job(speeds, max_seconds=0.2, lr_rule="linear", warmup=0), model(), data
    )
    asp = run_virtual("asp", job(speeds, max_seconds=0.2, lr_rule="linear"), model(), data)
    assert scaled.final_accuracy != same.final_accuracy
    same_asp = run_virtual("asp", job(speeds, max_seconds=0.2), model(), data)
    assert asp.curve == same_asp.curve  # an update over B samples keeps lr


def test_the_same_seed_gives_the_same_run_and_another_seed_another(data):
    speeds = (100.0, 150.0, 300.0)
    first = run_virtual("asp", job(speeds, load=0.3, seed=1), model(), data)
    again = run_virtual("asp", job(speeds, load=0.3, seed=1), model(), data)
    other = run_virtual("asp", job(speeds, load=0.3, seed=2), model(), data)
    assert first.summary() == again.summary()
    assert first.log == again.log
    assert first.log != other.log


def test_reaching_the_target_stops_the_run_and_is_recorded(data):
    result = run_virtual("bsp", job((200.0, 200.0), target=0.8, max_seconds=30.0), model(), data)
    assert result.time_to_target_s is not None
    first = next(point for point in result.curve if point[3] >= 0.8)
    assert result.time_to_target_s == first[0]
    assert result.samples_to_target == first[2]
    iteration = 8 / 200 + COSTS.iteration_s + COSTS.allreduce_s
    assert result.seconds <= result.time_to_target_s + iteration + 1e-9


def test_bad_settings_are_refused(data):
    with pytest.raises(ValueError, match="speeds"):
        VirtualJob((100.0, 0.0))
    with pytest.raises(ValueError, match="lr_rule"):
        VirtualJob((100.0,), lr_rule="sqrt")
    with pytest.raises(ValueError, match="backup"):
        run_virtual("backup:2", job((100.0, 100.0)), model(), data)
