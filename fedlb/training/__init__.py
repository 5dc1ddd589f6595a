"""fedlb.training: torch helpers shared by federated silos and cluster workers."""

from .device import (
    ComputeTimer,
    DeviceError,
    choose_device,
    process_group_backend,
    synchronize,
    to_device,
)
from .local import BASE_SPEED, EmulatedSpeed, Pace, evaluate, tensor_dataset, train_epoch
from .resources import ResourceProbe, ResourceSample, accelerator_memory
from .sampler import ResizableBatchSampler

__all__ = [
    "BASE_SPEED",
    "ComputeTimer",
    "DeviceError",
    "EmulatedSpeed",
    "Pace",
    "ResizableBatchSampler",
    "ResourceProbe",
    "ResourceSample",
    "accelerator_memory",
    "choose_device",
    "evaluate",
    "process_group_backend",
    "synchronize",
    "tensor_dataset",
    "to_device",
    "train_epoch",
]
