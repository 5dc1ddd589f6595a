"""LoadBalancedFedAvg: FedAvg with per-silo batch sizes tuned from measured throughput.

The class holds Flower's round (configure/aggregate train and evaluate, start) and the hooks
its variants override; each concern its hooks need lives beside it: the balancer's start and
reports (balancing), the stability guard (stability), averaging and metrics (aggregation),
the silos taking part (membership), rounds closed in the run's numbering (round_close)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from fedlb.balance import BatchSizeManager, StabilityGuard, Verdict, WorkerReport

from .aggregation import (
    MetricsAggregation,
    app_metrics,
    audit,
    average,
    encrypted_start,
    with_round_figures,
)
from .balancing import StoredProfiles, describe_balancing, read_reports, start_manager
from .checkpoint import Checkpoint, restore_strategy_state, save_checkpoint, strategy_state
from .grid import PollingGrid
from .he import EncryptedAggregation, EncryptedModel
from .identity import by_node, node_label, worker_name
from .membership import Membership, say
from .options import Balancing, Joining, Keeping
from .packing import LAYOUT, Layout, layout_text, pack, packable, unpack_in_place
from .profiles import ask_partitions, model_key
from .protocol import EVAL_EXAMPLES, Orders, SiloReport
from .records import RoundRecord, balance_line, round_record
from .replies import ReportCheck, UpdateCheck, triage_replies
from .round_close import (
    EvaluateFn,
    RunProgress,
    adopt_foreign_loop,
    in_run_rounds,
    recorded_evaluate,
)
from .round_log import RoundLog, attach_evaluation
from .rounds_file import RoundReporter
from .stability import fixed_rounds_advice, guard_round, least_share
from .verdicts import VerdictMemory


class LoadBalancedFedAvg(FedAvg):
    """FedAvg whose silos each get their own batch size, so all finish a round together.

    A drop-in for Flower's `FedAvg`: the same arguments, each honoured as FedAvg does, plus
    optional fedlb arguments after them. τ (each silo's local steps) and the learning rate
    are the app's and never tuned (LB-BSP Section 3.5: tuning either biases the model on
    non-IID data). Only B_i moves, decided by a `BatchSizeManager` from each silo's
    measured compute seconds and fixed costs, with X = Σ B_i kept. Arrays are averaged
    weighted by `weighted_by_key` (the local dataset size), never by samples processed,
    so a fast silo gains no bigger say. The silos' ClientApp needs `balance_mod()` and
    `balanced_loader` (fedlb.flower.dropin).

    Round 1 runs as the app wrote it: each silo draws its own loader's batch size B0 for
    as many steps as its loop runs, and reports both, so the server needs no new settings
    (X = Σ B0_i, τ_i = the silo's steps). From round 2 each silo draws its own B_i.

    Args (FedAvg's, same order and defaults):
        fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes,
        min_available_nodes, weighted_by_key, arrayrecord_key, configrecord_key,
        train_metrics_aggr_fn, evaluate_metrics_aggr_fn: as in FedAvg. The metric
            aggregation functions see the app's own metrics (fedlb's keys taken out).
    Args (fedlb's, all optional, keyword only; the groups are fedlb.flower.options'):
        balancing: how each silo's batch size is decided (`Balancing`: B0, τ, the
            balancer, the stability guard, round 1 from stored profiles).
        joining: which silos take part (`Joining`: how many to wait for, how long, how
            long a silo that missed a round stays out).
        keeping: what the run keeps (`Keeping`: the round reporter, checkpoints, the
            run's settings, an audit of every round's updates).
        evaluate_every: federated evaluation every k rounds and after the last.
            Default 1 (as FedAvg).
        evaluate_with_train: fedlb's own silo app only: the silo evaluates the model it
            receives before training and reports it with its update (one round trip
            instead of two); only the final model gets an evaluate phase. Default False.
        poll_interval: seconds between pulls of replies (Flower's deployment Grid
            sleeps 3 s). Default 0.1; None keeps Flower's.
        seed: seed of node sampling. Default 0.
        he: CKKS aggregation (`EncryptedAggregation` over a public context): the initial
            model is encrypted, replies must be ciphertexts under the run's key, and the
            weighted average is computed on ciphertexts. `Result.arrays` is then an
            `EncryptedModel`: save it with `save_encrypted`, decrypt it at a silo.
            Default None.
    """

    def __init__(
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        train_metrics_aggr_fn: MetricsAggregation | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregation | None = None,
        *,
        balancing: Balancing = Balancing(),  # noqa: B008 (frozen: shared safely)
        joining: Joining = Joining(),  # noqa: B008
        keeping: Keeping = Keeping(),  # noqa: B008
        evaluate_every: int = 1,
        evaluate_with_train: bool = False,
        poll_interval: float | None = 0.1,
        seed: int = 0,
        he: EncryptedAggregation | None = None,
        pack_model: bool = True,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=weighted_by_key,
            arrayrecord_key=arrayrecord_key,
            configrecord_key=configrecord_key,
            train_metrics_aggr_fn=train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
        )
        if evaluate_every < 1:
            raise ValueError(f"evaluate_every must be >= 1, got {evaluate_every}")
        self.batch_size = balancing.batch_size
        self.local_steps = balancing.local_steps
        self.balancer = balancing.balancer
        self.profiles = balancing.profiles
        self.guard: StabilityGuard | None = balancing.make_guard()
        self.evaluate_every = evaluate_every
        self.evaluate_with_train = evaluate_with_train
        self.poll_interval = poll_interval
        reporter = keeping.reporter
        self.rounds = RoundLog(reporter if reporter is not None else RoundReporter())
        self.audit_dir = keeping.audit_dir
        self.checkpoint_dir = keeping.checkpoint_dir
        self.run_settings = dict(keeping.run_settings)
        self.he = he
        # the model on the wire as one array (fedlb.flower.packing): plaintext only
        self.pack_model = pack_model and he is None
        self._layout: tuple[Layout, str] | None = None  # this round's packing, as text too
        self.members = Membership(
            joining.expected_silos or min_available_nodes,
            joining.join_timeout,
            joining.rejoin_grace,
        )
        self.updates = UpdateCheck(weighted_by_key, he)
        self.report_check = ReportCheck(weighted_by_key)
        self.manager: BatchSizeManager | None = None
        self.progress = RunProgress()
        self.stored_profiles = StoredProfiles()
        self.verdicts = VerdictMemory()  # the guard's verdicts, kept for the next run
        self._rng = random.Random(seed)
        self._sent: dict[int, tuple[int | None, int | None]] = {}  # node -> (B, τ) ordered
        self._messages: list[Message] = []  # this round's train messages
        self._notices: dict[int, str] = {}  # node -> why its last update was left out
        self._started = 0.0
        self._user_floor = 0.0  # the floor the user set on the tuner: the guard's least
        self._aggregated: ArrayRecord | None = None  # the model the last round ended with
        self._polling: PollingGrid | None = None  # its replies' arrival times per round

    @property
    def reporter(self) -> RoundReporter:
        """Where finished round records go (their console table, rounds.jsonl)."""
        return self.rounds.reporter

    def summary(self) -> None:
        """What Flower logs at the start, and fedlb's balancing after it."""
        super().summary()
        describe_balancing(self.batch_size, self.local_steps, self.balancer, self.guard)

    # ---- nodes and sizes ---------------------------------------------------------------
    def _round(self, flower_round: int) -> int:
        """The run's round number (Flower's loop restarts at 1 after a resume)."""
        return self.progress.run_round(flower_round)

    def _sample(self, fraction: float, minimum: int, grid: Grid) -> tuple[list[int], list[int]]:
        """(every eligible node, those sampled), all the expected silos awaited before this
        process's first round."""
        return self.members.sample(grid, not self._sent, fraction, minimum, self._rng)

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
        from profiles only where the app was found stable (at the edge, or not judged
        yet, round 1 runs at every silo's B0 as in a first run: on the quickstart at
        η = 0.1 over 1:2:4, the floor from round 1 ended 7 networks of 60 dead, stock 3)."""
        stored = self.stored_profiles
        self.verdicts.know(stored.layout(arrays, self.he is not None), config, grid)
        if self.guard is not None:
            taken = self.verdicts.adopt(self.guard, self.members.events.append, len(nodes))
            if self.guard.probe > 0 and (taken is None or taken.regime != "stable"):
                return
        found = stored.ask(grid, arrays, nodes, self.he is not None, self.members)
        if found is None:
            return
        manager = self._start_balancing({n: report for n, (_, report) in found.items()})
        if self.guard is not None:
            manager.set_min_share(least_share(self.guard, self._user_floor))
        stored.replay(manager, found, self._load_report)
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
        if self.guard is not None:
            self.guard.rename_workers(
                {worker_name(o): worker_name(n) for o, n in successors.items()}
            )

    def _check_profiles(self, said: Mapping[int, SiloReport]) -> None:
        """After round 1: say which stored profiles the measurement contradicts."""
        self.stored_profiles.check(
            said, self.members.label, self.profiles, self.members.events.append
        )

    # Hooks the experiment-only variants (fedlb.experiments) override ------------------
    def _orders(self, server_round: int, node: int) -> Orders:
        """What `node` is told to run this round."""
        size = self.size_of(node)
        return Orders(
            notice=self._notices.pop(node, ""),
            server_round=server_round,
            batch_size=size if size is not None else self.batch_size,
            local_steps=self.local_steps,
            evaluate_first=self.evaluate_with_train and self._evaluation_due(server_round - 1),
        )

    def _node_config(self, node: int, orders: Orders, config: ConfigRecord) -> ConfigRecord:
        """The train ConfigRecord `node` gets: the app's config plus its orders."""
        return orders.into(config)

    def _load_report(self, node: int, report: SiloReport) -> WorkerReport:
        """The balancer's view of a silo's report (its load unit: samples per step)."""
        return report.worker_report(node)

    def _initial_load(self, report: SiloReport) -> int:
        """A silo's starting size in the balancer's unit, from its first report."""
        return report.batch_size

    def _keep(self, server_round: int, valid: list[Message]) -> list[Message]:
        """The updates to aggregate (all of them; the quorum variant keeps the fastest)."""
        return valid

    # ---- training ----------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round = self._round(server_round)
        if not self.progress.own_loop:
            self._foreign_loop(grid)
            if self.he is not None:  # a foreign loop starts from the plaintext model
                arrays = self.he.encrypt(arrays)
        self._finish_round(server_round - 1, arrays)
        self.rounds.server_s = 0.0
        with self.rounds.server_time():
            if self.fraction_train == 0.0:
                return []
            present, nodes = self._sample(self.fraction_train, self.min_train_nodes, grid)
            if self.manager is None and not self._sent and self.profiles:
                self._start_from_profiles(grid, arrays, nodes, config)
            if self.manager is not None and not self._sent and self.progress.offset:
                self._carry_over(grid, present)
            if self.manager is not None:
                self.members.sync(self.manager, present, nodes)
            flwr_log(
                INFO, "configure_train: Sampled %s nodes (out of %s)", len(nodes), len(present)
            )
            self.updates.new_round(arrays)
            wire, self._layout = self._on_the_wire(arrays)
            messages = []
            self._sent = {}
            for node in nodes:
                orders = self._orders(server_round, node)
                self._sent[node] = (orders.batch_size, orders.local_steps)
                node_config = self._node_config(node, orders, config)
                if self._layout is not None:
                    node_config = ConfigRecord({**node_config, LAYOUT: self._layout[1]})
                # A new RecordDict per node: Message does not copy its content.
                content = RecordDict(
                    {self.arrayrecord_key: wire, self.configrecord_key: node_config}
                )
                messages.append(
                    Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
                )
            self._messages = messages
            self._started = time.monotonic()
            if self._polling is not None:
                self._polling.on_reply = self._progress(server_round, messages)
            return messages

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

    def _on_the_wire(self, arrays: ArrayRecord) -> tuple[ArrayRecord, tuple[Layout, str] | None]:
        """(the model as sent, (its layout, as text) where it travels packed)."""
        if not self.pack_model or not packable(arrays):
            return arrays, None
        packed, layout = pack(arrays)
        return packed, (layout, layout_text(layout))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round = self._round(server_round)
        with self.rounds.server_time():
            replies = list(replies)
            if self._polling is not None:  # an evaluation or a query is not the round
                self._polling.on_reply = None
            if self._layout is not None:  # before anything reads them
                for msg in replies:
                    unpack_in_place(msg, self._layout[0])
            self._check_and_log_replies(replies, is_train=True, validate=False)
            valid, record = self._collect(server_round, replies)
            if self.evaluate_with_train and self.rounds.pending is not None:
                # These replies carry the evaluation of the model this round started
                # from: the previous round's result.
                attach_evaluation(self.rounds.pending, valid, EVAL_EXAMPLES)
            self.rounds.open(record)
            say(INFO, "%s", balance_line(record))
            if not valid:
                say(WARNING, "round %d: no usable update; the model stays as it was", server_round)
                return None, None
            arrays = average(valid, self.updates, self.he, self.weighted_by_key)
            self._aggregated = arrays
            if self.audit_dir is not None:
                audit(self.audit_dir, server_round, valid, self.updates, arrays)
            metrics = app_metrics(valid, self.train_metrics_aggr_fn, self.weighted_by_key)
            return arrays, with_round_figures(metrics, record)

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
            f"{node_label(m.metadata.src_node_id)}: not among the quorum"
            for m in valid
            if m not in kept
        ]
        read = read_reports(
            server_round, kept, self.report_check, self._sent, self.members, self._load_report
        )
        if self.profiles and server_round == self.progress.offset + 1:
            self._check_profiles(read.said)
        if self.manager is None and read.said:  # the first reports: each silo's own B0 and τ
            self._start_balancing(read.said)
        # The guard first: the floor it sets bounds this step's sizes.
        diverged, verdict = self._guard_round(
            server_round, read.said, read.app_numbers, triage.blown_up
        )
        for node, why in {**triage.rejected, **diverged}.items():  # told in its next message
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
                self.manager, read.said, read.reports, read.rejected, self._initial_load
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
        )
        trained = len(set(said) | set(blown_up))
        self.verdicts.after(verdict, server_round, trained)  # for the next run of this app
        return diverged, verdict

    # ---- evaluation --------------------------------------------------------------------
    def _evaluation_due(self, server_round: int) -> bool:
        return self.progress.evaluation_due(server_round, self.evaluate_every)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round = self._round(server_round)
        with self.rounds.server_time():
            due = server_round == self.progress.num_rounds or (
                not self.evaluate_with_train and self._evaluation_due(server_round)
            )
            if self.fraction_evaluate == 0.0 or not due:
                return []
            present, nodes = self._sample(self.fraction_evaluate, self.min_evaluate_nodes, grid)
            flwr_log(
                INFO, "configure_evaluate: Sampled %s nodes (out of %s)", len(nodes), len(present)
            )
            self.rounds.evaluation_sent()
            eval_config = ConfigRecord(dict(config))
            eval_config["server-round"] = server_round
            wire, layout = self._on_the_wire(arrays)
            if layout is not None:
                eval_config[LAYOUT] = layout[1]
            record = RecordDict({self.arrayrecord_key: wire, self.configrecord_key: eval_config})
            return self._construct_messages(record, nodes, MessageType.EVALUATE)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        server_round = self._round(server_round)
        with self.rounds.server_time():
            answered, _ = self._check_and_log_replies(list(replies), is_train=False, validate=False)
            valid, unusable = self.updates.evaluations(answered)
            for line in unusable:
                say(WARNING, "round %d: evaluation from %s", server_round, line)
            self.rounds.evaluated(server_round, valid, self.weighted_by_key)
        if not self.progress.own_loop and self._aggregated is not None:
            # A subclass's own loop: this is the round's last hook fedlb sees (its
            # evaluate_fn runs after it), so the round is finished here.
            self._finish_round(server_round, self._aggregated, last=True)
        with self.rounds.server_time():
            if not valid:
                return None
            return app_metrics(valid, self.evaluate_metrics_aggr_fn, self.weighted_by_key)

    # ---- the run -----------------------------------------------------------------------
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> Result:
        """Flower's own round loop (`Strategy.start`: its log, its `Result`), with replies
        polled every `poll_interval` s. After `restore(checkpoint)` it runs the rounds
        after the checkpoint's (pass the returned model as `initial_arrays`): Flower's
        loop counts them from 1 again, fedlb's records and the Result use the run's
        round numbers. Under HE, `Result.arrays` is an `EncryptedModel`."""
        done = self.progress.begin(num_rounds)
        if self.profiles:
            self.stored_profiles.model = model_key(initial_arrays)  # plaintext: under HE too
        if self.he is not None:
            initial_arrays = encrypted_start(self.he, initial_arrays, evaluate_fn is not None)
        self.progress.say_resumed()
        if self.poll_interval is not None:
            grid = self._polling = PollingGrid(grid, self.poll_interval)
        result = super().start(
            grid=grid,
            initial_arrays=initial_arrays,
            num_rounds=num_rounds - done,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=recorded_evaluate(evaluate_fn, self.progress, self.rounds),
        )
        self._finish_round(num_rounds, result.arrays or initial_arrays, last=True)
        if (advice := fixed_rounds_advice(self.reporter.summary(), num_rounds)) is not None:
            say(INFO, "%s", advice)
        in_run_rounds(result, done)
        if self.he is not None:
            result.arrays = EncryptedModel(result.arrays or initial_arrays)
        return result

    def _foreign_loop(self, grid: Grid) -> None:
        """A subclass overrode `start()` without calling this class's: Flower's hooks
        still balance every round and write its record (round_close.adopt_foreign_loop)."""
        polling = adopt_foreign_loop(grid, self.poll_interval, self.progress, type(self).__name__)
        if polling is not None:
            self._polling = polling

    def _finish_round(self, server_round: int, arrays: ArrayRecord, last: bool = False) -> None:
        """Round `server_round` is wholly done (Flower's server-side evaluation included):
        close its record and, with `checkpoint_dir`, checkpoint it with its model."""
        if not self.progress.closes(server_round, last):
            return
        # Unless the next round's replies carry its evaluation, its record is complete.
        self.rounds.close(server_round, publish=last or not self.evaluate_with_train)
        if self.checkpoint_dir is not None and server_round > self.progress.offset:
            save_checkpoint(
                self.checkpoint_dir,
                Checkpoint(
                    server_round,
                    self.progress.num_rounds,
                    arrays,
                    self.state_dict(),
                    self.run_settings,
                ),
            )

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of this strategy (JSON-serialisable)."""
        state = strategy_state(self.manager, self._rng, self.members, self.rounds)
        if self.guard is not None:
            state["guard"] = self.guard.state_dict()
        return state

    def restore(self, checkpoint: Checkpoint) -> ArrayRecord:
        """Take up a checkpointed run: the balancer with its estimators and tuner, the
        sampling RNG, labels, silos left out, and the last round's record. `start` then
        runs the rounds after `checkpoint.round`; pass it the returned model."""
        self.manager = restore_strategy_state(
            checkpoint.strategy, self.balancer, self._rng, self.members, self.rounds
        )
        if self.guard is not None and self.manager is not None:
            if "guard" in checkpoint.strategy:  # its regime, floor and yardsticks
                self.guard.load_state_dict(checkpoint.strategy["guard"])
            else:  # a checkpoint from before the guard's state was kept: the floor the
                # run had reached is in the tuner's state, and the guard goes on there
                self.guard.resume_at(float(getattr(self.manager.tuner, "min_share", 0.0)))
        self.progress.offset = checkpoint.round
        return checkpoint.arrays
