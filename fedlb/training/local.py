"""The timed local-training loop and evaluation, shared by silos and cluster workers."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .sampler import ResizableBatchSampler

# (real seconds of one step, its batch size) -> seconds the step should appear to take.
# None: real time. Emulated heterogeneity (a slow silo on a fast laptop) plugs in here.
Pace = Callable[[float, int], float]


@dataclass(frozen=True)
class EmulatedSpeed:
    """Emulate a machine that processes `samples_per_s`: each step is padded with sleep to
    B / samples_per_s seconds (the `measured` clock: real compute, wall-clock faithful).

    A step whose real compute already takes longer is not padded (the machine cannot keep
    up with the profile); `LocalResult.real_compute_s` shows it.
    """

    samples_per_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.samples_per_s) and self.samples_per_s > 0):
            raise ValueError(
                f"emulated speed must be a finite number > 0 samples/s, got {self.samples_per_s}"
            )

    def __call__(self, real_s: float, batch_size: int) -> float:
        return max(real_s, batch_size / self.samples_per_s)


@dataclass(frozen=True)
class LocalResult:
    """What τ local steps cost and gave."""

    compute_s: float  # seconds of the steps as the silo lived them (padded when emulated)
    real_compute_s: float  # seconds actually computed
    steps: int
    samples: int
    loss: float  # mean training loss over the steps


def tensor_dataset(x: object, y: object) -> TensorDataset:
    """A TensorDataset from numpy arrays (or tensors)."""
    return TensorDataset(torch.as_tensor(x), torch.as_tensor(y))


def _warm_up(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
    """One throwaway step on a copy: the first autograd pass and optimizer step pay lazy
    initialisation (1.6 s measured for torch.optim's first step on a fresh process) that
    must not count as compute, or the balancer would shrink every silo's batch for it."""
    scratch = copy.deepcopy(model)
    optimiser = torch.optim.SGD(scratch.parameters(), lr=lr)
    optimiser.zero_grad()
    loss = nn.functional.cross_entropy(scratch(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    optimiser.step()


def train_steps(
    model: nn.Module,
    data: TensorDataset,
    sampler: ResizableBatchSampler,
    steps: int,
    lr: float,
    momentum: float = 0.0,
    pace: Pace | None = None,
) -> LocalResult:
    """Run `steps` SGD steps drawing `sampler.batch_size` samples each; time the compute.

    The clock runs from fetching a batch to the end of its optimizer step, so the time is
    the part that scales with B. A warm-up step on a copy of the model comes first and is
    not timed. With `pace`, each step is padded with sleep to the time `pace` says.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    model.train()
    batches = iter(DataLoader(data, batch_sampler=sampler))
    first_x, first_y = data[0 : min(len(data), sampler.batch_size)]
    _warm_up(model, first_x, first_y, lr)
    optimiser = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    compute = real = loss_sum = 0.0
    samples = 0
    for _ in range(steps):
        start = time.perf_counter()
        x, y = next(batches)
        optimiser.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
        elapsed = time.perf_counter() - start
        real += elapsed
        if pace is not None:
            target = pace(elapsed, len(y))
            if target > elapsed:
                time.sleep(target - elapsed)
            elapsed = max(elapsed, target)
        compute += elapsed
        loss_sum += float(loss.detach())
        samples += len(y)
    return LocalResult(compute, real, steps, samples, loss_sum / steps)


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset, batch_size: int = 512) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy) of `model` on `data`."""
    if len(data) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    model.eval()
    loss_sum = 0.0
    correct = 0
    for x, y in DataLoader(data, batch_size=batch_size):
        logits = model(x)
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    return loss_sum / len(data), correct / len(data)
