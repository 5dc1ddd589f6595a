"""What `LoadBalanced` wraps, and how fedlb stays out of the wrapped strategy's sight.

Flower composes strategies by wrapping (its DP wrappers hold a `strategy` and delegate
each hook to it); `LoadBalanced` does the same. This module holds what that needs beside
the round itself: which strategies can be wrapped (and one sentence for those that
cannot), the wrapped chain's own settings (its weighting key, how many silos it waits
for), the replies as a stock run would hand them over (fedlb's metric keys taken out), the
model kept in the app's dtypes when a server optimizer upcasts it, and which loop drives
fedlb's hooks (its own `start`, a subclass's, or an outer strategy's).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
from flwr.app import Array, ArrayRecord, Message
from flwr.serverapp.strategy import FedAvg, FedXgbBagging, FedXgbCyclic, Strategy

from .protocol import PREFIX, user_metrics

# Flower's legacy strategy API (flwr.server.strategy), which its SecAgg+ workflow and
# LegacyContext still call: `LoadBalanced` is a strategy of the Message API.
LEGACY_HOOKS = frozenset(
    {"initialize_parameters", "configure_fit", "aggregate_fit", "evaluate", "num_fit_clients"}
)
BALANCES = "_fedlb_balances"  # class attribute of a strategy that balances (LoadBalanced)
WRAPS = "strategy"  # the attribute a wrapper holds its strategy in (Flower's DP wrappers too)

# Strategies whose training has no batch size for fedlb to tune, and why.
NOTHING_TO_BALANCE: dict[type, str] = {
    FedXgbBagging: "it boosts XGBoost trees, which are not trained in batches of samples",
    FedXgbCyclic: "it trains one silo per round, so no silo waits for another",
}


def legacy_refusal(name: str) -> str:
    """Why `LoadBalanced` has no `name`, a hook of Flower's legacy strategy API."""
    return (
        f"LoadBalanced has no {name}(): it wraps strategies of Flower's Message API "
        "(flwr.serverapp.strategy), and Flower 1.42 runs its SecAgg+ workflow "
        "(SecAggPlusWorkflow over LegacyContext) only with legacy strategies "
        "(flwr.server.strategy), whose replies fedlb cannot read; run the federation "
        "without SecAgg+ (fedlb's own secure aggregation is CKKS: "
        "LoadBalanced(FedAvg(...), he=EncryptedAggregation...)), or SecAgg+ without fedlb"
    )


def chain(strategy: Strategy) -> list[Strategy]:
    """`strategy` and the strategies it wraps, outermost first."""
    found = [strategy]
    while isinstance(inner := getattr(found[-1], WRAPS, None), Strategy):
        if any(inner is s for s in found):
            break
        found.append(inner)
    return found


def innermost(strategy: Strategy) -> Strategy:
    """The strategy at the bottom of a wrapper chain: the one that aggregates."""
    return chain(strategy)[-1]


def weighting_key(strategy: Strategy) -> str:
    """The MetricRecord key the wrapped strategy weights replies by (FedAvg's
    `weighted_by_key`; "num-examples", Flower's default, where it names none)."""
    key = getattr(innermost(strategy), "weighted_by_key", None)
    return key if isinstance(key, str) else "num-examples"


def _count(strategy: Strategy, name: str, default: int) -> int:
    value = getattr(innermost(strategy), name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def silos_expected(strategy: Strategy) -> int:
    """How many silos the wrapped strategy waits for before round 1 (FedAvg's
    `min_available_nodes`; 2, Flower's default, where it names none)."""
    return _count(strategy, "min_available_nodes", 2)


def silos_needed(strategy: Strategy) -> int:
    """How many silos the wrapped strategy waits for before it samples a round: FedAvg
    waits until as many are online as its `min_available_nodes` and `min_train_nodes`."""
    return max(silos_expected(strategy), _count(strategy, "min_train_nodes", 2))


MINIMUMS = ("min_available_nodes", "min_train_nodes", "min_evaluate_nodes")  # FedAvg's


@contextmanager
def at_most(strategy: Strategy, count: int) -> Iterator[dict[str, int]]:
    """For one call, the wrapped strategy's minimum numbers of silos (FedAvg's
    `min_available_nodes`, `min_train_nodes`, `min_evaluate_nodes`) no higher than
    `count`, the silos taking part: once a run has started, a silo that left does not
    hold every later round up (FedAvg would wait for it for ever); yields those lowered,
    with the value each had."""
    inner = innermost(strategy)
    lowered: dict[str, int] = {}
    for name in MINIMUMS:
        value = getattr(inner, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > count:
            lowered[name] = value
            setattr(inner, name, count)
    try:
        yield lowered
    finally:
        for name, value in lowered.items():
            setattr(inner, name, value)


def check_wrappable(strategy: object, encrypted: bool) -> None:
    """Refuse, with one sentence saying why and what to do, a strategy fedlb cannot
    balance: not a Message-API strategy, one already balanced, one with nothing to
    balance, or (under HE) one that must read plaintext updates to aggregate them."""
    if not isinstance(strategy, Strategy):
        name = type(strategy).__name__
        if any(hasattr(strategy, hook) for hook in LEGACY_HOOKS):
            raise TypeError(
                f"{name} is a strategy of Flower's legacy API (flwr.server.strategy): "
                "LoadBalanced wraps strategies of the Message API; use its counterpart "
                "from flwr.serverapp.strategy (e.g. LoadBalanced(FedAvg(...))). Flower "
                "1.42's SecAgg+ workflow runs only legacy strategies: fedlb does not balance "
                "under SecAgg+ (its own secure aggregation is CKKS, he=)"
            )
        raise TypeError(
            f"LoadBalanced wraps a flwr.serverapp.strategy.Strategy, got {name}: "
            "e.g. LoadBalanced(FedAvg(...))"
        )
    for part in chain(strategy):
        if getattr(type(part), BALANCES, False):
            raise ValueError(
                f"{type(strategy).__name__} is balanced already (it holds "
                f"{type(part).__name__}): wrap the strategy once, outermost: "
                "LoadBalanced(DifferentialPrivacy...(FedAvg(...)))"
            )
        for kind, why in NOTHING_TO_BALANCE.items():
            if isinstance(part, kind):
                raise ValueError(
                    f"{type(part).__name__} cannot be load-balanced: {why}; run it as it is"
                )
    if encrypted and type(strategy).aggregate_train is not FedAvg.aggregate_train:
        raise ValueError(
            f"under HE the server averages ciphertexts itself, so it can wrap only a strategy "
            f"that aggregates as FedAvg does (FedAvg, FedProx, a subclass keeping FedAvg's "
            f"aggregate_train); {type(strategy).__name__}.aggregate_train would need the "
            "plaintext updates: run it without he=, or FedAvg under HE"
        )


def as_stock(reply: Message) -> Message:
    """`reply` as a stock run would hand it to the strategy: fedlb's metric keys taken out
    of its MetricRecords (in place; fedlb has read them by then)."""
    if reply.has_error() or not reply.has_content():
        return reply
    for name, metrics in list(reply.content.metric_records.items()):
        if any(key.startswith(PREFIX) for key in metrics):
            reply.content[name] = user_metrics(metrics)
    return reply


def dtypes_of(arrays: ArrayRecord) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each array's shape and dtype, by key."""
    return {key: (tuple(a.shape), str(a.dtype)) for key, a in arrays.items()}


def in_dtypes(
    arrays: ArrayRecord, sent: Mapping[str, tuple[tuple[int, ...], str]]
) -> tuple[ArrayRecord, list[str]]:
    """(`arrays` with each floating-point array of the sent model's shape in the sent
    dtype, "key: float64 -> float32" for each one cast). A server optimizer computing in
    float64 (FedAdam's numpy step) gives back float64: the model the silos get stays in
    the app's dtype, as the app's own `load_state_dict` would make it anyway."""
    cast: list[str] = []
    out: dict[str, Array] = {}
    for key, array in arrays.items():
        want = sent.get(key)
        if (
            want is not None
            and tuple(array.shape) == want[0]
            and str(array.dtype) != want[1]
            and np.issubdtype(np.dtype(want[1]), np.floating)
            and np.issubdtype(np.dtype(str(array.dtype)), np.floating)
        ):
            out[key] = Array(np.ascontiguousarray(array.numpy().astype(want[1])))
            cast.append(f"{key}: {array.dtype} -> {want[1]}")
        else:
            out[key] = array
    return (ArrayRecord(out) if cast else arrays), cast


def outer_strategy(own: Strategy, depth: int = 12) -> Strategy | None:
    """The strategy whose hook called one of `own`'s (an outer wrapper such as
    `DifferentialPrivacyServerSideFixedClipping(LoadBalanced(...))`), read off the
    caller's frames; None where the caller is `own` itself (a subclass's own `start`) or
    no strategy at all (a loop of the app's own)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, Strategy) and caller is not own:
            return caller
        if caller is own and frame.f_code.co_name == "start":
            return None
    return None


def refuse_mixing(cls: type, balanced: type) -> None:
    """A subclass of `balanced` (LoadBalanced) that also inherits from a Flower strategy
    (`class S(LoadBalancedFedAvg, FedProx)`, either order) is refused when it is defined:
    the wrapper would never call that strategy's hooks."""
    mixed = [
        base
        for base in cls.__mro__
        if issubclass(base, Strategy)
        and base is not Strategy
        and not getattr(base, BALANCES, False)
    ]
    if mixed:
        name = mixed[0].__name__
        raise TypeError(
            f"{cls.__name__} inherits from both {balanced.__name__} and {name}: fedlb wraps a "
            f"strategy instead of mixing with it; subclass {name} alone and wrap it: "
            f"LoadBalanced({name}(...)), e.g. LoadBalanced(FedProx(proximal_mu=0.1))"
        )
