"""fedlb.balance: speed estimators, batch-size tuners, the BatchSizeManager, ideal-time maths.

numpy only; torch is imported lazily when a NARX model trains. Knows nothing of Flower or
torch.distributed: both the federated strategy and the cluster coordinator drive it.
`StepCurve` is a measured step-time curve (seconds of a step against B); T* and E take
workers on curves too (`curves=` of ideal_sizes, ideal_round_time, balance_efficiency).
`defaults` says what "default" means (tuner, estimator) for every entry point; `TUNERS` and
`ESTIMATORS` are the one table of their names. Where batch sizes cannot move (the edge of
stability), `steps_for_round` and `step_weights` are the second lever: fewer local steps
for the slow workers at their own batch size, updates normalized by their steps.
"""

from . import defaults
from .curved import CurvePooled
from .curves import StepCurve
from .estimators import EMA, ChangePointMean, Memoryless, SpeedEstimator
from .guard import StabilityGuard, Verdict
from .ideal import (
    balance_efficiency,
    ideal_round_time,
    ideal_sizes,
    idle_fraction,
)
from .leader import LeaderStraggler
from .manager import BatchSizeManager
from .names import (
    ESTIMATORS,
    TUNERS,
    choices,
    default_estimator,
    default_tuner,
    make_estimator,
    make_tuner,
)
from .narx import NARX
from .pooled import PooledProportional
from .reports import LONGEST_S, WorkerReport
from .steps import step_weights, steps_for_round
from .traces import competing_load_trace
from .tuners import (
    Deadband,
    Proportional,
    Static,
    Tuner,
)

__all__ = [
    "EMA",
    "ESTIMATORS",
    "LONGEST_S",
    "NARX",
    "TUNERS",
    "BatchSizeManager",
    "ChangePointMean",
    "CurvePooled",
    "Deadband",
    "LeaderStraggler",
    "Memoryless",
    "PooledProportional",
    "Proportional",
    "SpeedEstimator",
    "StabilityGuard",
    "Static",
    "StepCurve",
    "Tuner",
    "Verdict",
    "WorkerReport",
    "balance_efficiency",
    "choices",
    "competing_load_trace",
    "default_estimator",
    "default_tuner",
    "defaults",
    "ideal_round_time",
    "ideal_sizes",
    "idle_fraction",
    "make_estimator",
    "make_tuner",
    "step_weights",
    "steps_for_round",
]
