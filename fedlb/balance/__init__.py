"""fedlb.balance: speed estimators, batch-size tuners, the BatchSizeManager, ideal-time maths.

numpy only; torch is imported lazily when a NARX model trains. Knows nothing of Flower or
torch.distributed: both the federated strategy and the cluster coordinator drive it.
"""

from .estimators import (
    EMA,
    ChangePointMean,
    Evidence,
    Memoryless,
    Moments,
    NotReadyError,
    SpeedEstimator,
    default_estimator,
)
from .guard import StabilityGuard
from .ideal import (
    balance_efficiency,
    ideal_round_time,
    ideal_sizes,
    idle_fraction,
    modelled_round_time,
)
from .leader import LeaderStraggler
from .manager import BatchSizeManager
from .names import ESTIMATORS, TUNERS, make_estimator, make_tuner
from .narx import NARX
from .pooled import PooledProportional, default_tuner
from .reports import ReportError, WorkerReport
from .traces import Trace, competing_load_trace, prediction_rmse
from .tuners import (
    Deadband,
    Proportional,
    Static,
    Tuner,
    TuningInput,
)

__all__ = [
    "EMA",
    "ESTIMATORS",
    "NARX",
    "TUNERS",
    "BatchSizeManager",
    "ChangePointMean",
    "Deadband",
    "Evidence",
    "LeaderStraggler",
    "Memoryless",
    "Moments",
    "NotReadyError",
    "PooledProportional",
    "Proportional",
    "ReportError",
    "SpeedEstimator",
    "StabilityGuard",
    "Static",
    "Trace",
    "Tuner",
    "TuningInput",
    "WorkerReport",
    "balance_efficiency",
    "competing_load_trace",
    "default_estimator",
    "default_tuner",
    "ideal_round_time",
    "ideal_sizes",
    "idle_fraction",
    "make_estimator",
    "make_tuner",
    "modelled_round_time",
    "prediction_rmse",
]
