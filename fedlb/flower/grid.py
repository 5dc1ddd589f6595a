"""The grids fedlb puts between Flower and a strategy: `PollingGrid` waits for replies by
polling every `interval` seconds; `SiloView` shows the wrapped strategy the silos that
take part.

`PollingGrid`:

Flower 1.41's deployment Grid pulls replies, then sleeps a fixed 3 s before pulling again
(`send_and_receive`), so a round whose replies are ready after 0.5 s still costs 3 s. This
wrapper does the same through the public `push_messages` / `pull_messages` API at a short
interval. Everything else is delegated to the wrapped grid. An error reply's reason (a
silo's own text) comes out of it with its control characters written out, before any
strategy logs it (fedlb.flower.replies.shown_error).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import WARNING
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from .composition import at_most, silos_needed
from .membership import Membership, say
from .replies import shown_error


class PollingGrid(Grid):
    """Wraps `grid`; `send_and_receive` polls every `interval` seconds (default 0.1)."""

    def __init__(self, grid: Grid, interval: float = 0.1) -> None:
        if not interval > 0:
            raise ValueError(f"poll interval must be > 0 seconds, got {interval}")
        self.inner = grid
        self.interval = interval
        # the last send_and_receive: each reply's arrival, seconds after the push, by the
        # message it answers (the server's clock: what a round's wall is made of)
        self.replied_s: dict[str, float] = {}
        # told the arrivals so far after the push and after each pull that brought one
        self.on_reply: Callable[[dict[str, float]], None] | None = None

    def set_run(self, run: Any) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Any:
        return self.inner.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:
        return self.inner.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        for msg in replies:
            if msg.has_error():
                shown_error(msg)
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        pushed = time.monotonic()
        pending = set(self.push_messages(messages))
        deadline = None if timeout is None else pushed + timeout
        replies: list[Message] = []
        self.replied_s = {}
        if self.on_reply is not None:
            self.on_reply({})
        while pending:
            received = list(self.pull_messages(pending))
            replies.extend(received)
            answered = {m.metadata.reply_to_message_id for m in received}
            self.replied_s.update(dict.fromkeys(answered, time.monotonic() - pushed))
            pending -= answered
            if answered and self.on_reply is not None:
                self.on_reply(dict(self.replied_s))
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(self.interval)
        return replies


class SiloView(Grid):
    """The grid as the wrapped strategy sees it when it samples: only the silos fedlb lets
    take part (fedlb.flower.membership: those that missed a round sit out a grace period,
    a silo started twice is refused; before this process's first round, all the silos
    expected are waited for). Where the strategy needs more silos than that leaves (its
    `min_available_nodes`: FedAvg would wait for them), it is shown every silo online,
    and `sitting_out` names those whose messages fedlb then holds back. Everything else
    is the real grid's."""

    def __init__(self, grid: Grid, members: Membership, first: bool, needed: int) -> None:
        self.inner = grid
        self.members = members
        self.first = first
        self.needed = needed
        self.listed: list[int] | None = None  # what the strategy was last shown
        self.sitting_out: set[int] = set()  # shown to it, though not taking part

    def set_run(self, run: Any) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Any:
        return self.inner.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        eligible = self.members.eligible(self.inner, self.first)
        nodes = eligible
        if len(eligible) < self.needed and len(self.members.online) > len(eligible):
            nodes = sorted(self.members.online)
        self.sitting_out = set(nodes) - set(eligible)
        self.listed = nodes
        return list(nodes)

    def get_nodes(self) -> Iterable[Any]:
        shown = set(self.get_node_ids())
        return [n for n in self.inner.get_nodes() if getattr(n, "node_id", None) in shown]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.inner.send_and_receive(messages, timeout=timeout)


def sampled(
    configure: Callable[[Grid], Iterable[Message]],
    view: SiloView,
    strategy: Strategy,
    server_round: int,
    first_time: Callable[[str], bool],
) -> list[Message]:
    """The wrapped strategy's messages, `configure` called with `view`. After the first
    round the silos taking part are what there is: where they are fewer than the
    strategy's minimums, those are lowered for the call (said once: FedAvg would wait for
    ever for a silo that left; fedlb goes on with the silos present)."""
    present = len(list(view.get_node_ids()))
    if view.first or present >= silos_needed(strategy):
        return list(configure(view))
    with at_most(strategy, present) as lowered:
        if lowered and first_time(f"fewer {present}"):
            say(
                WARNING,
                "round %d: %d silo(s) take part, fewer than %s waits for (%s): it samples "
                "from those present, as fedlb goes on without the silos that left",
                server_round,
                present,
                type(strategy).__name__,
                ", ".join(f"{k} {v}" for k, v in lowered.items()),
            )
        return list(configure(view))
