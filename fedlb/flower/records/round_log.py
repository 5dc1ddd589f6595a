"""A run's round records as the strategy fills them: opened when a round's training is
aggregated, completed by its evaluation (federated, or carried by the next round's train
replies, and the server's own), closed with the server's own seconds, then published."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
from flwr.app import ArrayRecord, Message, MetricRecord

from ..protocol import ACCURACY_NAMES, LOSS_NAMES, first_number, numbers, only_metrics
from .record import RoundRecord
from .rounds_file import RoundReporter


class RoundLog:
    """The record of the round in progress (`pending`) and where finished ones go."""

    def __init__(self, reporter: RoundReporter) -> None:
        self.reporter = reporter
        self.pending: RoundRecord | None = None  # the last round's record, unpublished
        self.server_s = 0.0  # the strategy's own seconds in the current round
        self._eval_started: float | None = None

    def open(self, record: RoundRecord) -> None:
        """A round's training is aggregated: publish the previous record, keep this one."""
        self.publish()
        self.pending = record

    def current(self, server_round: int) -> RoundRecord | None:
        pending = self.pending
        return pending if pending is not None and pending.round == server_round else None

    def publish(self) -> None:
        if self.pending is not None:
            self.reporter.publish(self.pending)
            self.pending = None

    def close(self, server_round: int, publish: bool) -> None:
        """Round `server_round` is done: its server seconds and memory into its record,
        published unless the next round's replies still carry its evaluation."""
        record = self.current(server_round)
        if record is None:
            return
        record.server_s = self.server_s
        record.server_rss_mb = psutil.Process().memory_info().rss / 2**20
        if publish:
            self.publish()

    @contextlib.contextmanager
    def server_time(self) -> Iterator[None]:
        """Add the block's seconds to the round's server time (the strategy's own work:
        selecting, sizing, checking and averaging; not waiting for silos)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.server_s += time.perf_counter() - started

    def evaluation_sent(self) -> None:
        self._eval_started = time.monotonic()

    def evaluated(self, server_round: int, replies: list[Message], weight_key: str) -> None:
        """A federated evaluation phase came back: its wall time and results."""
        record = self.current(server_round)
        if record is not None:
            if self._eval_started is not None:
                record.eval_wall_s = time.monotonic() - self._eval_started
            attach_evaluation(record, replies, weight_key)
        self._eval_started = None

    def server_evaluated(self, server_round: int, metrics: MetricRecord | None) -> None:
        """The server's own evaluation (an app's `evaluate_fn`) of the round's model."""
        record = self.current(server_round)
        if metrics is not None and record is not None:
            values = numbers(metrics)
            record.server_accuracy = first_number(values, ACCURACY_NAMES)
            record.server_loss = first_number(values, LOSS_NAMES)


def attach_evaluation(record: RoundRecord, replies: list[Message], key: str) -> None:
    """Weighted accuracy and loss of the replies (the app's names for them: eval_acc,
    accuracy, ...; weights under `key`) into the record, per silo and overall."""
    per_node: dict[int, tuple[float, float | None, float | None]] = {}
    for msg in replies:
        if msg.has_error() or len(msg.content.metric_records) != 1:
            continue
        values = numbers(only_metrics(msg))
        weight = values.get(key)
        accuracy = first_number(values, ACCURACY_NAMES)
        loss = first_number(values, LOSS_NAMES)
        if weight is None or weight <= 0 or (accuracy is None and loss is None):
            continue  # not asked to evaluate, or reports neither
        per_node[msg.metadata.src_node_id] = (weight, accuracy, loss)

    def mean(index: int) -> float | None:
        pairs = [(v[0], x) for v in per_node.values() if (x := v[index]) is not None]
        total = sum(w for w, _ in pairs)
        return sum(w * x for w, x in pairs) / total if pairs else None

    if per_node:
        record.accuracy, record.loss = mean(1), mean(2)
    for silo in record.silos:
        if silo.node in per_node:
            _, silo.accuracy, silo.loss = per_node[silo.node]


def audit_round(
    folder: Path,
    server_round: int,
    updates: dict[int, tuple[float, ArrayRecord]],
    aggregate: ArrayRecord,
) -> None:
    """Every update of the round (node -> (weight, arrays)) and the aggregate, to
    folder/round-K.npz: what an auditor needs to recompute the average."""
    folder.mkdir(parents=True, exist_ok=True)
    saved: dict[str, np.ndarray] = {}
    for node, (weight, arrays) in updates.items():
        saved[f"weight/{node}"] = np.asarray(weight)
        for key, array in arrays.items():
            saved[f"update/{node}/{key}"] = array.numpy()
    for key, array in aggregate.items():
        saved[f"aggregate/{key}"] = array.numpy()
    with (folder / f"round-{server_round}.npz").open("wb") as handle:
        np.savez(handle, **saved)  # type: ignore[arg-type]
