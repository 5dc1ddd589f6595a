"""Batch-size-weighted gradient aggregation as a DDP communication hook.

Each rank's gradient g_r is the mean over its x_r samples; the hook scales its bucket by
x_r / X and the all-reduce sums them: g = Σ x_r g_r / X, the mean over all X samples, so
every sample counts the same whatever batch each rank drew (LB-BSP Section 3.4). DDP's
default hook divides by the world size instead, which overweights the samples of ranks with
small batches once sizes differ.

The hook also marks when a rank's local gradients are all ready (the last bucket): the
compute time the balancer needs, without the wait for slower ranks that follows. Where a
rank emulates a slower machine, the last bucket is held back until the emulated compute
time has passed (sleep padding: the `measured` clock).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations against
# the real dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # what DDP passes to comm hooks


@dataclass
class WeightedState:
    """What the hook needs; the coordinator updates it at every iteration boundary.

    weight: x_r / X for this rank's current batch.
    started: perf_counter() when this rank's iteration began.
    pace: emulation, (real seconds, batch size) -> seconds the iteration must take; None:
        real speed.
    batch_size: this rank's current batch (for `pace`).
    ready_s: set by the hook: seconds from `started` to the local gradients being ready.
    """

    process_group: "dist.ProcessGroup | None" = None
    weight: float = 1.0
    started: float = 0.0
    pace: Callable[[float, int], float] | None = None
    batch_size: int = 1
    ready_s: float | None = None


def weighted_allreduce_hook(
    state: WeightedState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Register with `ddp_model.register_comm_hook(state, weighted_allreduce_hook)`."""
    if bucket.is_last():
        elapsed = time.perf_counter() - state.started
        if state.pace is not None:
            remaining = state.pace(elapsed, state.batch_size) - elapsed
            if remaining > 0:
                time.sleep(remaining)
        state.ready_s = time.perf_counter() - state.started
    tensor = bucket.buffer()
    tensor.mul_(state.weight)
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    assert work is not None
    summed: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return summed
