"""LoadBalanced: any Flower strategy, its silos each at their own batch size.

The class holds Flower's round (configure/aggregate train and evaluate, start), the wire
(what each message carries, packed or not) and the hooks its variants override. fedlb's
side of each round is one object it holds, `balance` (round_balance.RoundBalance: the
balancer, the guard, what each silo was told, a round's replies read into its record);
the run's records are a part of their own (records: round records, rounds.jsonl,
checkpoints). Each other concern lives beside it: what can be wrapped and how fedlb stays
out of the wrapped strategy's sight (composition), averaging under HE and metrics
(aggregation), the silos taking part (membership, grid), rounds closed in the run's
numbering (round_close)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedlb.balance import BatchSizeManager, StabilityGuard, WorkerReport

from .aggregation import (
    app_metrics,
    audit,
    encrypted_average,
    encrypted_start,
    with_round_figures,
)
from .balancing import describe_balancing
from .claims import Claims
from .composition import (
    LEGACY_HOOKS,
    as_stock,
    chain,
    check_wrappable,
    dtypes_of,
    innermost,
    legacy_refusal,
    refuse_mixing,
    silos_expected,
    silos_needed,
    weighting_key,
)
from .driving import Driving, NoUsableUpdateError
from .edge import normalize_by_steps
from .grid import PollingGrid, SiloView, sampled
from .he import EncryptedAggregation, EncryptedModel
from .membership import Membership, say
from .options import Balancing, Joining, Keeping
from .outgoing import Packing, held_back, in_sent_dtypes, own_content
from .packing import unpack_in_place
from .profiles import model_key
from .protocol import EVAL_EXAMPLES, Orders, SiloReport
from .records import (
    Checkpoint,
    RoundLog,
    RoundReporter,
    attach_evaluation,
    balance_line,
    save_checkpoint,
)
from .replies import UpdateCheck
from .round_balance import RoundBalance
from .round_close import (
    EvaluateFn,
    RunProgress,
    in_run_rounds,
    progress_writer,
    recorded_evaluate,
)
from .run_dir import deployed, write_summary
from .stability import fixed_rounds_advice
from .state import restore_strategy_state, strategy_state

__all__ = ["LoadBalanced", "NoUsableUpdateError"]


class LoadBalanced(Strategy):
    """Any Flower strategy whose silos each get their own batch size, so all finish a
    round together.

    Wraps `strategy` as Flower's DP wrappers do: every hook is the wrapped strategy's (its
    sampling, its config keys such as FedProx's `proximal-mu`, its aggregation with its
    server optimizer and state, its metrics). fedlb adds each silo's batch size B_i and
    local steps τ to the train messages it builds, reads its reports out of the replies
    before the wrapped strategy sees them, and hands it the replies a stock run would
    (fedlb's metric keys taken out, the model unpacked, in its own record keys). τ and
    the learning rate are the app's and never tuned (LB-BSP Section 3.5: tuning either
    biases the model on non-IID data); only B_i moves, decided by a `BatchSizeManager`
    from each silo's measured compute seconds and fixed costs, with X = Σ B_i kept. The
    weights stay the wrapped strategy's (FedAvg's local dataset sizes), never samples
    processed, so a fast silo gains no bigger say. The silos' ClientApp needs
    `balance_mod()` and `balanced_loader` (fedlb.flower.dropin).

    Round 1 runs as the app wrote it: each silo draws its own loader's batch size B0 for
    as many steps as its loop runs, and reports both (X = Σ B0_i, τ_i = the silo's steps).
    From round 2 each silo draws its own B_i.

    Put LoadBalanced outermost (inside another wrapper it balances, and says what it
    cannot do: docs/strategies.md). A strategy with a `start()` loop of its own keeps it:
    `LoadBalanced.start` runs that loop with fedlb's hooks around its own.

    Args:
        strategy: the strategy to balance (a `flwr.serverapp.strategy.Strategy`). Refused
            with the reason: Flower's legacy strategies, XGBoost's (nothing to balance),
            one already balanced, and under HE one that must read plaintext updates.
        balancing: how each silo's batch size is decided (`Balancing`: B0, τ, the
            balancer, the stability guard, round 1 from stored profiles).
        joining: which silos take part (`Joining`: how many to wait for, how long, how
            long a silo that missed a round sits out). Default: as many as the wrapped
            strategy's `min_available_nodes`.
        keeping: what the run keeps (`Keeping`: the round reporter, checkpoints, the
            run's settings, an audit of every round's updates).
        evaluate_every: federated evaluation every k rounds and after the last.
            Default 1 (as Flower's strategies).
        evaluate_with_train: fedlb's own silo app only: the silo evaluates the model it
            receives before training and reports it with its update (one round trip
            instead of two); only the final model gets an evaluate phase. Default False.
        poll_interval: seconds between pulls of replies (Flower's deployment Grid
            sleeps 3 s). Default 0.1; None keeps Flower's.
        he: CKKS aggregation (`EncryptedAggregation` over a public context): the initial
            model is encrypted, replies must be ciphertexts under the run's key, and the
            weighted average is computed on ciphertexts (a strategy that aggregates as
            FedAvg does only). `Result.arrays` is then an `EncryptedModel`. Default None.
        pack_model: the model travels as one array between this server and silos that
            run `balance_mod()` (fedlb.flower.packing); invisible to the wrapped
            strategy and the app. Default True.
        stop_after: rounds in a row without a model to go on from (no usable update, or
            the wrapped strategy aggregated nothing) after which the run stops with
            `NoUsableUpdateError`, instead of running on a frozen model. Default 3.
    """

    _fedlb_balances = True  # composition.BALANCES: never wrapped twice

    def __init__(
        self,
        strategy: Strategy,
        *,
        balancing: Balancing = Balancing(),  # noqa: B008 (frozen: shared safely)
        joining: Joining = Joining(),  # noqa: B008
        keeping: Keeping = Keeping(),  # noqa: B008
        evaluate_every: int = 1,
        evaluate_with_train: bool = False,
        poll_interval: float | None = 0.1,
        he: EncryptedAggregation | None = None,
        pack_model: bool = True,
        stop_after: int = 3,
    ) -> None:
        check_wrappable(strategy, he is not None)
        if evaluate_every < 1:
            raise ValueError(f"evaluate_every must be >= 1, got {evaluate_every}")
        self.driving = Driving(stop_after)
        self.strategy = strategy
        self.weighted_by_key = weighting_key(strategy)
        self.batch_size = balancing.batch_size
        self.local_steps = balancing.local_steps
        self.evaluate_every = evaluate_every
        self.evaluate_with_train = evaluate_with_train
        self.poll_interval = poll_interval
        # run by `fedlb server --app`: the run's folder, and where to go on from
        given = keeping
        keeping, self._resume_from = deployed(keeping)
        self._writes_summary = keeping is not given
        reporter = keeping.reporter
        self.rounds = RoundLog(reporter if reporter is not None else RoundReporter())
        self.audit_dir = keeping.audit_dir
        self.checkpoint_dir = keeping.checkpoint_dir
        self.run_settings = dict(keeping.run_settings)
        self.he = he
        self.pack_model = pack_model and he is None
        self.members = Membership(
            joining.expected_silos or silos_expected(strategy),
            joining.join_timeout,
            joining.rejoin_grace,
        )
        self.claims = Claims(self.weighted_by_key, joining.examples, joining.max_share)
        self.updates = UpdateCheck(self.weighted_by_key, he, label=self.members.label)
        self.progress = RunProgress()
        self.balance = RoundBalance(
            balancing,
            self,
            encrypted=he is not None,
            weighted_by_key=self.weighted_by_key,
            claims=self.claims,
            members=self.members,
            updates=self.updates,
            progress=self.progress,
            driving=self.driving,
        )
        self._messages: list[Message] = []  # this round's train messages
        self._packing: Packing | None = None  # this round's model on the wire
        self._sent_model: dict[str, tuple[tuple[int, ...], str]] = {}  # shapes and dtypes
        self._started = 0.0
        self._aggregated: ArrayRecord | None = None  # the model the last round ended with
        self._polling: PollingGrid | None = None  # its replies' arrival times per round
        self._ready = True  # from here, the wrapped strategy's attributes are set on it

    # Attributes the wrapped strategy owns (FedAvg's `fraction_train`, a subclass's own)
    # read and written through the wrapper, so it stands in for the strategy it wraps.
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "strategy" not in self.__dict__:
            raise AttributeError(name)
        if name in LEGACY_HOOKS:
            raise AttributeError(legacy_refusal(name))
        return getattr(self.__dict__["strategy"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("strategy")
        if (
            inner is not None
            and self.__dict__.get("_ready", False)
            and name not in self.__dict__
            and not hasattr(type(self), name)
            and hasattr(inner, name)
        ):
            setattr(inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_mixing(cls, LoadBalanced)

    @property
    def reporter(self) -> RoundReporter:
        """Where finished round records go (their console table, rounds.jsonl)."""
        return self.rounds.reporter

    # fedlb's side of the rounds (`balance`), as its users read it off the strategy
    @property
    def manager(self) -> BatchSizeManager | None:
        """The balancer (None before the silos' first reports)."""
        return self.balance.manager

    @manager.setter
    def manager(self, manager: BatchSizeManager | None) -> None:
        self.balance.manager = manager

    @property
    def guard(self) -> StabilityGuard | None:
        """The stability guard (None: `Balancing(guard=False)`)."""
        return self.balance.guard

    def current_sizes(self) -> dict[int, int]:
        """Every known silo's batch size for the next round, by node id."""
        return self.balance.current_sizes()

    def sizes_by_silo(self) -> dict[str, int]:
        """The same, by silo label (silo-<partition-id> where known)."""
        return self.balance.sizes_by_silo()

    def summary(self) -> None:
        """What Flower logs at the start: the wrapped strategy's, then fedlb's balancing."""
        flwr_log(
            INFO, "\t├──> Balancing (fedlb): %s", " ⊃ ".join(type(s).__name__ for s in chain(self))
        )
        self.strategy.summary()
        describe_balancing(self.batch_size, self.local_steps, self.balance.balancer, self.guard)

    def _hook(self, name: str) -> Callable[..., Any]:
        """The wrapped strategy's own hook (not fedlb's, while its own loop runs them)."""
        return self.driving.hook(self.strategy, name)

    # ---- nodes and sizes ---------------------------------------------------------------
    def _round(self, flower_round: int) -> int:
        """The run's round number (Flower's loop restarts at 1 after a resume)."""
        return self.progress.run_round(flower_round)

    def _view(self, grid: Grid, first: bool) -> SiloView:
        return SiloView(grid, self.members, first, silos_needed(self.strategy))

    # Hooks the experiment-only variants (fedlb.experiments) override ------------------
    def _load_report(self, node: int, report: SiloReport) -> WorkerReport:
        """The balancer's view of a silo's report (its load unit: samples per step)."""
        return report.worker_report(node)

    def _initial_load(self, report: SiloReport) -> int:
        """A silo's starting size in the balancer's unit, from its first report."""
        return report.batch_size

    def _keep(self, server_round: int, valid: list[Message]) -> list[Message]:
        """The updates to aggregate (all of them; the quorum variant keeps the fastest)."""
        return valid

    def _orders(self, server_round: int, node: int) -> Orders:
        """What `node` is told to run this round."""
        size = self.balance.size_of(node)
        return Orders(
            notice=self.balance.notices.pop(node, ""),
            server_round=server_round,
            batch_size=size if size is not None else self.batch_size,
            local_steps=self.local_steps,
            round_steps=self.balance.round_steps.get(node),
            evaluate_first=self.evaluate_with_train and self._evaluation_due(server_round - 1),
        )

    def _node_config(self, node: int, orders: Orders, config: ConfigRecord) -> ConfigRecord:
        """The train ConfigRecord `node` gets: the strategy's config plus its orders."""
        return orders.into(config)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round = self._round(server_round)
        if not self.progress.own_loop:
            polling = self.driving.foreign(
                self, grid, self.poll_interval, self.progress, self.he is not None
            )
            self._polling = polling or self._polling
            if self.he is not None:  # a foreign loop starts from the plaintext model
                arrays = self.he.encrypt(arrays)
        self.driving.check_aggregated(self, LoadBalanced, server_round, bool(self._messages))
        self._finish_round(server_round - 1, arrays)
        self.rounds.server_s = 0.0
        with self.rounds.server_time():
            first = self.driving.configured is None
            self.driving.configured = server_round
            view = self._view(grid, first)
            made = self._configure("configure_train", server_round, arrays, config, view)
            messages = held_back(made, view, self.members.label, self._inner_name)
            train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
            nodes = [m.metadata.dst_node_id for m in train]
            present = view.listed if view.listed is not None else sorted(grid.get_node_ids())
            self.balance.begin_round(server_round, grid, arrays, config, nodes, present, first)
            self.updates.new_round(arrays)
            self._sent_model = dtypes_of(arrays) if self.he is None else {}
            self._packing = Packing.of(arrays, self._may_pack())
            preferred = getattr(innermost(self.strategy), "configrecord_key", None)
            for msg in train:
                node = msg.metadata.dst_node_id
                orders = self._orders(server_round, node)
                self.balance.told(node, orders.batch_size, orders.round_steps or orders.local_steps)
                packing = self._packing if node in self.balance.reporting else None
                own_content(msg, preferred, partial(self._node_config, node, orders), packing)
            self._messages = train
            self._started = time.monotonic()
            if self._polling is not None:
                self._polling.on_reply = progress_writer(
                    self.reporter, self.members.label, server_round, train
                )
            return messages

    def _configure(
        self,
        hook: str,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        view: SiloView,
    ) -> list[Message]:
        """The wrapped strategy's messages for the round, sampled from `view`."""
        call = partial(self._hook(hook), server_round, arrays, config)
        return sampled(call, view, self.strategy, server_round, self.driving.once)

    @property
    def _inner_name(self) -> str:
        return type(self.strategy).__name__

    def _may_pack(self) -> bool:
        """Whether the model may travel packed this round: plaintext, fedlb's own hooks
        seeing every reply first (no outer strategy, no subclass aggregating on its own),
        and some silo whose reply carried fedlb's report last time (its `balance_mod()`
        unpacks it; only those silos get it packed)."""
        return (
            self.pack_model
            and self.driving.outer is None
            and type(self).aggregate_train is LoadBalanced.aggregate_train
            and bool(self.balance.reporting)
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round = self._round(server_round)
        self.driving.aggregated = server_round
        with self.rounds.server_time():
            replies = list(replies)
            if self._polling is not None:  # an evaluation or a query is not the round
                self._polling.on_reply = None
            if self._packing is not None:  # before anything reads them
                for msg in replies:
                    unpack_in_place(msg, self._packing.layout)
            valid, record = self.balance.collect(
                server_round,
                replies,
                {m.metadata.message_id: m.metadata.dst_node_id for m in self._messages},
                time.monotonic() - self._started,
                self._polling.replied_s if self._polling is not None else {},
            )
            if self.evaluate_with_train and self.rounds.pending is not None:
                # These replies carry the evaluation of the model this round started
                # from: the previous round's result.
                attach_evaluation(self.rounds.pending, valid, EVAL_EXAMPLES)
            self.rounds.open(record)
            say(INFO, "%s", balance_line(record))
            errors = [m for m in replies if m.has_error()]
            arrays, metrics = self._aggregate(server_round, valid, errors)
            if arrays is None:
                why = "no usable update" if not valid else f"{self._inner_name} aggregated none"
                self.driving.no_model(server_round, why, bool(self._messages))
                return None, (None if metrics is None else with_round_figures(metrics, record))
            self.driving.barren = 0
            arrays = in_sent_dtypes(arrays, self._sent_model, self._inner_name, self.driving.once)
            self._aggregated = arrays
            if self.audit_dir is not None:
                audit(self.audit_dir, server_round, valid, self.updates, arrays)
            return arrays, with_round_figures(metrics or MetricRecord(), record)

    def _aggregate(
        self, server_round: int, valid: list[Message], errors: list[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The wrapped strategy's aggregation of the kept updates, handed over as a stock
        run would (and its failures); under HE fedlb's average of the ciphertexts, with
        the strategy's metric aggregation."""
        if self.he is None:
            sent = self.updates.global_arrays
            if self.balance.round_steps and sent is not None:  # the edge lever: FedNova first
                normalize_by_steps(valid, sent, self.balance.ran_steps, self.updates.weight)
            stock = [as_stock(m) for m in valid] + errors
            return self._hook("aggregate_train")(server_round, stock)  # type: ignore[no-any-return]
        if not valid:
            return None, None
        arrays = encrypted_average(valid, self.updates, self.he, self.weighted_by_key)
        # under HE the strategy aggregates as FedAvg does (composition.check_wrappable)
        metrics_fn = self.strategy.train_metrics_aggr_fn  # type: ignore[attr-defined]
        return arrays, app_metrics(valid, metrics_fn, self.weighted_by_key)

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
            if not due:
                return []
            view = self._view(grid, first=False)
            made = self._configure("configure_evaluate", server_round, arrays, config, view)
            messages = held_back(made, view, self.members.label, self._inner_name)
            if messages:
                self.rounds.evaluation_sent()
            packing = Packing.of(arrays, self._may_pack())
            preferred = getattr(innermost(self.strategy), "configrecord_key", None)
            for msg in messages:
                own = packing if msg.metadata.dst_node_id in self.balance.reporting else None
                own_content(msg, preferred, lambda c: ConfigRecord(dict(c)), own)
            return messages

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        server_round = self._round(server_round)
        with self.rounds.server_time():
            replies = list(replies)
            answered = [m for m in replies if not m.has_error()]
            valid, unusable = self.updates.evaluations(answered)
            for line in unusable:
                say(WARNING, "round %d: evaluation from %s", server_round, line)
            self.rounds.evaluated(server_round, valid, self.weighted_by_key)
        if not self.progress.own_loop and self._aggregated is not None:
            # A loop of another strategy or subclass: this is the round's last hook fedlb
            # sees (its evaluate_fn runs after it), so the round is finished here.
            self._finish_round(server_round, self._aggregated, last=True)
        with self.rounds.server_time():
            stock = [as_stock(m) for m in valid] + [m for m in replies if m.has_error()]
            return self._hook("aggregate_evaluate")(server_round, stock)  # type: ignore[no-any-return]

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
        """Flower's round loop (`Strategy.start`: its log, its `Result`; or the wrapped
        strategy's own `start()` where it has one, with fedlb's hooks around its own),
        with replies polled every `poll_interval` s. After `restore(checkpoint)` it runs
        the rounds after the checkpoint's (pass the returned model as `initial_arrays`):
        Flower's loop counts them from 1 again, fedlb's records and the Result use the
        run's round numbers. Under HE, `Result.arrays` is an `EncryptedModel`."""
        if self._resume_from is not None and not self.progress.offset:
            say(INFO, "going on from %s", self._resume_from.story(num_rounds))
            initial_arrays = self.restore(self._resume_from)
        done = self.progress.begin(num_rounds)
        if self.balance.profiles:  # plaintext: under HE too
            self.balance.stored_profiles.model = model_key(initial_arrays)
        if self.he is not None:
            initial_arrays = encrypted_start(self.he, initial_arrays, evaluate_fn is not None)
        self.progress.say_resumed()
        if self.poll_interval is not None:
            grid = self._polling = PollingGrid(grid, self.poll_interval)
        arguments: dict[str, Any] = {
            "grid": grid,
            "initial_arrays": initial_arrays,
            "num_rounds": num_rounds - done,
            "timeout": timeout,
            "train_config": train_config,
            "evaluate_config": evaluate_config,
            "evaluate_fn": recorded_evaluate(evaluate_fn, self.progress, self.rounds),
        }
        if type(self.strategy).start is Strategy.start:
            result = super().start(**arguments)
        else:
            with self.driving.around_own_loop(self, self.strategy):
                result = self.strategy.start(**arguments)
        self._finish_round(num_rounds, result.arrays or initial_arrays, last=True)
        if (advice := fixed_rounds_advice(self.reporter.summary(), num_rounds)) is not None:
            say(INFO, "%s", advice)
        in_run_rounds(result, done)
        if self._writes_summary:
            write_summary(
                self.reporter, {"final_sizes": self.sizes_by_silo(), "resumed_after": done}
            )
        if self.he is not None:
            result.arrays = EncryptedModel(result.arrays or initial_arrays)
        return result

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
        """What a resumed run needs of fedlb's side of the strategy (JSON-serialisable)."""
        state = strategy_state(self.manager, self.members, self.rounds)
        state["examples"] = self.claims.state_dict()
        return {**state, **self.balance.state_dict()}

    def restore(self, checkpoint: Checkpoint) -> ArrayRecord:
        """Take up a checkpointed run: the balancer with its estimators and tuner, labels,
        silos left out, and the last round's record. `start` then runs the rounds after
        `checkpoint.round`; pass it the returned model."""
        self.manager = restore_strategy_state(
            checkpoint.strategy, self.balance.balancer, self.members, self.rounds
        )
        self.balance.load_state_dict(checkpoint.strategy)
        self.claims.load_state_dict(checkpoint.strategy.get("examples") or {})
        self.progress.offset = checkpoint.round
        return checkpoint.arrays
