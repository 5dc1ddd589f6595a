"""fedlb.experiments: emulated workers and clocks, what-if runs, policy comparisons."""

from .clocks import GpuLikeTime, LinearTime, TimeModel, ideal_split, round_time
from .whatif import CLOCK as WHATIF_CLOCK
from .whatif import WhatIfRound, what_if

__all__ = [
    "WHATIF_CLOCK",
    "GpuLikeTime",
    "LinearTime",
    "TimeModel",
    "WhatIfRound",
    "ideal_split",
    "round_time",
    "what_if",
]
