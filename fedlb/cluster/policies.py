"""Cluster policies by name: the one table of `fedlb cluster`, cluster scenarios and the
manager service. A balancing policy (engine `bsp`: BSP with LoadBalancer) is a tuner and
an estimator from fedlb.balance's table, and whether sizes travel blocking (CPUs) or one
iteration late (GPUs). The straggler schemes the papers compare against run on engines of
their own: `ps` (a parameter server on torch.distributed.rpc: asp, ssp:S, backup:K),
`eager` (eager-SGD's partial all-reduce) and `local` (local SGD's periodic averaging). A
policy with a parameter is written NAME:VALUE (`ssp:3`, `backup:2`); without one it takes
its default."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fedlb.balance import SpeedEstimator, Tuner, defaults, make_estimator, make_tuner


@dataclass(frozen=True)
class ClusterPolicy:
    description: str
    tuner: str = "static"  # a name in fedlb.balance.TUNERS
    estimator: str = "ema"  # a name in fedlb.balance.ESTIMATORS
    asynchronous: bool = False  # sizes apply one iteration late (the exchange overlaps)
    engine: str = "bsp"  # bsp (LoadBalancer), ps (parameter server), eager, local, orchestra
    parameter: int | None = None  # the default of NAME:VALUE (ssp's bound, backup's k)
    when: str = ""  # when a user would pick it (fedlb cluster --help, docs)

    def make_tuner(self) -> Tuner:
        return make_tuner(self.tuner)

    def make_estimator(self, narx_warmup: int | None = None) -> Callable[[], SpeedEstimator]:
        return make_estimator(self.estimator, narx_warmup)


CLUSTER_POLICIES = {
    "bsp": ClusterPolicy("uniform batches: plain BSP", "static"),
    "lb": ClusterPolicy(
        f"LB-BSP with fedlb's default controller ({defaults.controller()}), blocking exchange",
        defaults.TUNER,
        defaults.ESTIMATOR,
    ),
    "lb-curve": ClusterPolicy(
        "LB-BSP on measured step-time curves where one speed is wrong (GPUs, CPU floors), "
        "blocking exchange",
        "curve",
        defaults.ESTIMATOR,
    ),
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
    "asp": ClusterPolicy(
        "asynchronous parallel: workers push gradients to a parameter server and pull its "
        "weights, no barrier",
        engine="ps",
    ),
    "ssp": ClusterPolicy(
        "stale synchronous parallel: as asp, but no worker runs more than S iterations "
        "ahead of the slowest (ssp:S, default 5)",
        engine="ps",
        parameter=5,
    ),
    "backup": ClusterPolicy(
        "synchronous SGD with K backup workers: each update averages the first n-K "
        "gradients to arrive and drops the rest (backup:K, default 1)",
        engine="ps",
        parameter=1,
    ),
    "eager-solo": ClusterPolicy(
        "eager-SGD: the first rank ready starts the all-reduce; the others add what they "
        "have and send the rest later",
        engine="eager",
    ),
    "eager-majority": ClusterPolicy(
        "eager-SGD: a randomly drawn rank starts the all-reduce, so about half are ready",
        engine="eager",
    ),
    "local-sgd": ClusterPolicy(
        "local SGD: each worker takes H steps on its own replica, then the replicas are "
        "averaged (local-sgd:H, default 8)",
        engine="local",
        parameter=8,
    ),
    "orchestra": ClusterPolicy(
        "Orchestra: local SGD with each worker's local steps set so all reach the barrier "
        "together; the barrier from an LCM search (local steps at most M apart: "
        "orchestra:M, default 4) moved by an actor-critic agent",
        engine="orchestra",
        parameter=4,
    ),
    "orchestra-paper": ClusterPolicy(
        "Orchestra with the paper's reward (each round's rate against the best so far, "
        "where fedlb's orchestra uses a moving baseline): orchestra-paper:M",
        engine="orchestra",
        parameter=4,
    ),
}
DEFAULT_CLUSTER_POLICY = "lb"  # fedlb.balance.defaults' controller, as in FL
BALANCING_POLICIES = tuple(n for n, p in CLUSTER_POLICIES.items() if p.engine == "bsp")


def parse_policy(text: str) -> tuple[str, ClusterPolicy, int | None]:
    """'ssp:3' -> ('ssp', its policy, 3); a name without a value takes the default.
    Raises ValueError, naming the choices, for an unknown name or a bad value."""
    name, colon, value = text.strip().partition(":")
    policy = CLUSTER_POLICIES.get(name)
    if policy is None:
        raise ValueError(f"policy must be one of {', '.join(CLUSTER_POLICIES)}, got {text!r}")
    if not colon:
        return name, policy, policy.parameter
    if policy.parameter is None:
        raise ValueError(f"policy {name} takes no value, got {text!r}")
    try:
        number = int(value)
    except ValueError as error:
        raise ValueError(f"policy {name}:VALUE needs a whole number, got {text!r}") from error
    # a bound of 0 is valid; the others count
    low = 0 if name in ("ssp", "orchestra", "orchestra-paper") else 1
    if number < low:
        raise ValueError(f"policy {text!r}: the value must be >= {low}")
    return name, policy, number
