"""The GPU path: device placement, honest timing, backend choice, memory readings.

Everything that decides something is tested here on the CPU (with CUDA's few calls faked
where a decision depends on them). The tests marked `cuda` run the real thing and are
skipped, saying why, on a machine without a GPU (CI's).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, namedtuple
from typing import ClassVar

import pytest
import torch
from torch import nn

from fedlb.cluster import exchange_backend
from fedlb.deploy.silo_app import SiloConfigError, node_settings
from fedlb.experiments import ClusterScenario, ClusterScenarioError
from fedlb.training import (
    ComputeTimer,
    DeviceError,
    accelerator_memory,
    choose_device,
    process_group_backend,
    to_device,
)

cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"
)
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL between ranks needs two GPUs; fewer here"
)


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch sees `count` GPUs (only the calls placement makes are faked)."""

    def install(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return install


# ---- placement ------------------------------------------------------------------------


def test_auto_is_the_cpu_without_a_gpu(fake_gpus):
    fake_gpus(0)
    assert choose_device("auto") == torch.device("cpu")
    assert choose_device("cpu") == torch.device("cpu")


def test_asking_for_a_gpu_that_is_not_there_says_what_to_do(fake_gpus):
    fake_gpus(0)
    with pytest.raises(DeviceError, match=r"torch sees none.*use --device cpu or auto"):
        choose_device("cuda")
    fake_gpus(2)
    with pytest.raises(DeviceError, match=r"GPUs 0\.\.1"):
        choose_device("cuda:2")
    with pytest.raises(DeviceError, match="auto, cpu, cuda or cuda:N"):
        choose_device("gpu")


def test_ranks_spread_over_the_gpus_by_local_rank(fake_gpus, monkeypatch):
    fake_gpus(2)
    assert [choose_device("auto", r) for r in range(4)] == [
        torch.device("cuda", i) for i in (0, 1, 0, 1)
    ]
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert choose_device("cuda") == torch.device("cuda", 1)
    assert choose_device("cuda:0") == torch.device("cuda", 0)


def test_gradients_go_on_nccl_only_with_a_gpu_per_rank_and_the_exchange_on_gloo():
    assert process_group_backend(torch.device("cpu")) == "gloo"
    assert process_group_backend(torch.device("cuda", 0)) == "nccl"
    assert process_group_backend(torch.device("cuda", 0), ranks_per_gpu=2) == "gloo"
    # The coordinator's exchange: its own gloo group unless the job's is gloo and blocking.
    assert exchange_backend("nccl", asynchronous=False) == "gloo"
    assert exchange_backend("nccl", asynchronous=True) == "gloo"
    assert exchange_backend("gloo", asynchronous=True) == "gloo"
    assert exchange_backend("gloo", asynchronous=False) is None


def test_cluster_scenarios_refuse_placements_that_cannot_run(fake_gpus):
    fake_gpus(0)
    with pytest.raises(ClusterScenarioError, match="nccl needs GPUs"):
        ClusterScenario.from_mapping({"backend": "nccl"})
    with pytest.raises(ClusterScenarioError, match="torch sees none"):
        ClusterScenario.from_mapping({"device": "cuda"})
    with pytest.raises(ClusterScenarioError, match="backend must be auto, gloo or nccl"):
        ClusterScenario.from_mapping({"backend": "mpi"})
    assert ClusterScenario.from_mapping({}).placement() == (torch.device("cpu"), "gloo")
    fake_gpus(1)
    with pytest.raises(ClusterScenarioError, match="a GPU per rank: 4 ranks, 1 GPU"):
        ClusterScenario.from_mapping({"backend": "nccl", "nproc": 4})
    # auto: 4 ranks share the one GPU, so gradients go over gloo; 1 rank gets NCCL
    assert ClusterScenario.from_mapping({"nproc": 4}).placement(3) == (
        torch.device("cuda", 0),
        "gloo",
    )
    one = ClusterScenario.from_mapping({"nproc": 1, "speeds": "1"})
    assert one.placement() == (torch.device("cuda", 0), "nccl")


def test_a_silo_asking_for_a_missing_gpu_is_refused_before_any_round(fake_gpus):
    fake_gpus(0)
    base = {"partition-id": 0, "num-partitions": 2}
    assert node_settings(base).device == "auto"
    assert node_settings({**base, "device": "cpu"}).device == "cpu"
    with pytest.raises(SiloConfigError, match=r"node config device: .*torch sees none"):
        node_settings({**base, "device": "cuda"})
    with pytest.raises(SiloConfigError, match="must be a string"):
        node_settings({**base, "device": 1})


def test_batches_of_any_shape_move_with_their_types_kept():
    Pair = namedtuple("Pair", "x y")
    batch = {
        "img": torch.zeros(2, 3),
        "label": torch.ones(2),
        "meta": ["a", 3],
        "pair": Pair(torch.zeros(1), 5),
        "nested": OrderedDict(t=(torch.zeros(1), torch.ones(1))),
    }
    moved = to_device(batch, torch.device("cpu"))
    assert set(moved) == set(batch)
    assert isinstance(moved["pair"], Pair)
    assert moved["pair"].y == 5
    assert isinstance(moved["nested"], OrderedDict)
    assert moved["meta"] == ["a", 3]
    assert torch.equal(moved["img"], batch["img"])


# ---- timing ---------------------------------------------------------------------------


class HostClock:
    """The host clock as fedlb.training.device reads it (`time.perf_counter`), moved only
    by the test: what the timers do with it, whatever else the machine runs."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def host_clock(monkeypatch):
    from fedlb.training import device

    clock = HostClock()
    monkeypatch.setattr(device, "time", clock)
    return clock


def test_the_cpu_timer_reads_the_host_clock(host_clock):
    timer = ComputeTimer()
    timer.start()
    with pytest.raises(RuntimeError, match="before stop"):
        timer.seconds()
    timer.start()
    host_clock.now += 0.05
    assert not timer.stopped
    assert timer.elapsed_now() == pytest.approx(0.05)
    host_clock.now += 0.02
    timer.stop()
    assert timer.stopped
    host_clock.now += 1.0  # read later: the stretch is what it was
    assert timer.seconds() == pytest.approx(0.07)


def test_the_cpu_timer_on_the_real_clock_is_no_shorter_than_a_sleep():
    """The real clock, bounded only from below (sleep never returns early; a busy machine
    only adds)."""
    timer = ComputeTimer()
    timer.start()
    time.sleep(0.05)
    timer.stop()
    assert timer.seconds() >= 0.05


class FakeEvent:
    """Stands in for torch.cuda.Event: the GPU 'reaches' it `gpu_s` after it is recorded;
    recorded at the host clock's time (HostClock: the test's)."""

    log: ClassVar[list[str]] = []
    gpu_s = 0.25
    host: ClassVar[HostClock] = HostClock()

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self, stream: object = None) -> None:
        FakeEvent.log.append("record")
        self.at = FakeEvent.host.perf_counter()

    def synchronize(self) -> None:
        FakeEvent.log.append("synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None
        assert end.at is not None
        return (end.at - self.at + FakeEvent.gpu_s) * 1000.0  # ms, as CUDA's


@pytest.fixture
def fake_cuda_events(monkeypatch, host_clock):
    FakeEvent.log = []
    FakeEvent.host = host_clock
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: FakeEvent.log.append("sync"))
    return FakeEvent


def test_on_cuda_the_timer_reads_events_not_the_host_clock(fake_cuda_events):
    """The host returns at once (kernels are queued); the events say how long the GPU
    took, and reading them waits for the stop event only, at the boundary."""
    timer = ComputeTimer(torch.device("cuda", 0))
    timer.start()
    timer.stop()  # the hook at the last bucket: no stall
    assert fake_cuda_events.log == ["record", "record"]
    assert timer.seconds() == pytest.approx(0.25)
    assert fake_cuda_events.log[-1] == "synchronize"
    assert "sync" not in fake_cuda_events.log


def test_on_cuda_sleep_padding_synchronises_before_it_reads_the_clock(fake_cuda_events, host_clock):
    timer = ComputeTimer(torch.device("cuda", 0))
    timer.start()
    host_clock.now += 0.1
    assert timer.elapsed_now() == pytest.approx(0.1)
    timer.stop(synchronize_now=True)
    assert fake_cuda_events.log.count("sync") == 2
    assert timer.seconds() == pytest.approx(0.1)  # the host clock after the waits, not the events


def test_accelerator_memory_takes_the_peak_and_is_none_off_the_gpu(monkeypatch):
    assert accelerator_memory(torch.device("cpu")) is None
    gib = 2**30
    resets: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (6 * gib, 8 * gib))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda index=None: 7 * gib)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    device = torch.device("cuda", 0)
    # In use now: 2 of 8 GiB; the iteration's peak: 7 of 8. The guard needs the peak.
    assert accelerator_memory(device) == pytest.approx(7 / 8)
    assert resets == []
    assert accelerator_memory(device, reset_peak=True) == pytest.approx(7 / 8)
    assert resets == [0]


# ---- on a real GPU ----------------------------------------------------------------------


@cuda
def test_cuda_events_time_the_work_not_the_launches():
    device = torch.device("cuda", 0)
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize(device)
    timer = ComputeTimer(device)
    timer.start()
    launched = time.perf_counter()
    for _ in range(20):
        a = a @ a
        a = a / a.norm()
    host_s = time.perf_counter() - launched  # the launches only
    timer.stop()
    gpu_s = timer.seconds()
    torch.cuda.synchronize(device)
    assert gpu_s > host_s  # the host ran ahead of the GPU


@cuda
def test_a_silo_trains_on_its_gpu_and_sends_a_cpu_update(tmp_path):
    from fedlb.training import evaluate, tensor_dataset, train_epoch

    device = choose_device("cuda")
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).to(device)
    data = tensor_dataset(torch.randn(64, 8, 8), torch.randint(0, 10, (64,)))
    batches = torch.utils.data.DataLoader(data, batch_size=16)
    loss = train_epoch(model, batches, 0.1, device=device)
    assert loss > 0
    assert evaluate(model, data, device=device)[1] >= 0
    assert accelerator_memory(device) is not None


@cuda
def test_fedlb_cluster_runs_on_the_gpu_with_nccl(tmp_path):
    from fedlb.experiments import launch

    scenario = ClusterScenario.from_mapping(
        {"nproc": 1, "speeds": "1", "iterations": 20, "backend": "nccl", "device": "cuda"}
    )
    assert launch(scenario, tmp_path, timeout=240) == 0, (tmp_path / "torchrun.log").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "cuda:0"
    assert summary["backend"] == "nccl"


@cuda
def test_two_ranks_share_one_gpu_over_gloo(tmp_path):
    from fedlb.experiments import launch

    scenario = ClusterScenario.from_mapping(
        {"nproc": 2, "speeds": "1,2", "iterations": 30, "device": "cuda", "policy": "lb-ema"}
    )
    assert scenario.placement()[1] == "gloo"
    assert launch(scenario, tmp_path, timeout=240) == 0, (tmp_path / "torchrun.log").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    sizes = summary["final_sizes"]
    assert sum(sizes) == 64
    assert sizes[1] > sizes[0]


@cuda
@two_gpus
def test_nccl_between_two_gpus(tmp_path):
    from fedlb.experiments import launch

    scenario = ClusterScenario.from_mapping(
        {"nproc": 2, "speeds": "1,2", "iterations": 30, "backend": "nccl", "policy": "lb-ema"}
    )
    assert launch(scenario, tmp_path, timeout=240) == 0, (tmp_path / "torchrun.log").read_text()


NCCL_SIZES = (5, 11)


def _nccl_step(rank: int, store: str, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from fedlb.cluster import weighted_allreduce_hook
    from fedlb.cluster.hook import WeightedState

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    device = torch.device("cuda", rank)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(sum(NCCL_SIZES), 8, generator=generator)
    y = torch.randint(0, 3, (sum(NCCL_SIZES),), generator=generator)
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(device),
        device_ids=[rank],
    )
    state = WeightedState(weight=NCCL_SIZES[rank] / sum(NCCL_SIZES), timer=ComputeTimer(device))
    model.register_comm_hook(state, weighted_allreduce_hook)
    start = sum(NCCL_SIZES[:rank])
    part = slice(start, start + NCCL_SIZES[rank])
    state.begin()
    nn.functional.cross_entropy(model(x[part].to(device)), y[part].to(device)).backward()
    assert state.ready_s is not None
    assert state.ready_s > 0
    if rank == 0:
        torch.save([p.grad.cpu() for p in model.parameters()], out)
    dist.barrier()
    del model
    dist.destroy_process_group()
    os._exit(0)


@cuda
@two_gpus
def test_the_weighted_hook_is_exact_under_nccl(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "grads.pt"
    mp.spawn(_nccl_step, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(sum(NCCL_SIZES), 8, generator=generator)
    y = torch.randint(0, 3, (sum(NCCL_SIZES),), generator=generator)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    nn.functional.cross_entropy(model(x), y).backward()
    for a, b in zip(torch.load(out), [p.grad for p in model.parameters()], strict=True):
        assert torch.allclose(a, b, atol=1e-5)
