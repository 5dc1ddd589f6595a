"""fedlb.models: the reference models of the papers' experiments."""

from __future__ import annotations

from torch import nn

from .lenet import LeNet5
from .logistic import Logistic
from .mlp import MLP
from .small import CharLSTM, SmallCNN

# name -> what it is (for help texts and errors): the one table of model names
MODELS = {
    "mlp": "a small multi-layer perceptron (any input)",
    "lenet5": "LeNet-5 (28x28 or 32x32 images)",
    "cnn": "a small CNN (images)",
    "lstm": "a character LSTM (shakespeare)",
    "logistic": "FLamby's Linear + sigmoid (binary tasks, heart-flamby)",
}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int) -> nn.Module:
    """A freshly initialised model by name, the same weights for the same seed."""
    import torch

    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(input_shape, num_classes)
    if name == "lenet5":
        channels, height = input_shape[0], input_shape[-1]
        return LeNet5(channels, num_classes, image_size=height)
    if name == "cnn":
        return SmallCNN(input_shape[0], num_classes, image_size=input_shape[-1])
    if name == "lstm":
        return CharLSTM(vocab_size=num_classes)
    if name == "logistic":
        if num_classes != 2:
            raise ValueError(f"the logistic model is binary: {num_classes} classes given")
        return Logistic(input_shape)
    raise ValueError(f"unknown model {name!r}: choose from {', '.join(MODELS)}")


__all__ = ["MLP", "MODELS", "CharLSTM", "LeNet5", "Logistic", "SmallCNN", "build_model"]
