"""Checks on what silos send back: an update the global model can take, and a report the
balancer can trust. A reply that fails is left out with the reason, never crashes a round.
A silo's own words (an error's reason) are kept with their control characters written
out (fedlb._markup.visible): Flower's strategies log them, and so does fedlb."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Error, Message, MetricRecord

from fedlb._markup import visible
from fedlb.he import CiphertextError

from .agreement import Peers
from .he import EncryptedAggregation
from .identity import node_label
from .protocol import ProtocolError, SiloReport, numbers, only_metrics, read_report

NON_FINITE = "holds NaN or infinite values"  # an update that blew up


class UpdateCheck:
    """Checks train replies against the round's global model (keys, shapes, numbers,
    finite values; under HE the run's key and layout) and keeps the checked ciphertexts.
    `label` names a silo in what is said of its reply (the membership's: silo-N once it
    said its partition; node-N without one)."""

    def __init__(
        self,
        weighted_by_key: str,
        he: EncryptedAggregation | None,
        label: Callable[[int], str] = node_label,
    ) -> None:
        self.weighted_by_key = weighted_by_key
        self.he = he
        self.label = label
        self.evaluated = Peers(arrays=False)  # what evaluation replies agree on
        self.global_arrays: ArrayRecord | None = None
        self._template: dict[str, tuple[tuple[int, ...], str]] = {}
        self.ciphertexts: dict[int, list[Any]] = {}  # by id(reply)

    def new_round(self, arrays: ArrayRecord) -> None:
        self.global_arrays = arrays
        self._template = {k: (tuple(a.shape), str(a.dtype)) for k, a in arrays.items()}
        self.ciphertexts = {}

    def weight(self, msg: Message) -> float:
        return numbers(only_metrics(msg))[self.weighted_by_key]

    def problem(self, msg: Message, train: bool = True) -> str | None:
        """Why a reply cannot be used, or None. Evaluation replies (train=False) need
        only one MetricRecord with a usable weight."""
        content = msg.content
        arrays_expected = 1 if train else len(content.array_records)
        if len(content.array_records) != arrays_expected or len(content.metric_records) != 1:
            return (
                f"expected {'one ArrayRecord and ' if train else ''}one MetricRecord, got "
                f"{len(content.array_records)} and {len(content.metric_records)}"
            )
        metrics = only_metrics(msg)
        weight = numbers(metrics).get(self.weighted_by_key)
        if weight is None or weight <= 0:
            return (
                f"{self.weighted_by_key} must be a finite number > 0, "
                f"got {metrics.get(self.weighted_by_key)!r}"
            )
        return self._arrays_problem(msg) if train else None

    def evaluations(self, replies: list[Message]) -> tuple[list[Message], list[str]]:
        """(the usable evaluation replies, "silo-N unusable: why" for the others and
        "silo-N: metric ... dropped" for those whose keys their peers do not send:
        fedlb.flower.agreement)."""
        usable, unusable = [], []
        for msg in replies:
            problem = self.problem(msg, train=False)
            if problem is None:
                usable.append(msg)
            else:
                unusable.append(f"{self.label(msg.metadata.src_node_id)} unusable: {problem}")
        usable, left_out, dropped = self.evaluated.agree(usable, self.label)
        unusable += [f"{self.label(node)} unusable: {why}" for node, why in left_out.items()]
        return usable, unusable + list(dropped.values())

    def _arrays_problem(self, msg: Message) -> str | None:
        arrays = next(iter(msg.content.array_records.values()))
        if self.he is not None:
            assert self.global_arrays is not None
            try:
                self.ciphertexts[id(msg)] = self.he.check(arrays, self.global_arrays)
            except CiphertextError as error:
                return f"encrypted update rejected: {error}"
            return None
        if set(arrays.keys()) != set(self._template):
            return "its arrays do not have the global model's keys"
        for key, array in arrays.items():
            # By shape, not dtype: a server optimizer may hand out the model in another
            # dtype than the app's (FedAdam's float64), and the app answers in its own.
            shape, dtype = self._template[key]
            if tuple(array.shape) != shape:
                return (
                    f"array {key} is {array.dtype}{list(array.shape)}, "
                    f"expected {dtype}{list(shape)}"
                )
            try:
                values = array.numpy()
            except Exception as error:  # a corrupt payload must not take the server down
                return f"array {key} cannot be decoded: {error}"
            if values.dtype.kind not in "biuf":
                return f"array {key} is {values.dtype}, not numbers (expected {dtype})"
            if not np.all(np.isfinite(values)):
                return f"array {key} {NON_FINITE}"
        return None


class ReportCheck:
    """Reads a reply's SiloReport and checks it against what the silo was told: its batch
    size and steps (its example count is fedlb.flower.claims' business)."""

    def __init__(self, weighted_by_key: str) -> None:
        self.weighted_by_key = weighted_by_key

    def read(
        self, node: int, metrics: MetricRecord, sent: tuple[int | None, int | None]
    ) -> tuple[SiloReport | None, str]:
        """(the report, "") or (None, why it cannot be used)."""
        try:
            report = read_report(metrics)
        except ProtocolError as error:  # it may quote a key the silo named
            return None, visible(error)
        for what, value, expected in (
            ("batch size", report.batch_size, sent[0]),
            ("local steps", report.local_steps, sent[1]),
        ):
            if expected is not None and value != expected:
                return None, f"{what} {value} is not the {expected} it was sent"
        return report, ""


@dataclass
class Triage:
    """A round's replies sorted: usable updates (in node order), and what went wrong."""

    valid: list[Message] = field(default_factory=list)
    blown_up: list[int] = field(default_factory=list)  # updates holding NaN or infinity
    failed: list[str] = field(default_factory=list)  # "silo-N: why", for the record
    rejected: dict[int, str] = field(default_factory=dict)  # node -> why its update is out
    answered: set[int] = field(default_factory=set)
    unreachable: list[int] = field(default_factory=list)  # the SuperLink answered for them


def triage_replies(
    replies: list[Message], sent_to: Mapping[str, int], updates: UpdateCheck
) -> Triage:
    """Sort train replies by what can be used. `sent_to` maps the round's message ids to
    their nodes: an error reply the SuperLink makes for a vanished node comes from the
    SuperLink itself, so the node is named by the message it answers. An error's reason
    is written out (`shown_error`) before the wrapped strategy logs it."""
    triage = Triage()
    label = updates.label
    for msg in replies:
        node = sent_to.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
        triage.answered.add(node)
        if msg.has_error():
            triage.failed.append(f"{label(node)}: {shown_error(msg)}")
            if msg.metadata.src_node_id != node:
                triage.unreachable.append(node)
            continue
        problem = updates.problem(msg)
        if problem is not None:
            triage.failed.append(f"{label(node)}: update rejected: {problem}")
            triage.rejected[node] = problem
            if NON_FINITE in problem:
                triage.blown_up.append(node)
            continue
        triage.valid.append(msg)
    # Replies arrive in any order; summing floats in a fixed one makes a run repeatable
    # bit for bit (a resumed run ends exactly as an uninterrupted one).
    triage.valid.sort(key=lambda m: m.metadata.src_node_id)
    return triage


def shown_error(msg: Message) -> str:
    """An error reply's reason with its control characters written out, put back in the
    reply (Flower's FedAvg logs every error's reason as it is: a silo's ClientApp that
    raised with ESC sequences in its message recoloured the operator's terminal)."""
    reason = msg.error.reason or ""
    if not reason.isprintable():
        msg.error = Error(msg.error.code, visible(reason))
    return msg.error.reason or ""
