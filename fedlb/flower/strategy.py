"""LoadBalancedFedAvg: FedAvg with per-silo batch sizes tuned from measured throughput."""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedlb.balance import BatchSizeManager, StabilityGuard, WorkerReport

from .checkpoint import Checkpoint, restore_strategy_state, save_checkpoint, strategy_state
from .grid import PollingGrid
from .he import EncryptedAggregation, EncryptedModel
from .identity import by_node, node_label, worker_name
from .membership import Membership, say
from .options import Balancing, Joining, Keeping
from .profiles import (
    SiloProfile,
    ask_profiles,
    model_key,
    profile_report,
    remember_model,
    seen_before,
    stale,
)
from .protocol import (
    EVAL_EXAMPLES,
    ROUND_FIGURES,
    TRAIN_LOSS_NAMES,
    Orders,
    SiloReport,
    first_number,
    numbers,
    user_metrics,
)
from .records import RoundRecord, balance_line, round_record
from .replies import ReportCheck, UpdateCheck, only_metrics, triage_replies
from .round_log import RoundLog, attach_evaluation, audit_round
from .rounds_file import RoundReporter

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]


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
        self.members = Membership(
            joining.expected_silos or min_available_nodes,
            joining.join_timeout,
            joining.rejoin_grace,
        )
        self.updates = UpdateCheck(weighted_by_key, he)
        self.report_check = ReportCheck(weighted_by_key)
        self.manager: BatchSizeManager | None = None
        self._rng = random.Random(seed)
        self._num_rounds = 0
        self._offset = 0  # rounds a restored checkpoint had done
        self._sent: dict[int, tuple[int | None, int | None]] = {}  # node -> (B, τ) ordered
        self._messages: list[Message] = []  # this round's train messages
        self._notices: dict[int, str] = {}  # node -> why its last update was left out
        self._started = 0.0
        self._user_floor = 0.0
        self._own_loop = False  # start() ran: else a subclass's own start() drives the hooks
        self._aggregated: ArrayRecord | None = None  # the model the last round ended with
        self._finished = 0  # the last round finished (record closed, checkpointed)
        self._told_foreign_loop = False
        self._polling: PollingGrid | None = None  # its replies' arrival times per round
        self._model_key: str | None = None  # the model's layout, for speed profiles
        self._profiled: dict[int, SiloProfile] = {}  # round 1's profiles, checked after it

    @property
    def reporter(self) -> RoundReporter:
        """Where finished round records go (their console table, rounds.jsonl)."""
        return self.rounds.reporter

    # ---- what Flower logs at the start -------------------------------------------------
    def summary(self) -> None:
        super().summary()
        flwr_log(INFO, "\t└──> Load balancing (fedlb):")
        flwr_log(
            INFO,
            "\t\t├── B0: %s | τ: %s",
            self.batch_size or "each silo's own loader batch size",
            self.local_steps or "each silo's own step count (kept from its first round)",
        )
        flwr_log(INFO, "\t\t├── Balancer: %s", getattr(self.balancer, "__name__", self.balancer))
        flwr_log(
            INFO,
            "\t\t└── Stability guard: %s",
            "off (full balance)"
            if self.guard is None
            else f"no silo below {self.guard.floor:.0%} of the mean batch; blow-ups left out",
        )

    # ---- nodes and sizes ---------------------------------------------------------------
    def _round(self, flower_round: int) -> int:
        """The run's round number (Flower's loop restarts at 1 after a resume)."""
        return flower_round + self._offset

    def _sample(self, fraction: float, minimum: int, grid: Grid) -> tuple[list[int], list[int]]:
        """(every eligible node, those sampled: FedAvg's count, ⌊fraction·n⌋ but at
        least `minimum`, of the silos not left out)."""
        # Before this process's first round (a fresh run, or a resumed one whose silos are
        # reconnecting) wait for all the silos expected; later, go on with those present.
        nodes = self.members.eligible(grid, first=not self._sent)
        count = min(len(nodes), max(int(len(nodes) * fraction), minimum, 1))
        chosen = nodes if count >= len(nodes) else sorted(self._rng.sample(nodes, count))
        return nodes, chosen

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

    def _start_from_profiles(self, grid: Grid, arrays: ArrayRecord, nodes: list[int]) -> None:
        """Round 1 balanced: the silos' stored speed profiles as their first reports,
        when this server has balanced this model before and every sampled silo has one."""
        if self._model_key is None and self.he is None:
            self._model_key = model_key(arrays)
        if self._model_key is None or not seen_before(self._model_key):
            return
        found = ask_profiles(grid, nodes, self._model_key)
        missing = [n for n in nodes if n not in found]
        if missing:
            say(
                INFO,
                "round 1 at every silo's B0: %d of %d silos have no usable stored speed "
                "profile for this model and hardware (none, one too old, or a damaged one, "
                "which is named in the log of the silo or of this server)",
                len(missing),
                len(nodes),
            )
            return
        said = {n: profile_report(p, partition) for n, (p, partition) in found.items()}
        for node, report in said.items():
            self.members.name(node, report.partition_id)
        manager = self._start_balancing(said)
        if self.guard is not None:
            manager.set_min_share(max(self.guard.floor, self._user_floor))
        # a profile is the mean of the rounds it was measured over: as many reports (a
        # single one would leave silos within the tuner's noise prior pooled)
        for repeat in range(max(p.rounds for p, _ in found.values())):
            manager.step(
                [self._load_report(n, r) for n, r in said.items() if found[n][0].rounds > repeat]
            )
        self._profiled = {n: p for n, (p, _) in found.items()}
        say(
            INFO,
            "round 1 balanced from the silos' stored speed profiles (%s): sizes %s",
            ", ".join(
                f"{self.members.label(n)} {p.speed:.0f} samples/s, {p.age_s / 3600:.1f} h old"
                for n, p in sorted(self._profiled.items())
            ),
            self.sizes_by_silo(),
        )

    def _start_balancing(self, said: Mapping[int, SiloReport]) -> BatchSizeManager:
        """The balancer, from the silos' first reports (or their stored profiles)."""
        initial = {str(n): self._initial_load(r) for n, r in sorted(said.items())}
        self.manager = self.members.start_balancing(self.balancer, initial, said)
        # a floor the user set stays the least the guard keeps
        self._user_floor = float(getattr(self.manager.tuner, "min_share", 0.0))
        return self.manager

    def _check_profiles(self, said: Mapping[int, SiloReport]) -> None:
        """After round 1: say which stored profiles the measurement contradicts (the
        estimator follows the measurement from here, as after any change of speed)."""
        for node, profile in self._profiled.items():
            report = said.get(node)
            ratio = stale(profile, report) if report is not None else None
            if ratio is not None:
                say(
                    WARNING,
                    "%s's stored speed profile was stale: it ran at %.2fx the stored %.0f "
                    "samples/s; re-measured from now on",
                    self.members.label(node),
                    ratio,
                    profile.speed,
                )
        self._profiled = {}
        if self.profiles and self._model_key is not None:
            remember_model(self._model_key)

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
        if not self._own_loop:
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
                self._start_from_profiles(grid, arrays, nodes)
            if self.manager is not None:
                self.members.sync(self.manager, present, nodes)
            flwr_log(
                INFO, "configure_train: Sampled %s nodes (out of %s)", len(nodes), len(present)
            )
            self.updates.new_round(arrays)
            messages = []
            self._sent = {}
            for node in nodes:
                orders = self._orders(server_round, node)
                self._sent[node] = (orders.batch_size, orders.local_steps)
                # A new RecordDict per node: Message does not copy its content.
                content = RecordDict(
                    {
                        self.arrayrecord_key: arrays,
                        self.configrecord_key: self._node_config(node, orders, config),
                    }
                )
                messages.append(
                    Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
                )
            self._messages = messages
            self._started = time.monotonic()
            return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round = self._round(server_round)
        with self.rounds.server_time():
            replies = list(replies)
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
            contents = [m.content for m in valid]
            if self.he is not None:
                assert self.updates.global_arrays is not None
                arrays: ArrayRecord = self.he.average(
                    [self.updates.ciphertexts[id(m)] for m in valid],
                    [self.updates.weight(m) for m in valid],
                    self.updates.global_arrays,
                )
            else:
                arrays = aggregate_arrayrecords(contents, self.weighted_by_key)
            self._aggregated = arrays
            if self.audit_dir is not None:
                updates = {
                    m.metadata.src_node_id: (
                        self.updates.weight(m),
                        next(iter(m.content.array_records.values())),
                    )
                    for m in valid
                }
                audit_round(self.audit_dir, server_round, updates, arrays)
            metrics = self.train_metrics_aggr_fn(
                [RecordDict({"metrics": user_metrics(only_metrics(m))}) for m in valid],
                self.weighted_by_key,
            )
            for key, field in ROUND_FIGURES.items():
                value = getattr(record, field)
                if value is not None:
                    metrics[key] = float(value)
            return arrays, metrics

    def _collect(
        self, server_round: int, replies: list[Message]
    ) -> tuple[list[Message], RoundRecord]:
        """Check replies, feed the balancer, and describe the round."""
        wall = time.monotonic() - self._started
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in self._messages}
        triage = triage_replies(replies, sent_to, self.updates)
        failed = triage.failed
        for node in triage.unreachable:
            self.members.bench(node, server_round, "unreachable", self.manager)
        for node in self._sent:
            if node not in triage.answered:
                failed.append(f"{node_label(node)}: no reply within the round timeout")
                self.members.bench(
                    node, server_round, "no reply within the round timeout", self.manager
                )
        valid = triage.valid
        for line in failed:
            say(WARNING, "round %d: %s", server_round, line)
        valid = self.members.one_vote_each(server_round, valid, failed)
        kept = self._keep(server_round, valid)
        failed += [
            f"{node_label(m.metadata.src_node_id)}: not among the quorum"
            for m in valid
            if m not in kept
        ]
        reports: dict[int, WorkerReport] = {}
        said: dict[int, SiloReport] = {}
        app_numbers: dict[int, dict[str, float]] = {}
        rejected: list[str] = []
        for msg in kept:
            node = msg.metadata.src_node_id
            metrics = only_metrics(msg)
            app_numbers[node] = numbers(metrics)
            report, why = self.report_check.read(node, metrics, self._sent.get(node, (0, 0)))
            if report is None:
                say(
                    WARNING,
                    "round %d: report of node %d dropped (its update is used): %s",
                    server_round,
                    node,
                    why,
                )
                rejected.append(f"{self.members.label(node)}: {why}")
                continue
            self.members.name(node, report.partition_id)
            said[node] = report
            reports[node] = self._load_report(node, report)
        if self.profiles and server_round == self._offset + 1:
            self._check_profiles(said)
        if self.manager is None and said:  # the first reports: each silo's own B0 and τ
            self._start_balancing(said)
        # The guard first: the floor it sets bounds this step's sizes.
        diverged = self._guard_round(server_round, said, app_numbers, triage.blown_up)
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
            else self.members.step(self.manager, said, reports, rejected, self._initial_load)
        )
        balancer_s = time.perf_counter() - stepped
        arrived = self._polling.replied_s if self._polling is not None else {}
        record = round_record(
            server_round,
            reports,
            said,
            app_numbers,
            dict(self.members.labels),
            next_sizes,
            self._sent,
            wall,
            self.weighted_by_key,
            {n: arrived[i] for i, n in sent_to.items() if i in arrived},
        )
        record.failed = failed
        record.rejected = rejected
        record.events = self.members.take_events()
        record.balancer_s = balancer_s if self.manager is not None else None
        return kept, record

    def _guard_round(
        self,
        server_round: int,
        said: Mapping[int, SiloReport],
        app_numbers: Mapping[int, Mapping[str, float]],
        blown_up: list[int],
    ) -> dict[int, str]:
        """The stability guard's verdict on the round: the diverged updates (node -> why),
        to leave out; the silos' floor moved (and the sizes with it) when it says so."""
        if self.guard is None:
            return {}
        # Per local step: a silo with more steps (a bigger dataset, τ = len(its loader))
        # moves the model further without diverging.
        norms = {
            worker_name(n): r.update_norm / r.local_steps
            for n, r in said.items()
            if r.update_norm is not None
        }
        # updates rejected for NaN or infinity: left out already, and a blow-up all the same
        norms.update({worker_name(n): math.inf for n in blown_up})
        losses = {
            worker_name(n): loss
            for n in said
            if (loss := first_number(app_numbers.get(n, {}), TRAIN_LOSS_NAMES)) is not None
        }
        sizes = {worker_name(n): r.batch_size for n, r in said.items()}
        verdict = self.guard.check(norms, losses, sizes)
        found = {n: why for n, why in by_node(verdict.diverged).items() if n not in blown_up}
        for node, why in found.items():
            say(
                WARNING,
                "round %d: %s's update diverged and is left out of the average: %s",
                server_round,
                self.members.label(node),
                why,
            )
        if self.manager is not None:
            floor = max(self.guard.floor, self._user_floor)
            if getattr(self.manager.tuner, "min_share", floor) != floor:
                self.manager.set_min_share(floor)
                say(
                    WARNING if floor > verdict.floor_before else INFO,
                    "round %d: %s round (dispersion of the silos' updates %s): every silo "
                    "gets at least %.0f%% of the mean batch from now on",
                    server_round,
                    verdict.look,
                    "–" if verdict.dispersion is None else f"{verdict.dispersion:.2f}",
                    100 * floor,
                )
        return found

    # ---- evaluation --------------------------------------------------------------------
    def _evaluation_due(self, server_round: int) -> bool:
        return server_round >= 1 and (
            server_round % self.evaluate_every == 0 or server_round == self._num_rounds
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round = self._round(server_round)
        with self.rounds.server_time():
            due = server_round == self._num_rounds or (
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
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: eval_config})
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
        if not self._own_loop and self._aggregated is not None:
            # A subclass's own loop: this is the round's last hook fedlb sees (its
            # evaluate_fn runs after it), so the round is finished here.
            self._finish_round(server_round, self._aggregated, last=True)
        with self.rounds.server_time():
            if not valid:
                return None
            return self.evaluate_metrics_aggr_fn(
                [RecordDict({"metrics": user_metrics(only_metrics(m))}) for m in valid],
                self.weighted_by_key,
            )

    # ---- the run -----------------------------------------------------------------------
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's own round loop (`Strategy.start`: its log, its `Result`), with replies
        polled every `poll_interval` s. After `restore(checkpoint)` it runs the rounds
        after the checkpoint's (pass the returned model as `initial_arrays`): Flower's
        loop counts them from 1 again, fedlb's records and the Result use the run's
        round numbers. Under HE, `Result.arrays` is an `EncryptedModel`."""
        self._num_rounds = num_rounds
        self._own_loop = True
        if self.profiles:
            self._model_key = model_key(initial_arrays)  # plaintext: under HE too
        done = self._offset
        if self.he is not None:
            if evaluate_fn is not None:
                raise ValueError(
                    "under HE the server holds only ciphertexts and cannot evaluate the "
                    "model: pass no evaluate_fn (silos evaluate it: federated evaluation)"
                )
            initial_arrays = self.he.encrypt(initial_arrays)
        if done:
            say(
                INFO,
                "Flower's round counter below starts at 1 again: its [ROUND 1/%d] is the "
                "run's round %d of %d",
                num_rounds - done,
                done + 1,
                num_rounds,
            )
        if self.poll_interval is not None:
            grid = self._polling = PollingGrid(grid, self.poll_interval)
        server_evaluate = None
        if evaluate_fn is not None:
            inner = evaluate_fn

            def server_evaluate(flower_round: int, arrays: ArrayRecord) -> MetricRecord | None:
                metrics = inner(self._round(flower_round), arrays)
                self.rounds.server_evaluated(self._round(flower_round), metrics)
                return metrics

        result = super().start(
            grid=grid,
            initial_arrays=initial_arrays,
            num_rounds=num_rounds - done,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=server_evaluate,
        )
        self._finish_round(num_rounds, result.arrays or initial_arrays, last=True)
        if done:
            for history in (
                result.train_metrics_clientapp,
                result.evaluate_metrics_clientapp,
                result.evaluate_metrics_serverapp,
            ):
                shifted = {r + done: m for r, m in history.items()}
                history.clear()
                history.update(shifted)
        if self.he is not None:
            result.arrays = EncryptedModel(result.arrays or initial_arrays)
        return result

    def _foreign_loop(self, grid: Grid) -> None:
        """A subclass overrode `start()` without calling this class's: Flower's hooks
        (configure_*/aggregate_*) still balance every round and write its record; polling
        is put on the grid the loop uses; what only `start()` can do is said once."""
        if self.poll_interval is not None and not isinstance(grid, PollingGrid):
            polling = PollingGrid(grid, self.poll_interval)
            with contextlib.suppress(AttributeError):  # the loop calls this grid's method
                grid.send_and_receive = polling.send_and_receive  # type: ignore[method-assign]
                self._polling = polling
        if self._told_foreign_loop:
            return
        self._told_foreign_loop = True
        say(
            WARNING,
            "%s.start() does not call LoadBalancedFedAvg.start(): fedlb balances every round "
            "from Flower's hooks, polls replies every %s s and writes each round's record at "
            "aggregate_evaluate; without its start() the records lack the server-side "
            "evaluation (your evaluate_fn's results stay in your Result), evaluate_every > 1 "
            "cannot tell the last round, a restored checkpoint is not resumed, and under HE "
            "Result.arrays stays ciphertext. Call super().start(...) to keep them.",
            type(self).__name__,
            self.poll_interval,
        )

    def _finish_round(self, server_round: int, arrays: ArrayRecord, last: bool = False) -> None:
        """Round `server_round` is wholly done (Flower's server-side evaluation included):
        close its record and, with `checkpoint_dir`, checkpoint it with its model."""
        if server_round < 1 or (server_round <= self._offset and not last):
            return
        if server_round <= self._finished and not self._own_loop:
            return  # a foreign loop's aggregate_evaluate finished it already
        self._finished = max(self._finished, server_round)
        # Unless the next round's replies carry its evaluation, its record is complete.
        self.rounds.close(server_round, publish=last or not self.evaluate_with_train)
        if self.checkpoint_dir is not None and server_round > self._offset:
            save_checkpoint(
                self.checkpoint_dir,
                Checkpoint(
                    server_round, self._num_rounds, arrays, self.state_dict(), self.run_settings
                ),
            )

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of this strategy (JSON-serialisable)."""
        return strategy_state(self.manager, self._rng, self.members, self.rounds)

    def restore(self, checkpoint: Checkpoint) -> ArrayRecord:
        """Take up a checkpointed run: the balancer with its estimators and tuner, the
        sampling RNG, labels, silos left out, and the last round's record. `start` then
        runs the rounds after `checkpoint.round`; pass it the returned model."""
        self.manager = restore_strategy_state(
            checkpoint.strategy, self.balancer, self._rng, self.members, self.rounds
        )
        if self.guard is not None and self.manager is not None:
            # the floor the run had reached is in the tuner's state: the guard goes on there
            share = float(getattr(self.manager.tuner, "min_share", 0.0))
            self.guard.resume_at(share)
        self._offset = checkpoint.round
        return checkpoint.arrays
