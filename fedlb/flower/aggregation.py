"""The model the server holds and the metrics Flower keeps under HE (the initial model
encrypted, each round's kept updates averaged by dataset size on their checked
ciphertexts); every round's kept updates audited when asked; the app's own metrics
aggregated by its functions, fedlb's keys taken out; the round's figures beside them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from .he import EncryptedAggregation
from .protocol import ROUND_FIGURES, only_metrics, user_metrics
from .records import RoundRecord, audit_round
from .replies import UpdateCheck

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]


def encrypted_start(he: EncryptedAggregation, arrays: ArrayRecord, evaluated: bool) -> ArrayRecord:
    """The initial model under HE: encrypted, and never evaluated by the server, which
    holds only ciphertexts (an `evaluated` run is refused)."""
    if evaluated:
        raise ValueError(
            "under HE the server holds only ciphertexts and cannot evaluate the "
            "model: pass no evaluate_fn (silos evaluate it: federated evaluation)"
        )
    return he.encrypt(arrays)


def encrypted_average(
    valid: list[Message], updates: UpdateCheck, he: EncryptedAggregation, weighted_by_key: str
) -> ArrayRecord:
    """The weighted average of the kept updates, on their checked ciphertexts: the server
    never sees a plaintext update (plaintext ones the wrapped strategy aggregates)."""
    assert updates.global_arrays is not None
    return he.average(
        [updates.ciphertexts[id(m)] for m in valid],
        [updates.weight(m) for m in valid],
        updates.global_arrays,
    )


def audit(
    folder: Path,
    server_round: int,
    valid: list[Message],
    updates: UpdateCheck,
    aggregate: ArrayRecord,
) -> None:
    """Every kept update with its weight, and their average: to recompute it later."""
    audit_round(
        folder,
        server_round,
        {
            m.metadata.src_node_id: (
                updates.weight(m),
                next(iter(m.content.array_records.values())),
            )
            for m in valid
        },
        aggregate,
    )


def app_metrics(
    valid: list[Message], aggregate: MetricsAggregation, weighted_by_key: str
) -> MetricRecord:
    """The app's metric aggregation over its own metrics (fedlb's keys taken out)."""
    return aggregate(
        [RecordDict({"metrics": user_metrics(only_metrics(m))}) for m in valid],
        weighted_by_key,
    )


def with_round_figures(metrics: MetricRecord, record: RoundRecord) -> MetricRecord:
    """The round's balance figures added to the train metrics (Flower's Result keeps
    them per round)."""
    for key, field in ROUND_FIGURES.items():
        value = getattr(record, field)
        if value is not None:
            metrics[key] = float(value)
    return metrics
