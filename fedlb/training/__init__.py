"""fedlb.training: torch helpers shared by federated silos and cluster workers.

Emulated hardware (one machine standing in for many): `EmulatedSpeed` pads each step to
B / v, `EmulatedCurve` to a measured step-time curve; `STEP_CURVES` is the one table of
the curves fedlb ships, and `step_curve` reads a setting's "NAME" or "NAME*K".
"""

from .curves import STEP_CURVES, EmulatedCurve, step_curve
from .device import (
    ComputeTimer,
    DeviceError,
    choose_device,
    process_group_backend,
    synchronize,
    to_device,
)
from .local import BASE_SPEED, EmulatedSpeed, Pace, evaluate, tensor_dataset, train_epoch
from .pairing import model_dataset_problem
from .resources import ResourceProbe, ResourceSample, accelerator_memory
from .sampler import ResizableBatchSampler

__all__ = [
    "BASE_SPEED",
    "STEP_CURVES",
    "ComputeTimer",
    "DeviceError",
    "EmulatedCurve",
    "EmulatedSpeed",
    "Pace",
    "ResizableBatchSampler",
    "ResourceProbe",
    "ResourceSample",
    "accelerator_memory",
    "choose_device",
    "evaluate",
    "model_dataset_problem",
    "process_group_backend",
    "step_curve",
    "synchronize",
    "tensor_dataset",
    "to_device",
    "train_epoch",
]
