"""fedlb's side of each round of a LoadBalanced strategy: the balancer (started from the
silos' first reports or their stored speed profiles, carried over to silos that rejoined a
restarted server), each round's replies read into reports for it (checked, one vote per
partition, the quorum variant's pick), the stability guard's verdict, and the round's
record. LoadBalanced holds the state (its __init__) and Flower's hooks; the variants in
fedlb.experiments override the hooks these methods call (`_load_report`, `_initial_load`,
`_keep`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fedlb.balance import BatchSizeManager, StabilityGuard, Verdict, WorkerReport

from .balancing import StoredProfiles, read_reports, start_manager
from .claims import Claims
from .composition import in_dtypes
from .driving import Driving
from .edge import edge_steps, edge_text
from .grid import PollingGrid
from .he import EncryptedAggregation
from .identity import by_node, worker_name
from .membership import Membership, say
from .options import Balancer
from .profiles import ask_partitions
from .protocol import SiloReport
from .records import RoundRecord, round_record
from .replies import ReportCheck, UpdateCheck, triage_replies
from .round_close import RunProgress
from .rounds_file import RoundReporter
from .stability import guard_round, least_share
from .verdicts import VerdictMemory


class RoundBalance:
    """The balancing half of LoadBalanced (its state is set in LoadBalanced.__init__)."""

    balancer: Balancer
    profiles: bool
    guard: StabilityGuard | None
    he: EncryptedAggregation | None
    weighted_by_key: str
    claims: Claims
    members: Membership
    updates: UpdateCheck
    report_check: ReportCheck
    manager: BatchSizeManager | None
    progress: RunProgress
    stored_profiles: StoredProfiles
    verdicts: VerdictMemory
    driving: Driving
    edge: str
    _sent: dict[int, tuple[int | None, int | None]]
    _own_steps: dict[int, int]
    _ran_steps: dict[int, int]
    _round_steps: dict[int, int]
    _messages: list[Message]
    _notices: dict[int, str]
    _reporting: set[int]
    _started: float
    _user_floor: float
    _polling: PollingGrid | None
    _sent_model: dict[str, tuple[tuple[int, ...], str]]

    @property
    def reporter(self) -> RoundReporter:  # LoadBalanced's
        raise NotImplementedError

    @property
    def _inner_name(self) -> str:  # LoadBalanced's
        raise NotImplementedError

    def _load_report(self, node: int, report: SiloReport) -> WorkerReport:
        """The balancer's view of a silo's report (its load unit: samples per step)."""
        return report.worker_report(node)

    def _initial_load(self, report: SiloReport) -> int:
        """A silo's starting size in the balancer's unit, from its first report."""
        return report.batch_size

    def _keep(self, server_round: int, valid: list[Message]) -> list[Message]:
        """The updates to aggregate (all of them; the quorum variant keeps the fastest)."""
        return valid

    def current_sizes(self) -> dict[int, int]:
        """Every known silo's batch size for the next round, by node id."""
        return {} if self.manager is None else by_node(self.manager.sizes)

    def size_of(self, node: int) -> int | None:
        """The balancer's current load for `node` (None before balancing starts, or for a
        silo it does not hold)."""
        return None if self.manager is None else self.manager.sizes.get(worker_name(node))

    def sizes_by_silo(self) -> dict[str, int]:
        """The same, by silo label (silo-<partition-id> where known)."""
        return {self.members.label(n): b for n, b in self.current_sizes().items()}

    def _start_from_profiles(
        self, grid: Grid, arrays: ArrayRecord, nodes: list[int], config: ConfigRecord
    ) -> None:
        """Round 1 balanced: the silos' stored speed profiles as their first reports,
        when this server has balanced this model before and every sampled silo has one.
        The guard first takes up the last verdict on this app; a guard that probes starts
        from profiles where the app was found stable (batch sizes balanced from round 1)
        or at the edge with the steps lever (every silo at its B0, the slow silos' steps
        cut from round 1: each step as noisy as stock's). Not judged yet, or at the edge
        without the lever, round 1 runs at every silo's B0 as in a first run (on the
        quickstart at η = 0.1 over 1:2:4, the floor from round 1 ended 7 networks of 60
        dead, stock 3)."""
        stored = self.stored_profiles
        self.verdicts.know(stored.layout(arrays, self.he is not None), config, grid)
        lever = self.edge == "steps" and self.he is None
        if self.guard is not None:
            taken = self.verdicts.adopt(
                self.guard, self.members.events.append, len(nodes), steps_lever=lever
            )
            regime = None if taken is None else taken.regime
            if self.guard.probe > 0 and not (regime == "stable" or (regime == "edge" and lever)):
                return
        found = stored.ask(grid, arrays, nodes, self.he is not None, self.members)
        if found is None:
            return
        manager = self._start_balancing({n: report for n, (_, report) in found.items()})
        if self.guard is not None:
            manager.set_min_share(least_share(self.guard, self._user_floor))
        stored.replay(manager, found, self._load_report)
        # each silo's own τ, for the steps lever before any round ran uncapped
        self._own_steps.update({n: p.local_steps for n, (p, _) in found.items()})
        stored.say_used(self.members.label, self.sizes_by_silo())

    def _start_balancing(self, said: Mapping[int, SiloReport]) -> BatchSizeManager:
        """The balancer, from the silos' first reports (or their stored profiles)."""
        self.manager, self._user_floor = start_manager(
            self.balancer, self.members, said, self._initial_load
        )
        return self.manager

    def _carry_over(self, grid: Grid, present: list[int]) -> None:
        """A resumed run's first round: silos that rejoined a restarted SuperLink (its
        state in memory) under new node ids take up their old nodes' balance state,
        matched by the partition id each says it holds."""
        assert self.manager is not None
        known = set(by_node(self.manager.sizes))
        newcomers = [n for n in present if n not in known]
        if not newcomers or known <= set(present):
            return
        said = ask_partitions(grid, newcomers, self.stored_profiles.model or "")
        successors = self.members.carry_over(self.manager, present, said)
        self._own_steps = {successors.get(n, n): t for n, t in self._own_steps.items()}
        if self.guard is not None:
            self.guard.rename_workers(
                {worker_name(o): worker_name(n) for o, n in successors.items()}
            )

    def _collect(
        self, server_round: int, replies: list[Message]
    ) -> tuple[list[Message], RoundRecord]:
        """Check replies, feed the balancer, and describe the round."""
        wall = time.monotonic() - self._started
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in self._messages}
        triage = triage_replies(replies, sent_to, self.updates)
        failed = triage.failed
        failed += self.members.bench_missing(
            server_round, triage.unreachable, self._sent, triage.answered, self.manager
        )
        for line in failed:
            say(WARNING, "round %d: %s", server_round, line)
        valid = self.members.one_vote_each(server_round, triage.valid, failed)
        kept = self._keep(server_round, valid)
        failed += [
            f"{self.members.label(m.metadata.src_node_id)}: not among the quorum"
            for m in valid
            if m not in kept
        ]
        kept, unweighed = self.claims.weigh(
            server_round, kept, self.members.label, self.members.event
        )
        for node, why in unweighed.items():
            line = f"{self.members.label(node)}: left out of the average: {why}"
            failed.append(line)
            say(WARNING, "round %d: %s", server_round, line)
        read = read_reports(
            server_round, kept, self.report_check, self._sent, self.members, self._load_report
        )
        self._reporting = set(read.said)
        self._ran_steps = {n: r.local_steps for n, r in read.said.items()}
        for node, report in read.said.items():  # a silo's own steps: those run uncapped
            if node not in self._round_steps:
                self._own_steps[node] = report.local_steps
        self._say_unbalanced(server_round, kept, read.said)
        self.members.warn_below_emulation(read.said)
        if self.profiles and server_round == self.progress.offset + 1:
            self.stored_profiles.check(
                read.said, self.members.label, self.profiles, self.members.events.append
            )
        if self.manager is None and read.said:  # the first reports: each silo's own B0 and τ
            self._start_balancing(read.said)
        # The guard first: the floor it sets bounds this step's sizes.
        diverged, verdict = self._guard_round(
            server_round, read.said, read.app_numbers, triage.blown_up
        )
        # each told in its next message
        for node, why in {**triage.rejected, **unweighed, **diverged}.items():
            self._notices[node] = (
                f"its update of round {server_round} was left out of the average: {why}"
            )
        if diverged:
            kept = [m for m in kept if m.metadata.src_node_id not in diverged]
            failed += [
                f"{self.members.label(n)}: update diverged, left out of the average: {why}"
                for n, why in diverged.items()
            ]
        stepped = time.perf_counter()
        next_sizes = (
            {}
            if self.manager is None
            else self.members.step(
                self.manager,
                read.said,
                read.reports,
                read.rejected,
                self._initial_load,
                # a silo whose steps the lever cut runs its own again where sizes balance
                {n: self._own_steps[n] for n in self._round_steps if n in self._own_steps},
            )
        )
        balancer_s = time.perf_counter() - stepped
        arrived = self._polling.replied_s if self._polling is not None else {}
        record = round_record(
            server_round,
            read.reports,
            read.said,
            read.app_numbers,
            dict(self.members.labels),
            next_sizes,
            self._sent,
            wall,
            self.weighted_by_key,
            {n: arrived[i] for i, n in sent_to.items() if i in arrived},
        )
        record.failed = failed
        record.rejected = read.rejected
        record.events = self.members.take_events()
        record.balancer_s = balancer_s if self.manager is not None else None
        if verdict is not None:
            record.guard = verdict.regime
            record.guard_floor = verdict.floor
            record.guard_probe = verdict.probe
            record.guard_growth = verdict.growth
            record.guard_noise_exponent = verdict.noise_exponent
            if self.verdicts.adopted is not None and server_round == self.progress.offset + 1:
                record.guard_remembered = self.verdicts.adopted.said()
        return kept, record

    def _edge_plan(self, server_round: int, nodes: list[int]) -> dict[int, int]:
        """The edge lever's steps for this round's silos (node -> its cap), where the
        guard found the app at the edge, or looks at its own growth first, and `edge` is
        "steps": every silo at its own batch size, the slow ones' steps cut so that all
        finish together. Said once, in the log and the round's events (the live page)."""
        if (
            self.edge != "steps"
            or self.guard is None
            or not (self.guard.regime == "edge" or self.guard.looking)
            or self.manager is None
        ):
            return {}
        if self.he is not None:  # no plaintext update to normalize: uniform, said once
            if self.driving.once("edge under HE"):
                say(
                    INFO,
                    "round %d: at the edge under HE: the silos' updates are ciphertexts, "
                    "which cannot be normalized by their steps, so every silo runs its own "
                    "batch size and steps (uniform)",
                    server_round,
                )
            return {}
        own = {n: self._own_steps[n] for n in nodes if n in self._own_steps}
        plan = edge_steps(self.manager, own, nodes)
        looking = self.guard.looking  # the look's round, or a run at the edge
        if plan and self.driving.once("look" if looking else "edge lever"):
            steps = {self.members.label(n): t for n, t in plan.items()}
            text = edge_text(self.sizes_by_silo(), steps, look=looking)
            say(INFO, "round %d: %s", server_round, text)
            self.members.events.append(text)
        return plan

    def _say_unbalanced(
        self, server_round: int, kept: list[Message], said: Mapping[int, SiloReport]
    ) -> None:
        """Updates came back but none with fedlb's report: nothing can be balanced, and
        the log says why (once, and again every 10 such rounds)."""
        if not kept or said:
            self.driving.told.discard("no reports")
            return
        if self.driving.once("no reports") or server_round % 10 == 0:
            say(
                WARNING,
                "round %d: no silo's reply carried fedlb's report, so nothing is balanced "
                "(every silo keeps its batch size): the ClientApp needs "
                "ClientApp(mods=[balance_mod()]) and its train loop must draw from "
                "balanced_loader(msg, trainloader)",
                server_round,
            )

    def _guard_round(
        self,
        server_round: int,
        said: Mapping[int, SiloReport],
        app_numbers: Mapping[int, Mapping[str, float]],
        blown_up: list[int],
    ) -> tuple[dict[int, str], Verdict | None]:
        """The stability guard's verdict on the round (None: no guard) and the diverged
        updates (node -> why), to leave out; the silos' floor moved (and the sizes with
        it) when it says so."""
        if self.guard is None:
            return {}, None
        diverged, verdict = guard_round(
            self.guard,
            self.manager,
            self._user_floor,
            server_round,
            said,
            app_numbers,
            blown_up,
            self.members.label,
            self.members.events.append,
            self._sent,
            cut=[n for n, t in self._round_steps.items() if t < self._own_steps.get(n, t)],
        )
        trained = len(set(said) | set(blown_up))
        self.verdicts.after(verdict, server_round, trained)  # for the next run of this app
        return diverged, verdict

    def _progress(
        self, server_round: int, messages: list[Message]
    ) -> Callable[[dict[str, float]], None]:
        """What the polling grid tells as replies arrive: the round's progress file (its
        silos by label; in round 1, before any silo said its partition, node-<id>)."""

        def write(replied: dict[str, float]) -> None:
            to = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
            sent = [self.members.label(node) for node in to.values()]
            by_silo = {self.members.label(to[i]): s for i, s in replied.items() if i in to}
            self.reporter.progress(server_round, sent, by_silo)

        return write

    def _in_app_dtypes(self, arrays: ArrayRecord) -> ArrayRecord:
        """The aggregate in the dtypes the model was sent in (said once where cast)."""
        if not self._sent_model:
            return arrays
        arrays, cast = in_dtypes(arrays, self._sent_model)
        if cast and self.driving.once("dtypes"):
            say(
                INFO,
                "%s returned the model in other dtypes than the app's (%s%s): the silos get "
                "it in the app's, as its load_state_dict would make it; the strategy's own "
                "state keeps its precision",
                self._inner_name,
                ", ".join(cast[:3]),
                ", ..." if len(cast) > 3 else "",
            )
        return arrays
