"""fedlb.training: torch helpers shared by federated silos and cluster workers."""

from .local import EmulatedSpeed, LocalResult, Pace, evaluate, tensor_dataset, train_steps
from .resources import ResourceProbe, ResourceSample, accelerator_memory
from .sampler import ResizableBatchSampler

__all__ = [
    "EmulatedSpeed",
    "LocalResult",
    "Pace",
    "ResizableBatchSampler",
    "ResourceProbe",
    "ResourceSample",
    "accelerator_memory",
    "evaluate",
    "tensor_dataset",
    "train_steps",
]
