"""Local SGD (Stich, 2018): every worker takes τ SGD steps on its own replica, then the
replicas' weights are averaged, the baseline Orchestra improves on. PyTorch's own
`PeriodicModelAverager` does the averaging (an all-reduce of the parameters every τ steps):
nothing of fedlb's own but the bookkeeping. On unequal workers the average is a barrier, so
the slowest worker's τ steps set every round's pace.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters


class LocalSGD:
    """Call `step()` after every optimizer step of the rank's own (not DDP) model.

    Args:
        model: this rank's replica (the same initial weights on every rank).
        local_steps: τ, steps between averages (>= 1).
        group: the process group to average over (default: the whole job).
    """

    def __init__(
        self, model: nn.Module, local_steps: int, group: dist.ProcessGroup | None = None
    ) -> None:
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}")
        self.model = model
        self.local_steps = local_steps
        self.group = group
        # The averager averages on the calls whose count (from its `step`) is a multiple of
        # the period; starting it at 1 makes those our steps τ, 2τ, ... (not step 1).
        self._averager = PeriodicModelAverager(
            period=local_steps, warmup_steps=0, process_group=group
        )
        self._averager.step = 1
        self.steps = 0
        self.averages = 0

    def step(self) -> bool:
        """One local step done; True when the replicas were averaged after it."""
        self.steps += 1
        before = self._averager.step
        self._averager.average_parameters(self.model.parameters())
        averaged = before % self.local_steps == 0
        self.averages += averaged
        return averaged

    def finish(self) -> None:
        """Average once more unless the last step did: the job ends on one model."""
        if self.steps % self.local_steps:
            average_parameters(iter(self.model.parameters()), self._averager.process_group)
            self.averages += 1
