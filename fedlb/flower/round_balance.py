"""fedlb's side of each round of a LoadBalanced strategy, one object that owns it: the
balancer (started from the silos' first reports or their stored speed profiles, carried over
to silos that rejoined a restarted server), what each silo was told (its batch size, its
steps, why its last update was left out), each round's replies read into reports for it
(checked, one vote per partition, the variant's pick, the claimed example counts), the
stability guard's verdict and the edge lever's steps, and the round's record.
LoadBalanced holds Flower's hooks and the wire; the variants in fedlb.experiments override
the three hooks of `Variant`, which this object calls on the strategy."""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any, Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fedlb.balance import BatchSizeManager, Verdict, WorkerReport

from .balancing import StoredProfiles, read_reports, start_manager
from .claims import Claims
from .driving import Driving
from .edge import edge_steps, edge_text
from .identity import by_node, worker_name
from .membership import Membership, say
from .options import Balancing
from .profiles import ask_partitions
from .protocol import SiloReport
from .records import RoundRecord, round_record
from .replies import ReportCheck, UpdateCheck, triage_replies
from .round_close import RunProgress
from .stability import guard_round, least_share
from .verdicts import VerdictMemory


class Variant(Protocol):
    """The hooks a variant of LoadBalanced overrides (fedlb.experiments): the balancer's
    load unit and which updates count."""

    def _load_report(self, node: int, report: SiloReport) -> WorkerReport: ...

    def _initial_load(self, report: SiloReport) -> int: ...

    def _keep(self, server_round: int, valid: list[Message]) -> list[Message]: ...


class RoundBalance:
    """The balancing half of a LoadBalanced strategy (`LoadBalanced.balance`)."""

    def __init__(
        self,
        balancing: Balancing,
        variant: Variant,
        *,
        encrypted: bool,
        weighted_by_key: str,
        claims: Claims,
        members: Membership,
        updates: UpdateCheck,
        progress: RunProgress,
        driving: Driving,
    ) -> None:
        self.balancer = balancing.balancer
        self.profiles = balancing.profiles
        self.edge = balancing.edge
        self.guard = balancing.make_guard()
        self.encrypted = encrypted
        if self.guard is not None and (self.edge != "steps" or encrypted):
            self.guard.look = False  # its look runs the steps lever: none here, probe at once
        self.variant = variant
        self.claims = claims
        self.members = members
        self.updates = updates
        self.progress = progress
        self.driving = driving
        self.report_check = ReportCheck(weighted_by_key)
        self.weighted_by_key = weighted_by_key
        self.manager: BatchSizeManager | None = None
        self.stored_profiles = StoredProfiles()
        self.verdicts = VerdictMemory()  # the guard's verdicts, kept for the next run
        self.sent: dict[int, tuple[int | None, int | None]] = {}  # node -> (B, τ) ordered
        self.own_steps: dict[int, int] = {}  # node -> the steps its own loop runs a round
        self.ran_steps: dict[int, int] = {}  # node -> the steps it ran this round
        self.round_steps: dict[int, int] = {}  # node -> this round's cap (the edge lever)
        self.notices: dict[int, str] = {}  # node -> why its last update was left out
        self.reporting: set[int] = set()  # nodes whose last reply carried fedlb's report
        self.user_floor = 0.0  # the floor the user set on the tuner: the guard's least

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

    def begin_round(
        self,
        server_round: int,
        grid: Grid,
        arrays: ArrayRecord,
        config: ConfigRecord,
        nodes: list[int],
        present: list[int],
        first: bool,
    ) -> None:
        """A round's train messages go to `nodes` (of the silos `present`): the balancer
        started from stored profiles or carried over to rejoined silos where this is the
        run's first round, told who takes part, and the edge lever's steps planned. What
        each silo is then told goes into `sent` (`told`)."""
        if self.manager is None and first and self.profiles and nodes:
            self._start_from_profiles(grid, arrays, nodes, config)
        if self.manager is not None and first and self.progress.offset:
            self._carry_over(grid, present)
        if self.manager is not None:
            self.members.sync(self.manager, present, nodes)
        self.sent = {}
        self.round_steps = self._edge_plan(server_round, nodes)

    def told(self, node: int, batch_size: int | None, local_steps: int | None) -> None:
        """What `node` was ordered this round (its report is checked against it)."""
        self.sent[node] = (batch_size, local_steps)

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
        self.verdicts.know(stored.layout(arrays, self.encrypted), config, grid)
        lever = self.edge == "steps" and not self.encrypted
        if self.guard is not None:
            taken = self.verdicts.adopt(
                self.guard, self.members.events.append, len(nodes), steps_lever=lever
            )
            regime = None if taken is None else taken.regime
            if self.guard.probe > 0 and not (regime == "stable" or (regime == "edge" and lever)):
                return
        found = stored.ask(grid, arrays, nodes, self.encrypted, self.members)
        if found is None:
            return
        manager = self._start_balancing({n: report for n, (_, report) in found.items()})
        if self.guard is not None:
            manager.set_min_share(least_share(self.guard, self.user_floor))
        stored.replay(manager, found, self.variant._load_report)
        # each silo's own τ, for the steps lever before any round ran uncapped
        self.own_steps.update({n: p.local_steps for n, (p, _) in found.items()})
        stored.say_used(self.members.label, self.sizes_by_silo())

    def _start_balancing(self, said: Mapping[int, SiloReport]) -> BatchSizeManager:
        """The balancer, from the silos' first reports (or their stored profiles)."""
        self.manager, self.user_floor = start_manager(
            self.balancer, self.members, said, self.variant._initial_load
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
        self.own_steps = {successors.get(n, n): t for n, t in self.own_steps.items()}
        if self.guard is not None:
            self.guard.rename_workers(
                {worker_name(o): worker_name(n) for o, n in successors.items()}
            )

    def collect(
        self,
        server_round: int,
        replies: list[Message],
        sent_to: Mapping[str, int],
        wall: float,
        arrived: Mapping[str, float],
    ) -> tuple[list[Message], RoundRecord]:
        """The round's replies (to the messages `sent_to`: message id -> node) checked,
        the balancer fed, the guard asked, and the round described: (the updates to
        aggregate, the round's record). `wall`: the round's seconds so far; `arrived`:
        when each reply came (message id -> s), where the grid polls."""
        triage = triage_replies(replies, sent_to, self.updates)
        failed = triage.failed
        failed += self.members.bench_missing(
            server_round, triage.unreachable, self.sent, triage.answered, self.manager
        )
        for line in failed:
            say(WARNING, "round %d: %s", server_round, line)
        valid = self.members.one_vote_each(server_round, triage.valid, failed)
        kept = self.variant._keep(server_round, valid)
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
            server_round,
            kept,
            self.report_check,
            self.sent,
            self.members,
            self.variant._load_report,
        )
        self.reporting = set(read.said)
        self.ran_steps = {n: r.local_steps for n, r in read.said.items()}
        for node, report in read.said.items():  # a silo's own steps: those run uncapped
            if node not in self.round_steps:
                self.own_steps[node] = report.local_steps
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
            self.notices[node] = (
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
                self.variant._initial_load,
                # a silo whose steps the lever cut runs its own again where sizes balance
                {n: self.own_steps[n] for n in self.round_steps if n in self.own_steps},
            )
        )
        balancer_s = time.perf_counter() - stepped
        record = round_record(
            server_round,
            read.reports,
            read.said,
            read.app_numbers,
            dict(self.members.labels),
            next_sizes,
            self.sent,
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
        if self.encrypted:  # no plaintext update to normalize: uniform, said once
            if self.driving.once("edge under HE"):
                say(
                    INFO,
                    "round %d: at the edge under HE: the silos' updates are ciphertexts, "
                    "which cannot be normalized by their steps, so every silo runs its own "
                    "batch size and steps (uniform)",
                    server_round,
                )
            return {}
        own = {n: self.own_steps[n] for n in nodes if n in self.own_steps}
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
            self.user_floor,
            server_round,
            said,
            app_numbers,
            blown_up,
            self.members.label,
            self.members.events.append,
            self.sent,
            cut=[n for n, t in self.round_steps.items() if t < self.own_steps.get(n, t)],
        )
        trained = len(set(said) | set(blown_up))
        self.verdicts.after(verdict, server_round, trained)  # for the next run of this app
        return diverged, verdict

    def state_dict(self) -> dict[str, Any]:
        """Its part of a checkpoint beside the balancer's (fedlb.flower.state): the
        guard's regime, floor and yardsticks, and each silo's own τ (the steps lever cuts
        from it; read from uncapped rounds only)."""
        state: dict[str, Any] = {}
        if self.guard is not None:
            state["guard"] = self.guard.state_dict()
        state["own_steps"] = {str(n): t for n, t in self.own_steps.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up `state_dict`'s part of a checkpoint (the balancer restored first)."""
        if self.guard is not None and self.manager is not None:
            if "guard" in state:
                self.guard.load_state_dict(state["guard"])
            else:  # a checkpoint from before the guard's state was kept: the floor the
                # run had reached is in the tuner's state, and the guard goes on there
                self.guard.resume_at(float(getattr(self.manager.tuner, "min_share", 0.0)))
        own_steps = state.get("own_steps") or {}
        self.own_steps = {int(n): int(t) for n, t in own_steps.items()}
