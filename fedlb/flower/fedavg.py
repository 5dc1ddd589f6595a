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

    Args (FedAvg's, same order and defaults):
        fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes,
        min_available_nodes, weighted_by_key, arrayrecord_key, configrecord_key,
        train_metrics_aggr_fn, evaluate_metrics_aggr_fn: as in FedAvg. The metric
            aggregation functions see the app's own metrics (fedlb's keys taken out).
    Args (fedlb's, keyword only): as `LoadBalanced`'s.
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
