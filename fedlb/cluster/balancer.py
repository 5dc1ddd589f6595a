"""Adopt load balancing in your own training script: wrap the dataset, keep your loop.

    model = DDP(model)
    balancer = LoadBalancer(model, dataset, batch_size=32)
    for x, y in balancer.batches(iterations=1000):
        loss = F.cross_entropy(model(x), y)     # a mean over the batch, as usual
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    balancer.close()

`LoadBalancer` registers the weighted all-reduce hook on the DDP model, draws each rank's
batches from the whole dataset with a resizable sampler, and at every iteration boundary
(when the loop asks for the next batch) reports the iteration to the coordinator and applies
the size it gets back. Where each rank holds only a shard of the data, pass a
`DataPartitionManager` instead of the dataset: batches come from the shard, and the manager
keeps the shards traversed at one pace. Batches come on the model's device (a GPU model gets CUDA
tensors; a rank's GPU is `choose_device("auto")`: cuda:LOCAL_RANK). Compute is timed with
CUDA events there, up to the last gradient bucket: the all-reduce's wait is not in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from fedlb.balance import SpeedEstimator, Tuner, WorkerReport, default_estimator
from fedlb.training import ComputeTimer, ResizableBatchSampler, ResourceProbe, to_device

from .coordinator import Coordinator, Exchange
from .hook import WeightedState, weighted_allreduce_hook
from .partition import DataPartitionManager


class LoadBalancer:
    """LB-BSP on a DDP job: each rank's batch size from its measured speed, every
    iteration, so all ranks reach the allreduce together; X (the global batch) is kept.

    Args:
        model: your DistributedDataParallel model (the hook is registered on it).
        dataset: the whole dataset, every rank sampling from all of it (seeded per rank);
            or a DataPartitionManager over this rank's own shard.
        batch_size: B0, every rank's starting size (X = world x B0 is kept), or one per
            rank.
        tuner: how sizes move (default: fedlb.balance.defaults' tuner).
        estimator: a factory of each rank's speed estimator (default: fedlb.balance.defaults').
        asynchronous: GPU mode: sizes applied one iteration late, exchange off the
            critical path.
        pace: emulate a slower machine: (real seconds, batch) -> seconds to take.
        seed: base seed of the ranks' batch streams.
        on_exchange: rank 0's callback after every exchange.
        probe: what measures CPU, memory and accelerator memory (default ResourceProbe on
            the model's device).
        device: where batches go (default: the model's device).
        **loader_args: more DataLoader arguments (num_workers=0 keeps sizes exact).

    Example:
        ```python
        from fedlb.cluster import LoadBalancer

        model = DistributedDataParallel(net)
        balancer = LoadBalancer(model, dataset, batch_size=32)
        for x, y in balancer.batches(iterations=1000):  # sized to this rank's speed
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()  # the allreduce reports the iteration
            optimizer.step()
        balancer.close()
        ```
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        dataset: Dataset[Any] | DataPartitionManager,
        batch_size: int | Sequence[int],
        tuner: Tuner | None = None,
        estimator: Callable[[], SpeedEstimator] = default_estimator,
        *,
        asynchronous: bool = False,
        pace: Callable[[float, int], float] | None = None,
        seed: int = 0,
        on_exchange: Callable[[Exchange], None] | None = None,
        probe: Any = None,
        device: torch.device | None = None,
        **loader_args: Any,
    ) -> None:
        self.coordinator = Coordinator(
            batch_size, tuner, estimator, asynchronous=asynchronous, on_exchange=on_exchange
        )
        rank = self.coordinator.rank
        self.device = device if device is not None else next(model.parameters()).device
        own = self.coordinator.batch_size
        self.state = WeightedState(pace=pace, batch_size=own, timer=ComputeTimer(self.device))
        self._set_size(own)
        model.register_comm_hook(self.state, weighted_allreduce_hook)
        self.partitions = dataset if isinstance(dataset, DataPartitionManager) else None
        if not isinstance(dataset, DataPartitionManager):
            self.sampler = ResizableBatchSampler(dataset, own, seed=seed * 1009 + rank)  # type: ignore[arg-type]
            self.loader = DataLoader(dataset, batch_sampler=self.sampler, **loader_args)
        else:
            dataset.batch_size = own
        self.probe = probe or ResourceProbe(self.device)
        self.iteration = 0
        self.last_report: WorkerReport | None = None

    def _set_size(self, size: int) -> None:
        self.state.batch_size = size
        self.state.weight = size / self.coordinator.total

    def batches(self, iterations: int) -> Iterator[Any]:
        """`iterations` batches; the boundary work happens when the next one is asked for
        (and after the last), so the loop body stays yours."""
        stream = self.partitions.batches() if self.partitions else iter(self.loader)
        for _ in range(iterations):
            batch = to_device(next(stream), self.device)
            self.state.begin()
            yield batch
            self.finish_iteration()

    def finish_iteration(self) -> int:
        """Report the iteration just run; returns this rank's next batch size."""
        compute_s = self.state.ready_s
        if compute_s is None:
            raise RuntimeError(
                "no gradients were all-reduced this iteration: call loss.backward() on the "
                "DDP model inside the loop"
            )
        resources = self.probe.sample()
        report = WorkerReport(
            worker=str(self.coordinator.rank),
            batch_size=self.state.batch_size,
            iterations=1,
            compute_s=compute_s,
            cpu=resources.cpu,
            mem=resources.mem,
            accel_mem=resources.accel_mem,
        )
        self.last_report = report
        size = self.coordinator.step(report)
        if self.partitions is not None:
            self.partitions.step(size)
        else:
            self.sampler.batch_size = size
        self._set_size(size)
        self.iteration += 1
        return size

    def close(self) -> None:
        """Stop this rank's part of the exchange (and its partition manager's, if any):
        call it once the loop is done, on every rank."""
        self.coordinator.close()
        if self.partitions is not None:
            self.partitions.close()
