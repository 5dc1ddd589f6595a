"""Cluster policies by name: the one table of `fedlb cluster`, cluster scenarios and the
manager service. Each is a tuner and an estimator from fedlb.balance's table, and whether
sizes travel blocking (CPUs) or one iteration late (GPUs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fedlb.balance import SpeedEstimator, Tuner, make_estimator, make_tuner


@dataclass(frozen=True)
class ClusterPolicy:
    description: str
    tuner: str  # a name in fedlb.balance.TUNERS
    estimator: str = "ema"  # a name in fedlb.balance.ESTIMATORS
    asynchronous: bool = False  # sizes apply one iteration late (the exchange overlaps)

    def make_tuner(self) -> Tuner:
        return make_tuner(self.tuner)

    def make_estimator(self, narx_warmup: int | None = None) -> Callable[[], SpeedEstimator]:
        return make_estimator(self.estimator, narx_warmup)


CLUSTER_POLICIES = {
    "bsp": ClusterPolicy("uniform batches: plain BSP", "static"),
    "lb-ema": ClusterPolicy("LB-BSP on CPUs with EMA speeds, blocking exchange", "proportional"),
    "lb-narx": ClusterPolicy(
        "LB-BSP on CPUs with NARX speeds (EMA until its warm-up ends)", "proportional", "narx"
    ),
    "lb-gpu": ClusterPolicy(
        "leader/straggler tuning on a GPU-like time curve, sizes one iteration late",
        "leader-straggler",
        asynchronous=True,
    ),
    "deadband": ClusterPolicy("the dynamic-batching controller", "deadband"),
}
DEFAULT_CLUSTER_POLICY = "lb-ema"
