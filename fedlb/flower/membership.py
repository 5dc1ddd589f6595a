"""Which silos take part: waiting for them, leaving out those that missed a round, letting
them back in, and keeping the balancer's set of workers in step (X re-divided each time)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from flwr.app import Message
from flwr.common import log as flwr_log
from flwr.serverapp import Grid

from fedlb._markup import visible
from fedlb.balance import BatchSizeManager, WorkerReport

from .identity import by_node, node_label, node_of, silo_label, worker_name
from .protocol import SiloReport, only_metrics, partition_of


def say(level: int, text: str, *args: object) -> None:
    """Log through Flower's logger, beside its own round log: what a ServerApp shows and
    `flwr run --stream` streams, in any app (fedlb's own loggers have no handler there).
    Text arguments carry what silos sent (failures, metric names, curves): their control
    characters are written out (fedlb._markup.visible), never sent to a terminal."""
    shown = [visible(a) if isinstance(a, str) else a for a in args]
    flwr_log(level, "fedlb: " + text, *shown)


# a silo whose measured speed is below this share of its emulated one says so (padding
# overshoots by a few percent: sleep() wakes late)
BELOW_EMULATION = 0.8


class Membership:
    """The federation's silos as the strategy sees them.

    Args:
        expected: silos to wait for before round 1.
        join_timeout: seconds to wait for them before giving up.
        rejoin_grace: seconds a silo that missed a round is left out while the SuperLink
            still lists it (a killed SuperNode stays listed until its heartbeats lapse).
        sleep: how to wait (tests pass a fake).
    """

    def __init__(
        self,
        expected: int,
        join_timeout: float,
        rejoin_grace: float,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.expected = expected
        self.join_timeout = join_timeout
        self.rejoin_grace = rejoin_grace
        self.sleep = sleep
        self.labels: dict[int, str] = {}
        self.benched: dict[int, float] = {}  # node -> when it missed a round
        self.too_slow: set[str] = set()  # silos already told to leave
        self.below_emulation: set[int] = set()  # silos already said to run below their speed
        self.brought: dict[int, int] = {}  # node -> the B0 it brought to X
        self.events: list[str] = []  # for the next round record
        # One partition, one vote: the node whose updates count for each partition id,
        # and nodes refused because another node holds the partition they claim.
        self.claims: dict[int, int] = {}
        self.refused: dict[int, int] = {}  # node -> the partition it claimed
        self.online: set[int] = set()  # as the SuperLink listed them last

    def label(self, node: int) -> str:
        return self.labels.get(node, node_label(node))

    def name(self, node: int, partition_id: int | None) -> None:
        """Label a node by its partition id (stable across restarts of its SuperNode)."""
        if partition_id is not None:
            self.labels[node] = silo_label(partition_id)

    def event(self, text: str) -> None:
        """Log a membership event now and keep it for the next round record."""
        say(logging.INFO, "%s", text)
        self.events.append(text)

    def take_events(self) -> list[str]:
        events, self.events = self.events, []
        return events

    def wait_for(self, grid: Grid, count: int) -> list[int]:
        """The SuperLink's online nodes once at least `count` are, or a RuntimeError after
        `join_timeout` seconds."""
        deadline = time.monotonic() + self.join_timeout
        told = 0.0
        while len(nodes := sorted(grid.get_node_ids())) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {len(nodes)} of {count} silos joined within "
                    f"{self.join_timeout:.0f} s; start the missing silos or lower the "
                    "expected number of silos"
                )
            if time.monotonic() - told > 10:
                say(logging.INFO, "waiting for silos: %d of %d joined", len(nodes), count)
                told = time.monotonic()
            self.sleep(0.2)
        return nodes

    def eligible(self, grid: Grid, first: bool) -> list[int]:
        """Online nodes, less those benched after missing a round; while every online node
        is benched, waits for one to (re)join or its grace to end."""
        warned = False
        while True:
            online = set(self.wait_for(grid, self.expected if first else 1))
            now = time.monotonic()
            for node, since in list(self.benched.items()):
                if node not in online:
                    # The SuperLink has let it go; if it comes back (same id with a silo
                    # key, a new id without) it is a newcomer.
                    del self.benched[node]
                elif now - since >= self.rejoin_grace:
                    del self.benched[node]
                    self.event(
                        f"{self.label(node)} still connected {now - since:.0f} s after "
                        "missing a round: tried again"
                    )
            self.online = online
            duplicates = {n for n, p in self.refused.items() if self.holder_active(p)}
            eligible = sorted(online - set(self.benched) - duplicates)
            if eligible:
                return eligible
            if not warned:
                say(logging.WARNING, "no silo can take the round: waiting for one to (re)join")
                warned = True
            self.sleep(0.5)

    def holder_active(self, partition: int) -> bool:
        holder = self.claims.get(partition)
        return holder is not None and holder in self.online and holder not in self.benched

    def claim(self, node: int, partition: int | None) -> str | None:
        """A reply from `node` for `partition`: None when its update counts, else why not.
        The node holding the partition keeps it while connected and taking part; a node
        claiming it meanwhile (a silo started twice, or restarted while its old SuperNode
        is still listed) is refused and not sampled; once the holder is gone or left out,
        the newcomer takes the partition over."""
        if partition is None:
            return None  # its own data: nothing to double-count
        holder = self.claims.get(partition)
        if holder is not None and holder != node and self.holder_active(partition):
            if self.refused.get(node) != partition:
                self.event(
                    f"{node_label(node)} claims partition {partition}, which "
                    f"{node_label(holder)} already "
                    "holds: refused (one partition, one vote); a silo was started twice"
                )
            self.refused[node] = partition
            return (
                f"{node_label(node)}: claims partition {partition}, already held by "
                f"{node_label(holder)}; "
                "its update is not counted (stop the silo started twice)"
            )
        if holder is not None and holder != node:
            self.event(
                f"{silo_label(partition)} is now {node_label(node)} ({node_label(holder)} is gone)"
            )
        self.claims[partition] = node
        self.refused.pop(node, None)
        return None

    def one_vote_each(
        self, server_round: int, replies: list[Message], failed: list[str]
    ) -> list[Message]:
        """The replies whose updates count: one per partition (`claim`); why the others
        do not goes to `failed`."""
        refused = set()
        for msg in sorted(replies, key=lambda m: m.metadata.src_node_id):  # the first holds
            node, partition = msg.metadata.src_node_id, partition_of(only_metrics(msg))
            why = self.claim(node, partition)
            if why is not None:
                refused.add(id(msg))
                failed.append(why)
                say(logging.WARNING, "round %d: %s", server_round, why)
            else:  # labelled now: its example count is pinned by its label (claims.py)
                self.name(node, partition)
        return [m for m in replies if id(m) not in refused]

    def bench(
        self, node: int, server_round: int, why: str, manager: BatchSizeManager | None
    ) -> None:
        """Leave a silo that missed a round out until it reconnects or the grace passes."""
        self.benched[node] = time.monotonic()
        self.event(f"{self.label(node)} missed round {server_round} ({why})")
        if manager is not None:
            self.leave(manager, node)

    def bench_missing(
        self,
        server_round: int,
        unreachable: list[int],
        sent: Iterable[int],
        answered: set[int],
        manager: BatchSizeManager | None,
    ) -> list[str]:
        """Bench the silos the SuperLink could not reach and those `sent` the round that
        did not answer in time; "silo-N: why" for each of the latter (node-N before it said
        its partition), for the record."""
        for node in unreachable:
            self.bench(node, server_round, "unreachable", manager)
        failed = []
        for node in sent:
            if node not in answered:
                failed.append(f"{self.label(node)}: no reply within the round timeout")
                self.bench(node, server_round, "no reply within the round timeout", manager)
        return failed

    def leave(self, manager: BatchSizeManager, node: int) -> None:
        """Remove a silo from the balancer: X loses the B0 it brought, the rest is
        re-divided in the others' proportions (the last silo stays)."""
        if worker_name(node) in manager.sizes and len(manager.workers) > 1:
            sizes = manager.remove_worker(worker_name(node), shrink=self.brought.get(node, 0))
            self.note(f"{self.label(node)} left", sizes)

    def join(self, manager: BatchSizeManager, node: int, b0: int) -> None:
        """Add a silo to the balancer with the B0 it brings (X grows by it) and a fresh
        speed estimate: its first round ran at that size, so it is balanced from its next."""
        self.brought[node] = b0
        sizes = manager.add_worker(worker_name(node), size=b0, grow=True)
        self.note(f"{self.label(node)} joined with its B0 = {b0} and a fresh speed estimate", sizes)

    def sync(self, manager: BatchSizeManager, present: list[int], sampled: list[int]) -> None:
        """Before a round: remove the silos no longer `present`, and take back sampled
        silos that left and came back (with their B0: nothing is known of the machine
        they are on now). Silos never seen join when their first report arrives."""
        for node in map(node_of, manager.workers):
            if node not in present:
                self.leave(manager, node)
        for node in sampled:
            if worker_name(node) not in manager.sizes and node in self.brought:
                self.join(manager, node, self.brought[node])

    def carry_over(
        self, manager: BatchSizeManager, present: list[int], partitions: Mapping[int, int]
    ) -> dict[int, int]:
        """After a restart of the server (its SuperLink in memory: every silo rejoined
        under a new node id), give each balanced silo no longer `present` its successor:
        the present node that says it holds the same partition (`partitions`: node ->
        partition id, from `profiles.ask_partitions`). Everything known of the silo (its
        size, speed estimate, the tuner's memory of it, its label, what it brought to X)
        follows it. Returns old node -> new node; silos without a successor leave as
        before, newcomers without a predecessor join at their B0."""
        gone = {
            self.labels[n]: n
            for n in map(node_of, manager.workers)
            if n not in present and n in self.labels
        }
        successors: dict[int, int] = {}
        for node, partition in sorted(partitions.items()):
            old = gone.pop(silo_label(partition), None)
            if old is not None and node in present and worker_name(node) not in manager.sizes:
                successors[old] = node
        if not successors:
            return {}
        manager.rename_workers({worker_name(o): worker_name(n) for o, n in successors.items()})
        for old, new in successors.items():
            self.labels[new] = self.labels.pop(old)
            if old in self.brought:
                self.brought[new] = self.brought.pop(old)
            if old in self.benched:
                self.benched[new] = self.benched.pop(old)
            self.refused.pop(old, None)
        self.claims = {p: successors.get(n, n) for p, n in self.claims.items()}
        self.too_slow = {worker_name(successors.get(node_of(w), node_of(w))) for w in self.too_slow}
        self.event(
            "the server restarted: "
            + ", ".join(
                f"{self.labels[n]} rejoined as {node_label(n)}" for n in successors.values()
            )
            + "; each goes on with its batch size and speed estimate"
        )
        return successors

    def note(self, event: str, sizes: dict[str, int]) -> None:
        by_label = {self.label(n): b for n, b in by_node(sizes).items()}
        say(logging.INFO, "%s; X = %d divided: %s", event, sum(sizes.values()), by_label)
        self.events.append(event)

    def start_balancing(
        self,
        balancer: Callable[[Mapping[str, int]], BatchSizeManager],
        initial: dict[str, int],
        said: Mapping[int, SiloReport],
    ) -> BatchSizeManager:
        """The balancer, made from the silos' first reports (what each brought to X)."""
        self.brought.update(by_node(initial))
        manager = balancer(initial)
        say(
            logging.INFO,
            "load balancing %d silos from their first round: B0 %s, X = %d, τ %s "
            "(the app's learning rate and steps are kept)",
            len(said),
            {self.label(n): r.batch_size for n, r in sorted(said.items())},
            manager.total,
            {self.label(n): r.local_steps for n, r in sorted(said.items())},
        )
        return manager

    def step(
        self,
        manager: BatchSizeManager,
        said: Mapping[int, SiloReport],
        reports: dict[int, WorkerReport],
        rejected: list[str],
        initial_load: Callable[[SiloReport], int],
        own_steps: Mapping[int, int] | None = None,
    ) -> dict[int, int]:
        """Feed a round's reports to the balancer, silos reporting for the first time
        joining with their own B0 first; the next sizes by node. Reports the balancer
        rejects leave `reports` (and go to `rejected`, with the reason). `own_steps`: the
        τ a silo runs when not cut, where this round cut it (the steps lever)."""
        for node, report in sorted(said.items()):
            if worker_name(node) not in manager.sizes:  # its first round: its own B0
                self.join(manager, node, initial_load(report))
        steps = {worker_name(n): t for n, t in (own_steps or {}).items()}
        sizes = manager.step(list(reports.values()), steps)
        for worker, why in manager.last_rejected:
            reports.pop(node_of(worker), None)  # not a time the round's figures can use either
            rejected.append(f"{self.label(node_of(worker))}: {why}")
        self.warn_too_slow(manager)
        return by_node(sizes)

    def warn_too_slow(self, manager: BatchSizeManager) -> None:
        """Say once per silo that it cannot keep up even at the smallest batch size."""
        for worker in sorted(manager.removal_candidates - self.too_slow):
            self.event(
                f"{self.label(node_of(worker))} cannot keep up even at the smallest batch size: "
                "it holds every round back and should leave the federation"
            )
        self.too_slow = manager.removal_candidates

    def warn_below_emulation(self, said: Mapping[int, SiloReport]) -> None:
        """Say once per silo that it ran slower than the speed it emulates: one machine
        standing in for many can pad a step only up to its real time, so a busy machine
        (Flower's simulation beside other silos) runs such a silo unpadded, and its sizes
        follow what it ran, not the speed it was given."""
        for node, report in sorted(said.items()):
            ran = report.samples_per_s()
            if (
                node in self.below_emulation
                or report.model_clock
                or report.emulated_speed <= 0
                or ran is None
                or ran >= BELOW_EMULATION * report.emulated_speed
            ):
                continue
            self.below_emulation.add(node)
            self.event(
                f"{self.label(node)} ran at {ran:.0f} samples/s, below its emulated "
                f"{report.emulated_speed:.0f}: this machine's real compute is slower than the "
                "emulation (its steps ran unpadded), so its batch size follows the speed it ran; "
                "emulate fewer silos per machine, or lower speeds"
            )

    def state_dict(self) -> dict[str, object]:
        return {
            "labels": {str(n): label for n, label in self.labels.items()},
            "benched": sorted(self.benched),
            "too_slow": sorted(self.too_slow),
            "brought": {str(n): b for n, b in self.brought.items()},
            "claims": {str(p): n for p, n in self.claims.items()},
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        labels, brought, claims = state["labels"], state["brought"], state.get("claims", {})
        benched, too_slow = state["benched"], state["too_slow"]
        if not (
            isinstance(labels, dict)
            and isinstance(brought, dict)
            and isinstance(claims, dict)
            and isinstance(benched, list)
            and isinstance(too_slow, list)
        ):
            raise TypeError(
                "labels, brought and claims must be objects, benched and too_slow lists: "
                f"got {type(labels).__name__}, {type(brought).__name__}, "
                f"{type(claims).__name__}, {type(benched).__name__}, {type(too_slow).__name__}"
            )
        self.labels = {int(n): str(label) for n, label in labels.items()}
        # Left out before the stop: wait out a fresh grace (the clock restarted).
        self.benched = {int(n): time.monotonic() for n in benched}
        self.too_slow = {str(w) for w in too_slow}
        self.brought = {int(n): int(b) for n, b in brought.items()}
        self.claims = {int(p): int(n) for p, n in claims.items()}
