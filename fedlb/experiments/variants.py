"""The FL variants fedlb compares against but does not deploy: tuning τ instead of B,
scaling η with B, and keeping only a quorum of the fastest updates. Each is a small
override of LoadBalancedFedAvg's hooks; the deployment strategy knows none of them."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from flwr.app import ConfigRecord, Message

from fedlb.balance import WorkerReport
from fedlb.flower import LoadBalancedFedAvg
from fedlb.flower.protocol import COMPUTE_S, LEARNING_RATE, OVERHEAD_S, Orders, SiloReport, numbers


class StepsTunedFedAvg(LoadBalancedFedAvg):
    """τ_i tuned per silo with B fixed at B0 (the Orchestra/FedCompass family, which the
    LB-BSP paper rejects: fast silos take more local steps and bias the model). The
    balancer's load unit is one step of B0 samples. Needs `batch_size` and `local_steps`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.batch_size is None or self.local_steps is None:
            raise ValueError("tuning τ needs batch_size and local_steps")

    def _orders(self, server_round: int, node: int) -> Orders:
        size = self.balance.size_of(node)
        steps = self.local_steps if size is None else size
        return Orders(server_round, batch_size=self.batch_size, local_steps=steps)

    def _load_report(self, node: int, report: SiloReport) -> WorkerReport:
        # the load unit is one step: the round's steps, run as one "iteration"
        return replace(report.worker_report(node), batch_size=report.local_steps, iterations=1)

    def _initial_load(self, report: SiloReport) -> int:
        return report.local_steps


class ScaledLrFedAvg(LoadBalancedFedAvg):
    """B tuned and η_i = η·B_i/B0 (the paper's other rejected variant: fast silos' data
    gain a bigger say). Scales fedlb's silo app's `learning-rate`; needs `batch_size`."""

    def _node_config(self, node: int, orders: Orders, config: ConfigRecord) -> ConfigRecord:
        out = super()._node_config(node, orders, config)
        if orders.batch_size is not None and self.batch_size and LEARNING_RATE in out:
            rate = out[LEARNING_RATE]
            assert isinstance(rate, (int, float))
            out[LEARNING_RATE] = float(rate) * orders.batch_size / self.batch_size
        return out


class QuorumFedAvg(LoadBalancedFedAvg):
    """Aggregate only the fastest ⌈quorum·n⌉ updates of each round, by the busy time each
    silo reports (the majority idea of eager-SGD / backup workers); the round lasts as
    long as the slowest kept one."""

    def __init__(self, quorum: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0 < quorum <= 1:
            raise ValueError(f"quorum must be a fraction in (0, 1], got {quorum}")
        self.quorum = quorum

    def _keep(self, server_round: int, valid: list[Message]) -> list[Message]:
        def busy(msg: Message) -> float:
            values = numbers(next(iter(msg.content.metric_records.values())))
            return values.get(COMPUTE_S, math.inf) + values.get(OVERHEAD_S, 0.0)

        keep = max(1, math.ceil(self.quorum * len(self.balance.sent)))
        return sorted(sorted(valid, key=busy)[:keep], key=lambda m: m.metadata.src_node_id)
