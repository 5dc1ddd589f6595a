"""LoadBalancedFedAvg: the three-line drop-in for Flower's FedAvg, `LoadBalanced(FedAvg(...))`
under FedAvg's own constructor."""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg

from .aggregation import MetricsAggregation
from .he import EncryptedAggregation
from .options import Balancing, Joining, Keeping
from .strategy import LoadBalanced


class LoadBalancedFedAvg(LoadBalanced):
    """FedAvg whose silos each get their own batch size: `LoadBalanced(FedAvg(...))` with
    FedAvg's arguments in FedAvg's order, so `FedAvg(` -> `LoadBalancedFedAvg(` is the
    whole change on the server. FedAvg's attributes (`fraction_train`, ...) read and
    write through it. Another strategy is wrapped, not inherited from:
    `LoadBalanced(FedProx(proximal_mu=0.1))`; a subclass of this class keeps working
    (advanced-pytorch's `CustomFedAvg` with its own `start()`), one that also inherits
    from a Flower strategy is refused, saying so.

    Args:
        fraction_train: FedAvg's: the share of available silos sampled to train each
            round. Default 1.0.
        fraction_evaluate: FedAvg's: the share sampled to evaluate. Default 1.0.
        min_train_nodes: FedAvg's: the fewest silos a training round samples. Default 2.
        min_evaluate_nodes: FedAvg's: the fewest an evaluation round samples. Default 2.
        min_available_nodes: FedAvg's: the silos to wait for before a round (and what
            `Joining` waits for by default). Default 2.
        weighted_by_key: FedAvg's: the reply metric an update is weighted by (the silo's
            example count, never the samples it processed). Default "num-examples".
        arrayrecord_key: FedAvg's: the key of the model's ArrayRecord. Default "arrays".
        configrecord_key: FedAvg's: the key of the ConfigRecord it sends. Default "config".
        train_metrics_aggr_fn: FedAvg's: aggregates the silos' train metrics, which it
            sees without fedlb's keys. Default None (a weighted average).
        evaluate_metrics_aggr_fn: FedAvg's: the same for evaluation metrics. Default None.
        balancing: fedlb's, keyword only, as `LoadBalanced`'s: how each silo's batch size
            is decided (`Balancing`).
        joining: which silos take part (`Joining`).
        keeping: what the run keeps (`Keeping`).
        evaluate_every: federated evaluation every k rounds and after the last. Default 1.
        evaluate_with_train: fedlb's own silo app only: evaluate inside the next train
            message. Default False.
        poll_interval: seconds between pulls of replies. Default 0.1; None keeps Flower's
            3 s.
        he: CKKS aggregation (`EncryptedAggregation`). Default None.
        pack_model: the model travels as one array to silos with `balance_mod()`.
            Default True.
        stop_after: rounds in a row without a usable update after which the run stops
            (`NoUsableUpdateError`). Default 3.

    Example:
        ```python
        from fedlb.flower import LoadBalancedFedAvg  # instead of Flower's FedAvg

        strategy = LoadBalancedFedAvg(fraction_evaluate=0.5)  # FedAvg's arguments
        result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=3)
        ```
    """

    def __init__(
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        train_metrics_aggr_fn: MetricsAggregation | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregation | None = None,
        *,
        balancing: Balancing = Balancing(),  # noqa: B008 (frozen: shared safely)
        joining: Joining = Joining(),  # noqa: B008
        keeping: Keeping = Keeping(),  # noqa: B008
        evaluate_every: int = 1,
        evaluate_with_train: bool = False,
        poll_interval: float | None = 0.1,
        he: EncryptedAggregation | None = None,
        pack_model: bool = True,
        stop_after: int = 3,
    ) -> None:
        super().__init__(
            FedAvg(
                fraction_train=fraction_train,
                fraction_evaluate=fraction_evaluate,
                min_train_nodes=min_train_nodes,
                min_evaluate_nodes=min_evaluate_nodes,
                min_available_nodes=min_available_nodes,
                weighted_by_key=weighted_by_key,
                arrayrecord_key=arrayrecord_key,
                configrecord_key=configrecord_key,
                train_metrics_aggr_fn=train_metrics_aggr_fn,
                evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
            ),
            balancing=balancing,
            joining=joining,
            keeping=keeping,
            evaluate_every=evaluate_every,
            evaluate_with_train=evaluate_with_train,
            poll_interval=poll_interval,
            he=he,
            pack_model=pack_model,
            stop_after=stop_after,
        )
