"""fedlb.training: torch helpers shared by federated silos and cluster workers."""

from .local import BASE_SPEED, EmulatedSpeed, Pace, evaluate, tensor_dataset, train_epoch
from .resources import ResourceProbe, ResourceSample, accelerator_memory
from .sampler import ResizableBatchSampler

__all__ = [
    "BASE_SPEED",
    "EmulatedSpeed",
    "Pace",
    "ResizableBatchSampler",
    "ResourceProbe",
    "ResourceSample",
    "accelerator_memory",
    "evaluate",
    "tensor_dataset",
    "train_epoch",
]
