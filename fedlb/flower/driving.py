"""Which loop drives a LoadBalanced strategy's rounds, and what fedlb does about each.

- `LoadBalanced.start()` with Flower's own loop (`Strategy.start`): everything fedlb does.
- The wrapped strategy's own `start()` (advanced-pytorch's `CustomFedAvg`): it runs, its
  hooks on itself swapped for fedlb's while it does (`around_own_loop`), fedlb calling
  its own ones kept aside (`hook`).
- A subclass's own `start()`, or an outer strategy's (fedlb wrapped, e.g.
  `DifferentialPrivacyServerSideFixedClipping(LoadBalanced(...))`): fedlb's hooks still
  balance every round (`foreign`), and what only its own `start()` does is said once; an
  outer strategy is named and told to go inside.
- Whatever the loop: a round fedlb configured whose replies never reached fedlb's
  `aggregate_train` (a subclass's own that skips it: stopped; an outer strategy that
  aggregated nothing), and rounds without a model to go on from (`no_model`: after
  `stop_after` in a row the run stops, `NoUsableUpdateError`, never a frozen model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from logging import INFO, WARNING
from typing import Any

from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from .composition import outer_strategy
from .grid import PollingGrid
from .membership import say
from .round_close import RunProgress, adopt_foreign_loop

HOOKS = ("configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate")


class NoUsableUpdateError(RuntimeError):
    """Rounds in a row ended without a model to go on from: the run stops, non-zero."""


class Driving:
    """What fedlb knows of the loop that calls its hooks."""

    def __init__(self, stop_after: int) -> None:
        if stop_after < 1:
            raise ValueError(f"stop_after must be >= 1 rounds, got {stop_after}")
        self.stop_after = stop_after
        self.outer: Strategy | None = None  # a strategy wrapping fedlb's, if any
        self.configured: int | None = None  # the last round fedlb configured
        self.aggregated: int | None = None  # and the last whose replies fedlb aggregated
        self.barren = 0  # rounds in a row without a model to go on from
        self.told: set[str] = set()  # what was said once
        self._hooks: dict[str, Callable[..., Any]] = {}  # the wrapped one's, while swapped

    def hook(self, strategy: Strategy, name: str) -> Callable[..., Any]:
        """`strategy`'s own hook `name` (not fedlb's, while its own loop runs them)."""
        return self._hooks.get(name) or getattr(strategy, name)

    @contextmanager
    def around_own_loop(self, own: Strategy, strategy: Strategy) -> Iterator[None]:
        """`strategy`'s own `start()` calls its hooks on itself: while it runs they are
        `own`'s (fedlb's), which call its own, kept aside."""
        say(
            INFO,
            "%s has a start() loop of its own: it runs, with fedlb's hooks around its own",
            type(strategy).__name__,
        )
        self._hooks = {name: getattr(strategy, name) for name in HOOKS}
        for name in HOOKS:
            setattr(strategy, name, getattr(own, name))
        try:
            yield
        finally:
            for name in HOOKS:
                vars(strategy).pop(name, None)
            self._hooks = {}

    def foreign(
        self,
        own: Strategy,
        grid: Grid,
        poll_interval: float | None,
        progress: RunProgress,
        encrypted: bool,
    ) -> PollingGrid | None:
        """A loop other than `own.start()` drives the hooks: polling put on its grid
        (the PollingGrid, or None), the driver said once; under HE an outer strategy is
        refused (it would read ciphertexts as models)."""
        if "driver" not in self.told:
            self.told.add("driver")
            self.outer = outer_strategy(own, depth=14)
        driver = type(self.outer or own).__name__
        if self.outer is not None and encrypted:
            raise ValueError(
                f"{driver} wraps {type(own).__name__}, which averages ciphertexts (he=): "
                f"{driver} would read the encrypted replies as models; under HE fedlb must "
                "be outermost, around a strategy that aggregates as FedAvg does"
            )
        fedlb = next(c.__name__ for c in type(own).__mro__ if c.__module__.startswith("fedlb."))
        polling = adopt_foreign_loop(grid, poll_interval, progress, driver, fedlb)
        if self.outer is not None and "outer" not in self.told:
            self.told.add("outer")
            say(
                WARNING,
                "%s wraps %s, so it sees the silos' replies before fedlb does: balancing "
                "works, but the model travels unpacked and fedlb's report keys reach %s; "
                "put fedlb outermost: LoadBalanced(%s(...))",
                driver,
                type(own).__name__,
                driver,
                driver,
            )
        return polling

    def check_aggregated(self, own: Strategy, base: type, server_round: int, sent: bool) -> None:
        """Before round `server_round`: the last round fedlb configured (and `sent`
        messages for) never reached its `aggregate_train`. A subclass's own that skips
        fedlb's (`base`'s) leaves every silo at its size for good: stopped, saying what
        to do. An outer strategy that aggregated nothing counts towards `stop_after`."""
        last = self.configured
        if last is None or last != server_round - 1 or self.aggregated == last or not sent:
            return
        if type(own).aggregate_train is not base.aggregate_train:  # type: ignore[attr-defined]
            owner = next(
                cls.__name__ for cls in type(own).__mro__ if "aggregate_train" in vars(cls)
            )
            raise TypeError(
                f"{owner}.aggregate_train did not call {base.__name__}.aggregate_train in "
                f"round {last}, so fedlb cannot read the silos' reports and nothing is "
                f"balanced: call super().aggregate_train(...) in it, or make {owner} a "
                f"subclass of Flower's strategy (e.g. FedAvg) and wrap it: "
                f"LoadBalanced({owner}(...))"
            )
        driver = type(self.outer).__name__ if self.outer is not None else "the loop"
        self.no_model(last, f"{driver} did not hand the round's replies to fedlb", True)

    def no_model(self, server_round: int, why: str, sent: bool) -> None:
        """A round without a model to go on from (`sent`: its silos were sent messages):
        said, and after `stop_after` in a row the run stops."""
        if not sent:  # nothing was trained this round (fraction_train = 0)
            return
        self.barren += 1
        say(WARNING, "round %d: %s; the model stays as it was", server_round, why)
        if self.barren >= self.stop_after:
            raise NoUsableUpdateError(
                f"fedlb: {self.barren} rounds in a row ended without a model to go on from "
                f"(round {server_round}: {why}); the run stops rather than go on with a "
                "frozen model: see the warnings above for each round's replies"
            )

    def once(self, key: str) -> bool:
        """Whether `key` is said now for the first time."""
        first = key not in self.told
        self.told.add(key)
        return first
