"""LeNet-5, the model of the LB-BSP paper's federated experiment (Section 5.5)."""

from __future__ import annotations

import torch
from torch import nn


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998) with ReLU and max-pooling, as commonly used in FL papers.

    Args:
        in_channels: 1 for MNIST-like images, 3 for CIFAR-10. Default 1.
        num_classes: output classes. Default 10.
        image_size: input height = width, 28 (MNIST; padded to 32 inside) or 32. Default 28.

    61,706 parameters for 1x28x28 inputs and 10 classes.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        if image_size not in (28, 32):
            raise ValueError(f"LeNet5 takes 28x28 or 32x32 images, got {image_size}")
        self.pad = 2 if image_size == 28 else 0
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, kernel_size=5, padding=self.pad),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.classifier(self.features(x))
        return out
