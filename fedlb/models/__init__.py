"""fedlb.models: the reference models of the papers' experiments."""

from .lenet import LeNet5

__all__ = ["LeNet5"]
