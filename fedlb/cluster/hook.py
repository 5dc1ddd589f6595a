"""Batch-size-weighted gradient aggregation as a DDP communication hook.

Each rank's gradient g_r is the mean over its x_r samples; the hook scales its bucket by
x_r / X and the all-reduce sums them: g = Σ x_r g_r / X, the mean over all X samples, so
every sample counts the same whatever batch each rank drew (LB-BSP Section 3.4). DDP's
default hook divides by the world size instead, which overweights the samples of ranks with
small batches once sizes differ.

The hook also marks when a rank's local gradients are all ready (the last bucket): the
compute time the balancer needs, without the wait for slower ranks that follows. On a GPU
that mark is a CUDA event on the compute stream, read at the iteration boundary (a host
clock would time kernel launches, not work). Where a rank emulates a slower machine, the
last bucket is held back until the emulated compute time has passed (sleep padding: the
`measured` clock; on a GPU the real time is then read after a synchronise).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations against
# the real dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # what DDP passes to comm hooks

from fedlb.training import ComputeTimer


@dataclass
class WeightedState:
    """What the hook needs; the coordinator updates it at every iteration boundary.

    weight: x_r / X for this rank's current batch.
    pace: emulation, (real seconds, batch size) -> seconds the iteration must take; None:
        real speed.
    batch_size: this rank's current batch (for `pace`).
    timer: this rank's compute timer (`ComputeTimer(device)`: CUDA events on a GPU);
        started at the iteration's start, stopped by the hook at the last bucket.
    """

    process_group: "dist.ProcessGroup | None" = None
    weight: float = 1.0
    pace: Callable[[float, int], float] | None = None
    batch_size: int = 1
    timer: ComputeTimer = field(default_factory=ComputeTimer)

    def begin(self) -> None:
        """The iteration starts now (its batch is in hand)."""
        self.timer.start()

    @property
    def ready_s(self) -> float | None:
        """Seconds from `begin()` to the local gradients being ready; None until the hook
        has seen the last bucket."""
        return self.timer.seconds() if self.timer.stopped else None


def weighted_allreduce_hook(
    state: WeightedState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Register with `ddp_model.register_comm_hook(state, weighted_allreduce_hook)`."""
    if bucket.is_last():
        if state.pace is not None:
            elapsed = state.timer.elapsed_now()
            remaining = state.pace(elapsed, state.batch_size) - elapsed
            if remaining > 0:
                time.sleep(remaining)
            state.timer.stop(synchronize_now=True)
        else:
            state.timer.stop()
    tensor = bucket.buffer()
    tensor.mul_(state.weight)
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    assert work is not None
    summed: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return summed
