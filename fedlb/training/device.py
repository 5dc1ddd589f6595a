"""Where a worker computes, and how its compute is timed honestly there.

CUDA runs asynchronously: a `time.perf_counter()` around a forward and backward measures how
fast the host queued the kernels, not how long the GPU took, so every speed fedlb derived
from it would be wrong. On a CUDA device the timers here either record CUDA events on the
compute stream (no stall: read at the iteration boundary) or synchronise before reading the
clock (where sleep padding must know the real time at once). On the CPU they are plain
`perf_counter()` readings.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch


class DeviceError(ValueError):
    """A device setting that cannot be honoured here; the message says what to do."""


def choose_device(spec: str = "auto", local_rank: int | None = None) -> torch.device:
    """The torch device for a worker.

    Args:
        spec: "auto" (a GPU when CUDA is available, else the CPU), "cpu", "cuda" or
            "cuda:N".
        local_rank: this process's rank on its machine (torchrun's LOCAL_RANK; read from
            the environment when None). With "auto" or "cuda", rank r takes GPU
            r mod (number of GPUs), so ranks spread over the machine's GPUs.
    """
    spec = spec.strip().lower()
    if spec == "cpu":
        return torch.device("cpu")
    if spec not in ("auto", "cuda") and not spec.startswith("cuda:"):
        raise DeviceError(f"device must be one of auto, cpu, cuda or cuda:N, got {spec!r}")
    available = torch.cuda.is_available()
    if spec == "auto" and not available:
        return torch.device("cpu")
    if not available:
        raise DeviceError(
            f"device {spec!r} asks for a GPU but torch sees none (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda is not None}); use --device cpu or auto"
        )
    count = torch.cuda.device_count()
    if spec.startswith("cuda:"):
        try:
            index = int(spec.removeprefix("cuda:"))
        except ValueError as error:
            raise DeviceError(f"device {spec!r}: N in cuda:N must be an integer") from error
        if not 0 <= index < count:
            raise DeviceError(f"device {spec!r}: this machine has GPUs 0..{count - 1}")
        return torch.device("cuda", index)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank % count)


def process_group_backend(device: torch.device, ranks_per_gpu: int = 1) -> str:
    """torch.distributed's backend for gradients on `device`: NCCL for CUDA tensors where
    each rank has a GPU of its own, gloo otherwise (the CPU, or ranks sharing a GPU, which
    NCCL refuses)."""
    return "nccl" if device.type == "cuda" and ranks_per_gpu == 1 else "gloo"


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it (tuples, lists, dicts of them) moved to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return type(batch)(to_device(v, device) for v in batch)  # type: ignore[call-arg]
    return batch


def synchronize(device: torch.device | None = None) -> None:
    """Wait until the accelerator has finished the work queued on it (nothing on a CPU).
    With `device` None: the current CUDA device, if this process has used CUDA at all."""
    if device is not None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()


class ComputeTimer:
    """Times one stretch of compute on `device`: `start()`, `stop()`, then `seconds()`.

    On CUDA, `start` and `stop` record events on the current stream and `seconds()` waits
    for the stop event (call it at the iteration boundary, when the GPU is there or nearly).
    `stop(synchronize=True)` waits for the GPU at once and reads the host clock instead:
    what sleep padding needs, since it must know the real time before it sleeps.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self._began = 0.0
        self._ended: float | None = None
        self._events: tuple[Any, Any] | None = None

    def start(self) -> None:
        self._ended = None
        self._events = None
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            begin.record(torch.cuda.current_stream(self.device))
            self._events = (begin, None)
        self._began = time.perf_counter()

    def stop(self, synchronize_now: bool = False) -> None:
        if self.cuda and not synchronize_now and self._events is not None:
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end.record(torch.cuda.current_stream(self.device))
            self._events = (self._events[0], end)
            return
        if self.cuda:
            synchronize(self.device)
            self._events = None
        self._ended = time.perf_counter()

    def elapsed_now(self) -> float:
        """Seconds since `start()` on the host clock, after waiting for the GPU."""
        if self.cuda:
            synchronize(self.device)
        return time.perf_counter() - self._began

    @property
    def stopped(self) -> bool:
        return self._ended is not None or (self._events is not None and self._events[1] is not None)

    def seconds(self) -> float:
        """The stretch's seconds of compute; raises RuntimeError before `stop()`."""
        if self._events is not None and self._events[1] is not None:
            begin, end = self._events
            end.synchronize()
            return float(begin.elapsed_time(end)) / 1000.0
        if self._ended is None:
            raise RuntimeError("ComputeTimer.seconds() before stop()")
        return self._ended - self._began
