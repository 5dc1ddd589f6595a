"""The local-training loop, evaluation, and emulated speed, shared by silos and cluster workers."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .device import to_device

# (real seconds of one step, its batch size) -> seconds the step should appear to take.
# None: real time. Emulated heterogeneity (a slow silo on a fast laptop) plugs in here.
Pace = Callable[[float, int], float]

# Samples/s of an emulated machine at slowdown 1 (speed factor 1): the one default of
# `fedlb demo`, `fedlb silo --slowdown`, scenarios and cluster runs. Sleep padding
# dominates the digits MLP's real compute at this speed on a laptop core.
BASE_SPEED = 200.0


@dataclass(frozen=True)
class EmulatedSpeed:
    """Emulate a machine that processes `samples_per_s`: each step is padded with sleep to
    B / samples_per_s seconds (the `measured` clock: real compute, wall-clock faithful).

    A step whose real compute already takes longer is not padded (the machine cannot keep
    up with the profile); a silo's balance_mod then says so in its log.
    """

    samples_per_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.samples_per_s) and self.samples_per_s > 0):
            raise ValueError(
                f"emulated speed must be a finite number > 0 samples/s, got {self.samples_per_s}"
            )

    def __call__(self, real_s: float, batch_size: int) -> float:
        return max(real_s, batch_size / self.samples_per_s)


def tensor_dataset(x: object, y: object) -> TensorDataset:
    """A TensorDataset from numpy arrays (or tensors)."""
    return TensorDataset(torch.as_tensor(x), torch.as_tensor(y))


def train_epoch(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    momentum: float = 0.0,
    device: torch.device | None = None,
) -> float:
    """SGD with cross-entropy over `batches` (fedlb's own silo loop: a fresh optimizer per
    round, as Flower's examples do) on `device` (default: where the model is); the mean
    training loss."""
    model.train()
    optimiser = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_sum, steps = 0.0, 0
    for x, y in batches:
        if device is not None:
            x, y = to_device((x, y), device)
        optimiser.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
        loss_sum += float(loss.detach())
        steps += 1
    if steps == 0:
        raise ValueError("no batch to train on")
    return loss_sum / steps


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: TensorDataset,
    batch_size: int = 512,
    device: torch.device | None = None,
) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy) of `model` on `data`, computed on `device`
    (default: the CPU; the model must be there already)."""
    if len(data) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    model.eval()
    loss_sum = 0.0
    correct = 0
    for x, y in DataLoader(data, batch_size=batch_size):
        if device is not None:
            x, y = to_device((x, y), device)
        logits = model(x)
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    return loss_sum / len(data), correct / len(data)
