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


def accelerator_memory(
    device: torch.device | None = None, reset_peak: bool = False
) -> float | None:
    """Used fraction of the accelerator's memory, or None without one.

    The larger of two readings: the card's memory in use by every process on it
    (`mem_get_info`: the 95% limit of the GPU tuner is about what is left on the card,
    whoever holds the rest), and this process's peak reserved since the last reset
    (`max_memory_reserved`: at an iteration boundary the activations are freed, but the
    next, larger batch needs room for them). `reset_peak` starts a new peak window.
    """
    if not torch.cuda.is_available():
        return None
    if device is not None and device.type != "cuda":
        return None
    index = device.index if device is not None else None
    free, total = torch.cuda.mem_get_info(index)
    if not total:
        return None
    peak = torch.cuda.max_memory_reserved(index) / total
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(index)
    return min(1.0, max(1.0 - free / total, peak))


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
            accel_mem=accelerator_memory(self.device, reset_peak=True),
        )
