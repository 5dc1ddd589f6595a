"""Tuners and speed estimators by name: the one table every entry point uses (run
settings, `fedlb tune`, cluster runs, the manager service)."""

from __future__ import annotations

from collections.abc import Callable

from .curved import CurvePooled
from .defaults import ESTIMATOR, TUNER
from .estimators import EMA, ChangePointMean, Memoryless, SpeedEstimator
from .leader import LeaderStraggler
from .narx import NARX
from .pooled import PooledProportional
from .tuners import Deadband, Proportional, Static, Tuner

# name -> what it is (for help texts and errors)
TUNERS = {
    "pooled": "LB-BSP Algorithm 1 on speeds pooled across workers the reports cannot tell apart",
    "curve": "pooled, on measured step-time curves once one speed is shown wrong (GPUs)",
    "proportional": "LB-BSP Algorithm 1 as is: B_i ∝ v_i in one step",
    "deadband": "the dynamic-batching controller: B_i ← B_i·t̄/t_i beyond a 5% dead-band",
    "leader-straggler": "LB-BSP Algorithm 2 (GPUs): move Δ samples from straggler to leader",
    "static": "no tuning: every worker keeps B0 (plain FedAvg / BSP)",
}
ESTIMATORS = {
    "change-point": "the mean speed since the last significant change",
    "ema": "exponential moving average, α = 0.2 (the LB-BSP paper's)",
    "ema-restart": "EMA (α = 0.2) restarting on a lasting change",
    "memoryless": "the last measured speed",
    "narx": "NARX network on speeds and CPU/memory use (EMA during its 500-step warm-up)",
}


def choices(table: dict[str, str], default: str | None = None) -> str:
    """The names of `table` for a help text or an error, `default` marked."""
    return ", ".join(f"{name} (default)" if name == default else name for name in table)


def unknown(kind: str, name: str, table: dict[str, str]) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}; choose from {', '.join(table)}")


def make_tuner(
    name: str, min_batch: int = 1, max_batch: int | None = None, min_share: float = 0.0
) -> Tuner:
    """A fresh tuner by name; the bounds apply to the tuners that take them."""
    if name == "pooled":
        return PooledProportional(min_batch=min_batch, max_batch=max_batch, min_share=min_share)
    if name == "curve":
        return CurvePooled(min_batch=min_batch, max_batch=max_batch, min_share=min_share)
    if name == "proportional":
        return Proportional(min_batch=min_batch, max_batch=max_batch)
    if name == "deadband":
        return Deadband(min_batch=min_batch, max_batch=max_batch)
    if name == "leader-straggler":
        return LeaderStraggler()
    if name == "static":
        return Static()
    raise unknown("tuner", name, TUNERS)


def make_estimator(name: str, warmup: int | None = None) -> Callable[[], SpeedEstimator]:
    """A factory of fresh estimators (one per worker) by name; `warmup`: NARX's (None:
    its default)."""
    if name == "change-point":
        return ChangePointMean
    if name == "ema":
        return EMA
    if name == "ema-restart":
        return lambda: EMA(alpha=0.2, restart_threshold=0.25, restart_after=2)
    if name == "memoryless":
        return Memoryless
    if name == "narx":
        return NARX if warmup is None else lambda: NARX(warmup=warmup)
    raise unknown("estimator", name, ESTIMATORS)


def default_tuner() -> Tuner:
    """A fresh default tuner (fedlb.balance.defaults)."""
    return make_tuner(TUNER)


def default_estimator() -> SpeedEstimator:
    """A fresh default speed estimator (fedlb.balance.defaults)."""
    return make_estimator(ESTIMATOR)()
