"""Rounds in the run's numbering and their close, whichever loop drives Flower's hooks:
LoadBalanced.start() (Flower's loop, or the wrapped strategy's own, counting from 1 again
after a resume), or a subclass's or an outer strategy's start(), whose rounds the hooks
close themselves."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from .grid import PollingGrid
from .membership import say
from .records import RoundLog, RoundReporter

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


@dataclass
class RunProgress:
    """Where the run stands, in its own round numbers."""

    num_rounds: int = 0  # the run's rounds (known once start() runs)
    offset: int = 0  # rounds a restored checkpoint had done
    finished: int = 0  # the last round closed (record closed, checkpointed)
    own_loop: bool = False  # start() ran: else a subclass's own start() drives the hooks
    told_foreign_loop: bool = False

    def begin(self, num_rounds: int) -> int:
        """start() runs the run's `num_rounds`: the rounds a checkpoint had done, to skip."""
        self.num_rounds = num_rounds
        self.own_loop = True
        return self.offset

    def say_resumed(self) -> None:
        if self.offset:
            say(
                INFO,
                "Flower's round counter below starts at 1 again: its [ROUND 1/%d] is the "
                "run's round %d of %d",
                self.num_rounds - self.offset,
                self.offset + 1,
                self.num_rounds,
            )

    def run_round(self, flower_round: int) -> int:
        """The run's round number (Flower's loop restarts at 1 after a resume)."""
        return flower_round + self.offset

    def evaluation_due(self, server_round: int, every: int) -> bool:
        return server_round >= 1 and (server_round % every == 0 or server_round == self.num_rounds)

    def closes(self, server_round: int, last: bool) -> bool:
        """Whether round `server_round` is closed now (marked so): once each, and none a
        restored checkpoint had done unless it is the run's last."""
        if server_round < 1 or (server_round <= self.offset and not last):
            return False
        if server_round <= self.finished and not self.own_loop:
            return False  # a foreign loop's aggregate_evaluate finished it already
        self.finished = max(self.finished, server_round)
        return True


def adopt_foreign_loop(
    grid: Grid, poll_interval: float | None, progress: RunProgress, driver: str, own: str
) -> PollingGrid | None:
    """Another loop drives the hooks (`driver`: a subclass's start(), or an outer
    strategy's): polling put on the grid it uses (the PollingGrid whose arrival times
    the round records read, or None where it cannot be); what only `own`.start() (the
    fedlb strategy's) can do is said once."""
    polling = None
    if poll_interval is not None and not isinstance(grid, PollingGrid):
        made = PollingGrid(grid, poll_interval)
        with contextlib.suppress(AttributeError):  # the loop calls this grid's method
            grid.send_and_receive = made.send_and_receive  # type: ignore[method-assign]
            polling = made
    if not progress.told_foreign_loop:
        progress.told_foreign_loop = True
        say(
            WARNING,
            "%s.start() drives the rounds, not %s.start(): fedlb balances every round "
            "from Flower's hooks, polls replies every %s s and writes each round's record at "
            "aggregate_evaluate; without its start() the records lack the server-side "
            "evaluation (your evaluate_fn's results stay in your Result), evaluate_every > 1 "
            "cannot tell the last round, a restored checkpoint is not resumed, and under HE "
            "Result.arrays stays ciphertext. Call super().start(...) to keep them.",
            driver,
            own,
            poll_interval,
        )
    return polling


def recorded_evaluate(
    evaluate_fn: EvaluateFn | None, progress: RunProgress, rounds: RoundLog
) -> EvaluateFn | None:
    """The app's server-side evaluation, called with the run's round numbers and its
    metrics put in that round's record."""
    if evaluate_fn is None:
        return None
    inner = evaluate_fn

    def server_evaluate(flower_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        metrics = inner(progress.run_round(flower_round), arrays)
        rounds.server_evaluated(progress.run_round(flower_round), metrics)
        return metrics

    return server_evaluate


def in_run_rounds(result: Result, done: int) -> None:
    """Renumber the Result's histories from Flower's loop's rounds to the run's, after a
    resume from a checkpoint of `done` rounds."""
    if not done:
        return
    for history in (
        result.train_metrics_clientapp,
        result.evaluate_metrics_clientapp,
        result.evaluate_metrics_serverapp,
    ):
        shifted = {r + done: m for r, m in history.items()}
        history.clear()
        history.update(shifted)


def progress_writer(
    reporter: RoundReporter,
    label: Callable[[int], str],
    server_round: int,
    messages: list[Message],
) -> Callable[[dict[str, float]], None]:
    """What the polling grid tells as replies arrive: the round's progress file (its
    silos by label; in round 1, before any silo said its partition, node-<id>)."""

    def write(replied: dict[str, float]) -> None:
        # read at each reply: a message's id is given when the grid pushes it
        to = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
        sent = [label(node) for node in to.values()]
        by_silo = {label(to[i]): s for i, s in replied.items() if i in to}
        reporter.progress(server_round, sent, by_silo)

    return write
