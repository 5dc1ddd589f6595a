"""What a worker measures of its machine for a report: CPU, memory, accelerator memory."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch


@dataclass(frozen=True)
class ResourceSample:
    """Use fractions in [0, 1]; accel_mem is None without an accelerator."""

    cpu: float
    mem: float
    accel_mem: float | None


def accelerator_memory(device: torch.device | None = None) -> float | None:
    """Used fraction of the accelerator's memory (all processes on it), or None.

    Device-wide, not this process's allocations: the 95% limit of the GPU tuner is about
    what is left on the card, whoever holds the rest.
    """
    if not torch.cuda.is_available():
        return None
    index = device.index if device is not None and device.type == "cuda" else None
    free, total = torch.cuda.mem_get_info(index)
    return 1.0 - free / total if total else None


class ResourceProbe:
    """Samples machine-wide CPU and memory use (psutil) and accelerator memory (torch).

    CPU use is the machine-wide busy fraction since the previous `sample()` (the first call
    covers the time since the probe was made): competing jobs on the machine are what slow a
    worker down, so that is what NARX needs to see.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        psutil.cpu_percent(interval=None)  # primes the counter; the next call measures since

    def sample(self) -> ResourceSample:
        return ResourceSample(
            cpu=min(1.0, max(0.0, psutil.cpu_percent(interval=None) / 100.0)),
            mem=min(1.0, max(0.0, psutil.virtual_memory().percent / 100.0)),
            accel_mem=accelerator_memory(self.device),
        )
