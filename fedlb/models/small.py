"""A small CNN for image silos and a 2-layer character LSTM for next-character prediction."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Two conv-ReLU-pool blocks and a linear classifier (~80k parameters on 28x28):
    the kind of model cross-silo image benchmarks use when LeNet-5 is too small.

    Args:
        in_channels: 1 (MNIST-like) or 3 (CIFAR-10). Default 1.
        num_classes: outputs. Default 10.
        image_size: height = width of the input, divisible by 4. Default 28.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        if image_size % 4:
            raise ValueError(f"SmallCNN needs an image size divisible by 4, got {image_size}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * side * side, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.classifier(self.features(x))
        return out


class CharLSTM(nn.Module):
    """Embedding, a 2-layer LSTM and a linear head over the last step: predicts the next
    character of a sequence (LEAF's Shakespeare task; the LB-BSP paper's two-layer LSTM).

    Args:
        vocab_size: distinct characters. Default 80.
        embed_dim: embedding width. Default 8.
        hidden: LSTM width. Default 128.
        layers: LSTM layers. Default 2.
    """

    def __init__(
        self, vocab_size: int = 80, embed_dim: int = 8, hidden: int = 128, layers: int = 2
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        states, _ = self.lstm(self.embed(x))
        out: torch.Tensor = self.head(states[:, -1, :])
        return out
