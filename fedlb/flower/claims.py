"""What a silo claims about its data, bounded and pinned before it weighs in the average.

FedAvg weights each update by the example count its silo reports (Flower's
`num-examples`, or the strategy's `weighted_by_key`), and trusts it: one silo claiming
10^18 examples makes its update the global model. A cross-silo operator is told each
silo's claim in round 1 and can bound it:

- a claim is a whole number of examples in 0..MOST_EXAMPLES, else the update is left out
  of the average, with the reason;
- a silo's count is pinned when it first reports (or declared by the operator per silo
  label, `Joining(examples=...)`): a later, different claim is refused (said once, the
  pinned count weighs its update);
- `Joining(max_share=...)` caps any one silo's share of the average (its weight lowered
  until its share is the cap); without a cap, a silo whose weight outweighs all the
  others' together is named every round (log, round table, live page) until the operator
  caps shares or declares its count: in round 1 alone, a claim of 2^40-1 weighed 100% of
  every later round's model, and one 9.97x the median weighed 83% without being named.

Before any of that, the round's replies are made to agree (fedlb.flower.agreement): a
metric its peers do not send is dropped from a reply, and a reply without theirs left
out, so one silo's odd reply cannot make the wrapped strategy's aggregation raise.

Claims are pinned by silo label (silo-<partition-id>), so a silo that rejoins under a new
node id keeps its count; a checkpoint keeps them (`state_dict`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from flwr.app import Message

from .agreement import Peers
from .protocol import only_metrics

MOST_EXAMPLES = 2**40  # ~10^12 examples: more than any silo holds; 10^18 is a forgery


class Claims:
    """Each silo's example count: checked, pinned, capped, and said."""

    def __init__(
        self,
        weighted_by_key: str,
        declared: Mapping[str, int] | None = None,
        max_share: float | None = None,
    ) -> None:
        if max_share is not None and not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share!r}")
        for label, count in (declared or {}).items():
            if not _is_count(count):
                raise ValueError(
                    f"the examples declared for {label} must be a whole number in "
                    f"0..{MOST_EXAMPLES}, got {count!r}"
                )
        self.key = weighted_by_key
        self.declared = {str(k): int(v) for k, v in (declared or {}).items()}
        self.max_share = max_share
        self.pinned: dict[str, int] = dict(self.declared)
        self._said: set[str] = set()  # labels whose changed claim was said
        self._shown = False  # the first claims went to the log
        self.peers = Peers()  # what the round's train replies agree on

    def weigh(
        self,
        server_round: int,
        replies: list[Message],
        label: Callable[[int], str],
        event: Callable[[str], None],
    ) -> tuple[list[Message], dict[int, str]]:
        """(the replies to aggregate, node -> why an update is left out), of replies
        UpdateCheck has passed (one MetricRecord, a weight > 0), once they agree
        (fedlb.flower.agreement: a key its peers do not send dropped, said as an event).
        Each kept reply's weighting key is set to its silo's pinned count, lowered where a
        cap says so (in place: the wrapped strategy and the round record read it there)."""
        replies, left_out, dropped = self.peers.agree(replies, label)
        for line in dropped.values():
            event(line)
        kept: list[Message] = []
        counts: dict[int, int] = {}
        fresh: list[int] = []  # silos whose first claim this is
        for msg in replies:
            node = msg.metadata.src_node_id
            who = label(node)
            claimed = only_metrics(msg).get(self.key)
            if not _is_count(claimed):
                left_out[node] = (
                    f"{self.key} is {_shown(claimed)}, not a count of examples "
                    f"(0..{MOST_EXAMPLES:.3g})"
                )
                continue
            count = int(claimed)  # type: ignore[arg-type]
            if who not in self.pinned:
                fresh.append(node)
            pinned = self.pinned.setdefault(who, count)
            if count != pinned and who not in self._said:
                self._said.add(who)
                source = "declared for it" if who in self.declared else "it first claimed"
                event(
                    f"{who} claims {self.key} = {count:g}, not the {pinned:g} {source}: "
                    f"refused, its update weighs {pinned:g} (a silo's data is fixed "
                    "for the run; restart the run to change it)"
                )
            counts[node] = pinned
            kept.append(msg)
        weights = capped(counts, self.max_share)
        for msg in kept:
            node = msg.metadata.src_node_id
            only_metrics(msg)[self.key] = (
                counts[node] if weights[node] == counts[node] else weights[node]
            )
        if counts and not self._shown:
            self._shown = True
            event(self._first_claims(counts, weights, label))
        elif fresh:  # a silo that joined later: its claim said once
            total = sum(weights.values())
            for node in fresh:
                event(
                    f"{label(node)} joined claiming {self.key} = {counts[node]:g} "
                    f"({weights[node] / total:.0%} of this round's average); pinned"
                )
        if (dominant := self._dominant(server_round, counts, weights, label)) is not None:
            event(dominant)
        return kept, left_out

    def _dominant(
        self,
        server_round: int,
        counts: Mapping[int, int],
        weights: Mapping[int, float],
        label: Callable[[int], str],
    ) -> str | None:
        """The line naming a silo whose weight outweighs all the others' together, every
        round, until the operator caps shares or declares that silo's count (None: no
        such silo, or the operator's word is given)."""
        if self.max_share is not None or len(weights) < 2:
            return None
        top = max(weights, key=lambda n: weights[n])
        total = sum(weights.values())
        if weights[top] <= total - weights[top] or label(top) in self.declared:
            return None
        median = max(statistics.median(counts.values()), 1)
        return (
            f"{label(top)} outweighs all other silos together: {weights[top] / total:.0%} of "
            f"round {server_round}'s average ({self.key} {counts[top]:g}, "
            f"{counts[top] / median:.3g}x the median claim). If that is not its data, cap a "
            "silo's share (fedlb server --max-share 0.5, Joining(max_share=0.5)) or declare "
            'the counts (fedlb server --silo-examples "silo-0=600,silo-1=1200", '
            "Joining(examples=...)); said every round until then"
        )

    def _first_claims(
        self, counts: Mapping[int, int], weights: Mapping[int, float], label: Callable[[int], str]
    ) -> str:
        total = sum(weights.values())
        shares = {n: (w / total if total > 0 else 0.0) for n, w in weights.items()}
        listed = ", ".join(
            f"{label(n)} {counts[n]:g} ({shares[n]:.0%}"
            + (", capped" if weights[n] != counts[n] else "")
            + ")"
            for n in sorted(counts, key=label)
        )
        return f"the silos claim {self.key}: {listed}; pinned for the run"

    def state_dict(self) -> dict[str, int]:
        return dict(self.pinned)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Counts a checkpoint kept (declared ones win: the operator's word)."""
        for label, count in state.items():
            if _is_count(count):
                self.pinned.setdefault(str(label), int(count))
        self._shown = bool(self.pinned)


def capped(counts: Mapping[int, int], max_share: float | None) -> dict[int, float]:
    """Each silo's weight: its count, lowered for any silo whose share of the total would
    pass `max_share` until its share is the cap (the others' weights kept). Where the cap
    cannot hold (max_share x silos < 1) the capped silos weigh equal to the largest
    uncapped one at most."""
    weights = {n: float(c) for n, c in counts.items()}
    if max_share is None or max_share >= 1 or len(weights) < 2:
        return weights
    capped_nodes: set[int] = set()
    while True:
        rest = sum(w for n, w in weights.items() if n not in capped_nodes)
        share_left = 1 - max_share * len(capped_nodes)
        if share_left <= 0 or rest <= 0:
            break
        total = rest / share_left  # the total when each capped silo holds max_share
        over = {n for n, w in weights.items() if n not in capped_nodes and w > max_share * total}
        if not over:
            for n in capped_nodes:
                weights[n] = max_share * total
            return weights
        capped_nodes |= over
    # the cap cannot hold for every silo: no capped silo above the largest uncapped one
    ceiling = max((w for n, w in weights.items() if n not in capped_nodes), default=1.0)
    for n in capped_nodes:
        weights[n] = min(weights[n], ceiling)
    return weights


def _is_count(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and float(value).is_integer()
        and 0 <= value <= MOST_EXAMPLES
    )


def _shown(value: Any) -> str:
    if value is None:
        return "missing"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    return repr(value)[:40]
