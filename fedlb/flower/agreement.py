"""A round's replies made to agree before the wrapped strategy aggregates them.

Flower's aggregation takes a round's replies only when they have one shape: the same
record names, the same metric keys, each key a number in every reply or a list of the
same length in every reply (`validate_message_reply_consistency` and
`aggregate_metricrecords` in flwr.serverapp.strategy.strategy_utils). One silo that adds
`{"extra": 1.0}`, leaves `train_loss` out or sends it as a list made FedAvg raise
(InconsistentMessageReplies, or a TypeError in the sum) and ended the whole run in that
round (issue 56). Which shape is right is what most replies send: a reply that differs
is its silo's fault, not the federation's. A metric key its peers do not send is dropped
from that reply (its update still counts); a key it lacks, or sends in another form, or
records named otherwise leave its update out. Each is said with the silo's label, the
names with their control characters written out (a silo chooses them).

fedlb's own keys (`fedlb.*`) are not the app's: they are read and taken out before the
strategy sees a reply (fedlb.flower.composition.as_stock), so they take no part here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from flwr.app import Message

from fedlb._markup import visible

from .protocol import PREFIX, only_metrics

MOST_NAMED = 4  # metric names one line lists; the others are counted
NAME_CHARS = 60  # of one name: a silo's key may be as long as it likes
Names = tuple[tuple[str, ...], tuple[str, ...]]  # (ArrayRecord names, MetricRecord names)


def kind(value: object) -> str:
    """What a metric is, in words: Flower sums numbers and lists of one length."""
    return f"a list of {len(value)} numbers" if isinstance(value, list) else "a number"


def shown(keys: list[str]) -> str:
    """Metric names for a line: quoted, written out, the first MOST_NAMED of them."""
    named = ", ".join(f"'{visible(k[:NAME_CHARS])}'" for k in keys[:MOST_NAMED])
    more = len(keys) - MOST_NAMED
    return named + (f" and {more} more" if more > 0 else "")


class Peers:
    """What a run's replies of one kind (train, or evaluate) agree on; the last round's
    agreement breaks a tie (two silos, each sending another key)."""

    def __init__(self, arrays: bool = True) -> None:
        self.arrays = arrays  # train replies carry the model; evaluate replies do not
        self.agreed: dict[str, str] = {}  # metric key -> its kind, as last agreed
        self.names: Names | None = None  # the record names last agreed

    def agree(
        self, replies: list[Message], label: Callable[[int], str]
    ) -> tuple[list[Message], dict[int, str], dict[int, str]]:
        """(the replies kept, node -> why its reply is left out, node -> what was dropped
        from its reply) of `replies`, each with one MetricRecord (and one ArrayRecord where
        `arrays`): UpdateCheck has passed them. Keys are dropped in place."""
        if not replies:
            return [], {}, {}
        names = self._names(replies)
        counts: Counter[tuple[str, str]] = Counter(
            (key, kind(value))
            for msg in replies
            for key, value in only_metrics(msg).items()
            if not key.startswith(PREFIX)
        )
        agreed = {
            key: form
            for (key, form), count in counts.items()
            if 2 * count > len(replies)
            or (2 * count == len(replies) and self.agreed.get(key) == form)
        }
        kept: list[Message] = []
        left_out: dict[int, str] = {}
        dropped: dict[int, str] = {}
        for msg in replies:
            node = msg.metadata.src_node_id
            why = self._differs(msg, names, agreed)
            if why:
                left_out[node] = why + ": Flower aggregates only replies that match"
                continue
            metrics = only_metrics(msg)
            extra = sorted(k for k in metrics if not k.startswith(PREFIX) and k not in agreed)
            for key in extra:
                del metrics[key]
            if extra:
                dropped[node] = (
                    f"{label(node)}: metric {shown(extra)} dropped from its reply: its "
                    "peers send no such key (Flower aggregates only replies that match); "
                    "its update counts"
                )
            kept.append(msg)
        if kept:
            self.agreed, self.names = agreed, names
        return kept, left_out, dropped

    def _names(self, replies: list[Message]) -> Names:
        """The record names most replies use (a tie: those agreed before, else the first
        reply's)."""
        votes = Counter(self._named(m) for m in replies)
        top = max(votes.values())
        tied = [n for n, c in votes.items() if c == top]
        return self.names if self.names in tied else tied[0]

    def _named(self, msg: Message) -> Names:
        content = msg.content
        arrays = tuple(content.array_records) if self.arrays else ()
        return arrays, tuple(content.metric_records)

    def _differs(self, msg: Message, names: Names, agreed: dict[str, str]) -> str:
        """Why `msg` cannot be aggregated with the replies that agree ('' : it can,
        once its extra keys are dropped)."""
        named = self._named(msg)
        if named != names:
            return (
                f"its records are named {shown([*named[0], *named[1]])}, its peers' "
                f"{shown([*names[0], *names[1]])}"
            )
        metrics = only_metrics(msg)
        lacks = sorted(k for k in agreed if k not in metrics)
        if lacks:
            return f"its metrics lack {shown(lacks)}, which its peers send"
        other = sorted(k for k, form in agreed.items() if kind(metrics[k]) != form)
        if other:
            key = other[0]
            return (
                f"its metric {shown([key])} is {kind(metrics[key])}, its peers' "
                f"{agreed[key]}" + (f" (and {len(other) - 1} more)" if len(other) > 1 else "")
            )
        return ""
