"""Load balancing for a ClientApp somebody already has: `LocalRound`.

A standard Flower PyTorch ClientApp builds a DataLoader with a fixed batch size and trains
some epochs. To be balanced, it must train τ steps at the batch size the server sends and
report how long the steps took. In the handler:

    with LocalRound(msg, trainset) as local:              # B, τ, η from the server
        loss = train(model, local.loader, local.learning_rate)  # the app's own loop
    metrics = {"train_loss": loss, "num-examples": len(trainset), **local.metrics()}

`local.loader` yields exactly τ batches of B samples (each epoch a fresh permutation, a
batch running on into the next epoch when needed). The block's wall time is the compute
time; what the handler spends between creating the LocalRound and calling metrics()
outside the block (loading weights, serialising) is its fixed cost.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Sized
from types import TracebackType
from typing import Any

import torch
from flwr.app import Message
from torch.utils.data import DataLoader, Dataset

from fedlb.training import ResizableBatchSampler, ResourceProbe


def _number(config: Any, key: str) -> float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"the server's train config has no usable {key!r} ({value!r}): is the server "
            "running fedlb's LoadBalancedFedAvg?"
        )
    return float(value)


def warm_up_torch() -> None:
    """Pay torch's one-time lazy initialisation (autograd, optimizer step: ~1.5 s in a
    fresh process here) outside the timed block, on a throwaway parameter."""
    weight = torch.zeros(1, requires_grad=True)
    optimiser = torch.optim.SGD([weight], lr=0.1)
    (weight * 2).sum().backward()  # type: ignore[no-untyped-call]
    optimiser.step()


class LocalRound:
    """One silo round as the server configured it: batch size, steps, learning rate.

    Args:
        msg: the train message from a LoadBalancedFedAvg server.
        dataset: the silo's training set (a torch Dataset with len()).
        seed: seed of the batch order (the round number is added). Default 0.
        **loader_args: passed to DataLoader (collate_fn, pin_memory...; num_workers > 0
            prefetches, which is fine here: the size is fixed for the round).
    """

    def __init__(
        self, msg: Message, dataset: Dataset[Any], seed: int = 0, **loader_args: Any
    ) -> None:
        self._created = time.perf_counter()
        self._probe = ResourceProbe()
        config = next(iter(msg.content.config_records.values()))
        self.batch_size = int(_number(config, "batch-size"))
        self.steps = int(_number(config, "local-steps"))
        self.learning_rate = _number(config, "learning-rate")
        self.server_round = int(_number(config, "server-round"))
        if not isinstance(dataset, Sized) or len(dataset) == 0:
            raise ValueError("the dataset must have a length > 0")
        self.sampler = ResizableBatchSampler(
            dataset, self.batch_size, seed=seed * 1_000_003 + self.server_round
        )
        self._loader = DataLoader(dataset, batch_sampler=self.sampler, **loader_args)
        self.compute_s: float | None = None
        self._started = self._warm_up_s = 0.0

    @property
    def loader(self) -> Iterator[Any]:
        """Exactly τ batches of B samples."""
        return itertools.islice(iter(self._loader), self.steps)

    def __enter__(self) -> LocalRound:
        start = time.perf_counter()
        warm_up_torch()
        self._warm_up_s = time.perf_counter() - start  # process start-up: neither cost
        self._started = time.perf_counter()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.compute_s = time.perf_counter() - self._started

    def metrics(self) -> dict[str, float | int]:
        """What the balancer needs, to merge into the reply's MetricRecord."""
        if self.compute_s is None:
            raise RuntimeError("metrics() comes after the `with LocalRound(...)` block")
        handler = time.perf_counter() - self._created
        resources = self._probe.sample()
        return {
            "batch-size": self.batch_size,
            "local-steps": self.steps,
            "compute-s": self.compute_s,
            "overhead-s": max(0.0, handler - self.compute_s - self._warm_up_s),
            "cpu": resources.cpu,
            "mem": resources.mem,
        }
