"""A small multilayer perceptron: the default model for the embedded digits dataset."""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):
    """Flatten, then Linear-ReLU layers, then a linear classifier.

    Args:
        input_shape: shape of one sample, e.g. (1, 8, 8) for digits.
        num_classes: outputs. Default 10.
        hidden: sizes of the hidden layers. Default (64,).
    """

    def __init__(
        self, input_shape: tuple[int, ...], num_classes: int = 10, hidden: tuple[int, ...] = (64,)
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out
