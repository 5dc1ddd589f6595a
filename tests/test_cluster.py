"""Cluster mode on real gloo process groups (CPU): the weighted all-reduce is exact, the
coordinator balances emulated heterogeneous ranks, a dead rank stops the job."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fedlb.cluster import WeightedState, weighted_allreduce_hook

SIZES = (5, 11, 16)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(sum(SIZES), 8, generator=generator), torch.randint(
        0, 3, (sum(SIZES),), generator=generator
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _init(rank: int, world: int, store: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _one_step(rank: int, store: str, out: str, weighted: bool) -> None:
    _init(rank, len(SIZES), store)
    x, y = _data()
    start = sum(SIZES[:rank])
    model = DistributedDataParallel(_model())
    if weighted:
        state = WeightedState(weight=SIZES[rank] / sum(SIZES))
        model.register_comm_hook(state, weighted_allreduce_hook)
    loss = nn.functional.cross_entropy(model(x[start : start + SIZES[rank]]), y[start : start + SIZES[rank]])
    loss.backward()
    if rank == 0:
        torch.save([p.grad for p in model.parameters()], out)
    dist.destroy_process_group()


@pytest.mark.parametrize("weighted", [True, False])
def test_weighted_aggregation_equals_one_process_on_the_union(tmp_path, weighted):
    out = tmp_path / "grads.pt"
    mp.spawn(_one_step, args=(str(tmp_path / "store"), str(out), weighted), nprocs=len(SIZES))
    distributed = torch.load(out)
    x, y = _data()
    model = _model()
    nn.functional.cross_entropy(model(x), y).backward()
    union = [p.grad for p in model.parameters()]
    close = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(distributed, union, strict=True))
    # the hook: exactly the gradient of the union batch; DDP's plain average: not
    assert close is weighted
