"""LoadBalanced around every strategy of Flower 1.42's `flwr.serverapp.strategy`: each one
either balanced, keeping its own behaviour, or refused with one sentence saying why and
what to do (docs/strategies.md).

Each row runs the real Flower class, unchanged, on three silos at speeds 4 : 2 : 1 (the
model clock: fedlb's silo app, Flower's messages in-process, tests/flower_fakes.py), and
checks: the run completes; from round 2 the sizes follow the speeds with X and τ kept;
the wrapped strategy's hooks ran every round and saw the replies a stock run would give
it (no fedlb key in them, the model's own arrays, unpacked); its behaviour is kept (the
check per row)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    Bulyan,
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedXgbBagging,
    FedXgbCyclic,
    FedYogi,
    Krum,
    MultiKrum,
    QFedAvg,
    Strategy,
)
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedlb.flower import Balancing, LoadBalanced, LoadBalancedFedAvg
from fedlb.flower.packing import PACKED
from fedlb.flower.protocol import LOCAL_STEPS, PREFIX, TRAIN_LOSS
from fedlb.flower.strategy import NoUsableUpdateError
from tests.flower_fakes import InProcessGrid, fedlb_app
from tests.strategy_helpers import make_grid, model_clock, run_config, sent_sizes, start

pytestmark = pytest.mark.usefixtures("task_identity")

ROUNDS = 4
B0, TAU = 16, 3
KEY_CLIPPING_NORM = "clipping_norm"  # flwr.supercore.differential_privacy's key


class Spy:
    """Wraps a strategy's aggregate_train to note what it was handed, round by round: each
    reply's metric keys and array keys (as handed: FedMedian pops the arrays it reads)."""

    def __init__(self, strategy: Strategy) -> None:
        self.rounds: list[list[tuple[list[str], list[str]]]] = []
        inner = strategy.aggregate_train

        def aggregate_train(server_round: int, replies: Iterable[Message]) -> Any:
            replies = list(replies)
            self.rounds.append(
                [
                    (
                        [k for m in r.content.metric_records.values() for k in m],
                        [k for a in r.content.array_records.values() for k in a],
                    )
                    for r in replies
                ]
            )
            return inner(server_round, replies)

        strategy.aggregate_train = aggregate_train  # type: ignore[method-assign]


class OwnAggregation(FedAvg):
    """A deployment's own FedAvg subclass: its own config key, and an aggregate_train of
    its own that never calls super() (an unweighted mean of the updates)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.aggregations = 0

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        config["own-round-tag"] = f"round {server_round}"
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self.aggregations += 1
        contents = [m.content for m in replies if not m.has_error()]
        for content in contents:
            content["metrics"]["num-examples"] = 1  # every silo the same say
        return aggregate_arrayrecords(contents, "num-examples"), MetricRecord({"own": 1.0})


def fedavg_args() -> dict[str, Any]:
    return {"min_available_nodes": 3, "min_train_nodes": 3, "min_evaluate_nodes": 3}


def innermost_of(strategy: Strategy) -> Strategy:
    while isinstance(getattr(strategy, "strategy", None), Strategy):
        strategy = strategy.strategy  # type: ignore[attr-defined]
    return strategy


# name -> (the strategy to wrap, the ClientApp's extra mods, its own check)
Check = Callable[[Strategy, InProcessGrid], None]


def every_train_config_has(key: str) -> Check:
    def check(strategy: Strategy, grid: InProcessGrid) -> None:
        train = [m for m in grid.sent if m.metadata.message_type == "train"]
        assert train
        assert all(key in m.content["config"] for m in train), key

    return check


def optimizer_state(strategy: Strategy, grid: InProcessGrid) -> None:
    inner = innermost_of(strategy)
    assert inner.m_t is not None  # type: ignore[attr-defined]
    if not isinstance(inner, FedAvgM):
        assert inner.v_t is not None  # type: ignore[attr-defined]


def momentum(strategy: Strategy, grid: InProcessGrid) -> None:
    assert innermost_of(strategy).momentum_vector is not None  # type: ignore[attr-defined]


def clipping_norm_adapted(strategy: Strategy, grid: InProcessGrid) -> None:
    assert strategy.strategy.clipping_norm != 0.1  # type: ignore[attr-defined]


def own_aggregation(strategy: Strategy, grid: InProcessGrid) -> None:
    assert innermost_of(strategy).aggregations == ROUNDS  # type: ignore[attr-defined]
    every_train_config_has("own-round-tag")(strategy, grid)


def nothing(strategy: Strategy, grid: InProcessGrid) -> None:
    pass


def dp(wrapper: type, **kwargs: Any) -> Strategy:
    return wrapper(FedAvg(**fedavg_args()), noise_multiplier=0.0, num_sampled_clients=3, **kwargs)


ROWS: dict[str, tuple[Callable[[], Strategy], tuple[Any, ...], Check]] = {
    "FedAvg": (lambda: FedAvg(**fedavg_args()), (), nothing),
    "FedProx": (
        lambda: FedProx(proximal_mu=0.1, **fedavg_args()),
        (),
        every_train_config_has("proximal-mu"),
    ),
    "FedAdam": (lambda: FedAdam(eta=0.01, **fedavg_args()), (), optimizer_state),
    "FedYogi": (lambda: FedYogi(eta=0.01, **fedavg_args()), (), optimizer_state),
    "FedAdagrad": (lambda: FedAdagrad(eta=0.01, **fedavg_args()), (), optimizer_state),
    "FedAvgM": (lambda: FedAvgM(server_momentum=0.5, **fedavg_args()), (), momentum),
    "QFedAvg": (
        lambda: QFedAvg(client_learning_rate=0.1, train_loss_key=TRAIN_LOSS, **fedavg_args()),
        (),
        nothing,
    ),
    "FedMedian": (lambda: FedMedian(**fedavg_args()), (), nothing),
    "FedTrimmedAvg": (lambda: FedTrimmedAvg(beta=0.2, **fedavg_args()), (), nothing),
    "Krum": (lambda: Krum(num_malicious_nodes=0, **fedavg_args()), (), nothing),
    "MultiKrum": (
        lambda: MultiKrum(num_malicious_nodes=0, num_nodes_to_select=2, **fedavg_args()),
        (),
        nothing,
    ),
    "Bulyan": (lambda: Bulyan(num_malicious_nodes=0, **fedavg_args()), (), nothing),
    "DP server-side fixed clipping": (
        lambda: dp(DifferentialPrivacyServerSideFixedClipping, clipping_norm=10.0),
        (),
        nothing,
    ),
    "DP client-side fixed clipping": (
        lambda: dp(DifferentialPrivacyClientSideFixedClipping, clipping_norm=10.0),
        (fixedclipping_mod,),
        every_train_config_has(KEY_CLIPPING_NORM),
    ),
    "DP server-side adaptive clipping": (
        lambda: dp(DifferentialPrivacyServerSideAdaptiveClipping),
        (),
        clipping_norm_adapted,
    ),
    "DP client-side adaptive clipping": (
        lambda: dp(DifferentialPrivacyClientSideAdaptiveClipping),
        (adaptiveclipping_mod,),
        clipping_norm_adapted,
    ),
    "own configure_train and aggregate_train": (
        lambda: OwnAggregation(**fedavg_args()),
        (),
        own_aggregation,
    ),
}


def balanced_grid(mods: tuple[Any, ...]) -> InProcessGrid:
    """Three silos 4 : 2 : 1 on the model clock, with `mods` outside balance_mod."""
    grid = make_grid()
    if mods:
        grid = InProcessGrid(grid.nodes, run_config(), fedlb_app(*mods, clock=model_clock))
    return grid


def check_balanced(grid: InProcessGrid) -> None:
    """Round 1 at every silo's B0, round 2 the guard's look (every silo at its B0, the slow
    silos' steps cut); then sizes follow the speeds, X and τ kept."""
    sizes = sent_sizes(grid)
    assert len(sizes) == ROUNDS
    assert sizes[0] == {100: B0, 101: B0, 102: B0}
    for by_node in sizes:
        assert sum(by_node.values()) == 3 * B0  # X kept
    last = sizes[-1]
    assert last[100] > last[101] > last[102], last
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert sizes[1] == {100: B0, 101: B0, 102: B0}  # the look
    assert all(m.content["config"][LOCAL_STEPS] == TAU for m in train)  # τ kept


def check_stock_replies(spy: Spy, model: ArrayRecord) -> None:
    """What the wrapped strategy was handed: every round's replies, none holding a fedlb
    key or a packed model, each with the model's own arrays."""
    assert len(spy.rounds) == ROUNDS
    for replies in spy.rounds:
        assert len(replies) == 3
        for metric_keys, array_keys in replies:
            assert not [k for k in metric_keys if k.startswith(PREFIX)], metric_keys
            assert "num-examples" in metric_keys
            assert PACKED not in array_keys
            assert array_keys == list(model.keys())


@pytest.mark.parametrize("name", list(ROWS))
def test_every_flower_strategy_is_balanced_and_keeps_its_behaviour(name, caplog):
    make, mods, check = ROWS[name]
    inner = make()
    spy = Spy(innermost_of(inner))
    strategy = LoadBalanced(inner, balancing=Balancing(batch_size=B0, local_steps=TAU))
    grid = balanced_grid(mods)
    with caplog.at_level(logging.WARNING):
        result = start(strategy, grid, rounds=ROUNDS)
    assert result.arrays is not None
    assert all(np.all(np.isfinite(a.numpy())) for a in result.arrays.values())
    assert sorted(result.train_metrics_clientapp) == list(range(1, ROUNDS + 1))
    check_balanced(grid)
    check_stock_replies(spy, result.arrays)
    # the model stays in the app's dtypes, whatever the strategy computes in
    assert {str(a.dtype) for a in result.arrays.values()} == {"float32"}
    # the app's metrics, aggregated by the strategy, fedlb's round figures beside them
    metrics = result.train_metrics_clientapp[ROUNDS]
    assert {"fedlb.efficiency", "fedlb.round-s"} <= set(metrics)
    check(strategy, grid)
    assert not [r for r in caplog.records if "wraps LoadBalanced" in r.getMessage()]


def test_loadbalancedfedavg_is_loadbalanced_around_fedavg():
    strategy = LoadBalancedFedAvg(fraction_evaluate=0.5, min_available_nodes=3)
    assert isinstance(strategy, LoadBalanced)
    assert type(strategy.strategy) is FedAvg
    # FedAvg's attributes read and write through the wrapper
    assert strategy.fraction_evaluate == 0.5
    strategy.fraction_train = 0.5
    assert strategy.strategy.fraction_train == 0.5


def test_an_attribute_set_on_the_wrapper_reaches_the_wrapped_strategy():
    """The issue's FedProx case: `proximal_mu` set as an attribute must reach the messages."""
    strategy = LoadBalanced(
        FedProx(proximal_mu=0.0, **fedavg_args()),
        balancing=Balancing(batch_size=B0, local_steps=TAU),
    )
    strategy.proximal_mu = 0.25
    grid = make_grid()
    start(strategy, grid, rounds=2)
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert {m.content["config"]["proximal-mu"] for m in train} == {0.25}


def test_dp_outside_fedlb_still_balances_and_says_to_put_fedlb_outermost(caplog):
    inner = LoadBalanced(
        FedAvg(**fedavg_args()), balancing=Balancing(batch_size=B0, local_steps=TAU)
    )
    strategy = DifferentialPrivacyServerSideFixedClipping(
        inner, noise_multiplier=0.0, clipping_norm=10.0, num_sampled_clients=3
    )
    grid = make_grid()
    with caplog.at_level(logging.WARNING):
        result = strategy.start(
            grid=grid,
            initial_arrays=start_arrays(),
            num_rounds=ROUNDS,
            timeout=30,
            train_config=ConfigRecord({"learning-rate": 0.1}),
        )
    assert result.arrays is not None
    check_balanced(grid)
    said = [r.getMessage() for r in caplog.records if "wraps LoadBalanced" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("fedlb: DifferentialPrivacyServerSideFixedClipping wraps")
    assert "LoadBalanced(DifferentialPrivacyServerSideFixedClipping(...))" in said[0]
    # the model travels unpacked: the outer strategy sees every reply before fedlb
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert not [m for m in train if PACKED in m.content["arrays"]]


def start_arrays() -> ArrayRecord:
    from fedlb.deploy import RunConfig
    from tests.strategy_helpers import initial_arrays

    return initial_arrays(RunConfig.from_mapping(run_config()))


def test_fedadams_float64_model_is_followed_and_sent_in_the_apps_dtype():
    """FedAdam's numpy step hands back float64: before, every later update was rejected as
    `float32[...], expected float64[...]` and the run went on with a frozen model."""
    strategy = LoadBalanced(FedAdam(eta=0.01, **fedavg_args()))
    grid = make_grid()
    result = start(strategy, grid, rounds=3)
    records = strategy.reporter.records
    assert [sorted(s.node for s in r.silos) for r in records] == [[100, 101, 102]] * 3
    assert not [f for r in records for f in r.failed]
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    dtypes = {str(a.dtype) for m in train for a in m.content["arrays"].values()}
    assert dtypes == {"float32"}
    assert result.arrays is not None


def test_a_run_without_a_usable_update_for_k_rounds_stops_non_zero():
    def poison(reply: Message) -> Message:
        if reply.has_content() and reply.content.array_records:
            (arrays,) = reply.content.array_records.values()
            for key in list(arrays.keys()):
                broken = arrays[key].numpy().copy()
                broken[...] = np.nan
                arrays[key] = type(arrays[key])(broken)
        return reply

    grid = make_grid()
    grid.intercept = poison
    strategy = LoadBalanced(FedAvg(**fedavg_args()), stop_after=2)
    with pytest.raises(NoUsableUpdateError, match="2 rounds in a row ended without a model"):
        start(strategy, grid, rounds=5)


def test_a_subclass_aggregating_without_fedlb_is_stopped_with_what_to_do():
    class Mine(LoadBalancedFedAvg):
        def aggregate_train(self, server_round, replies):
            contents = [m.content for m in replies if not m.has_error()]
            return aggregate_arrayrecords(contents, "num-examples"), None

    strategy = Mine(**fedavg_args())
    with pytest.raises(TypeError, match=r"Mine.aggregate_train did not call LoadBalanced"):
        start(strategy, make_grid(), rounds=3)


def test_a_stock_server_gets_no_fedlb_keys_from_balanced_silos():
    grid = make_grid()
    result = FedAvg(**fedavg_args()).start(
        grid=grid,
        initial_arrays=start_arrays(),
        num_rounds=2,
        timeout=30,
        train_config=ConfigRecord({"learning-rate": 0.1}),
    )
    for metrics in result.train_metrics_clientapp.values():
        assert not [k for k in metrics if k.startswith(PREFIX)], dict(metrics)
    assert result.train_metrics_clientapp


REFUSED = {
    "XGBoost bagging": (lambda: FedXgbBagging(), r"FedXgbBagging cannot be load-balanced"),
    "XGBoost cyclic": (
        lambda: FedXgbCyclic(),
        r"FedXgbCyclic cannot be load-balanced: it trains one",
    ),
    "balanced twice": (
        lambda: LoadBalanced(FedAvg()),
        r"balanced already .* wrap the strategy once, outermost",
    ),
    "balanced inside a DP wrapper": (
        lambda: DifferentialPrivacyServerSideFixedClipping(LoadBalanced(FedAvg()), 0.0, 1.0, 3),
        r"balanced already",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_cannot_be_balanced_is_refused_at_once_saying_why(name):
    make, why = REFUSED[name]
    with pytest.raises((TypeError, ValueError), match=why):
        LoadBalanced(make())


def test_a_legacy_strategy_is_refused_naming_the_message_api():
    from flwr.server.strategy import FedAvg as LegacyFedAvg

    with pytest.raises(TypeError, match=r"legacy API .* flwr.serverapp.strategy"):
        LoadBalanced(LegacyFedAvg())  # type: ignore[arg-type]


def test_mixing_fedlb_into_a_flower_strategy_by_inheritance_is_refused():
    with pytest.raises(TypeError, match=r"inherits from both .* LoadBalanced\(FedProx"):

        class Both(LoadBalancedFedAvg, FedProx):  # the first try
            pass

    with pytest.raises(TypeError, match=r"wrap it: LoadBalanced\(FedProx"):

        class Reversed(FedProx, LoadBalancedFedAvg):
            pass


def test_secagg_plus_is_refused_at_its_first_call_saying_why():
    from flwr.app import Context
    from flwr.server import LegacyContext
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    context = LegacyContext(
        Context(1, 0, {}, RecordDict(), {}),
        strategy=LoadBalanced(FedAvg()),  # type: ignore[arg-type]
    )
    workflow = DefaultWorkflow(
        fit_workflow=SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2)
    )
    with pytest.raises(AttributeError, match=r"SecAgg\+ workflow .* only with legacy strategies"):
        workflow(make_grid(), context)


def test_under_he_only_a_strategy_aggregating_as_fedavg_is_wrapped():
    he = object()  # the check needs no key: it refuses before anything is encrypted
    with pytest.raises(ValueError, match=r"under HE .* FedAdam.aggregate_train would need"):
        LoadBalanced(FedAdam(), he=he)  # type: ignore[arg-type]
    LoadBalanced(FedProx(proximal_mu=0.1), he=he)  # type: ignore[arg-type]


def test_round_numbers_the_wrapped_strategy_sees_are_the_runs():
    seen: list[int] = []

    class Counting(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            seen.append(server_round)
            return super().configure_train(server_round, arrays, config, grid)

    start(LoadBalanced(Counting(**fedavg_args())), make_grid(), rounds=3)
    assert seen == [1, 2, 3]


def test_a_silo_that_left_does_not_hold_the_strategys_later_rounds_up(caplog):
    """FedAvg waits until `min_available_nodes` silos are connected before it samples; once
    a run has started fedlb goes on with the silos present instead (the SuperLink no longer
    lists the one that left), lowering the minimums for the call and saying so once."""
    grid = make_grid()

    def leave(g: InProcessGrid) -> None:
        del g.nodes[102]

    grid.before_round[3] = leave
    strategy = LoadBalanced(FedAvg(**fedavg_args()), balancing=Balancing(batch_size=B0))
    with caplog.at_level(logging.WARNING):
        result = start(strategy, grid, rounds=4)
    assert result.arrays is not None
    sizes = sent_sizes(grid)
    assert [sorted(s) for s in sizes] == [[100, 101, 102]] * 2 + [[100, 101]] * 2
    said = [
        r.getMessage() for r in caplog.records if "fewer than FedAvg waits for" in r.getMessage()
    ]
    assert len(said) == 1
    assert "min_available_nodes 3" in said[0]
    assert innermost_of(strategy).min_available_nodes == 3  # the strategy's own setting back
