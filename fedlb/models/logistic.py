"""Logistic regression as FLamby's Fed-Heart-Disease baseline has it: Linear(d, 1) + sigmoid.

fedlb's loops train with cross-entropy and score by argmax over class logits. The model
answers with the two logits (0, z): softmax((0, z))[1] = sigmoid(z), so their
cross-entropy is exactly the binary cross-entropy of sigmoid(z), and argmax is
sigmoid(z) > 0.5 — FLamby's loss and accuracy, with its one-output parameters (initialised
as nn.Linear(d, 1) is, draw for draw).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Logistic(nn.Module):
    """Flatten, then one linear unit z; returns the logits (0, z) of classes 0 and 1."""

    def __init__(self, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.linear(x.flatten(1))
        return torch.cat([torch.zeros_like(z), z], dim=1)
