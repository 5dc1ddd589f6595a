"""fedlb.training: torch helpers shared by federated silos and cluster workers."""

from .resources import ResourceProbe, ResourceSample, accelerator_memory
from .sampler import ResizableBatchSampler

__all__ = ["ResizableBatchSampler", "ResourceProbe", "ResourceSample", "accelerator_memory"]
