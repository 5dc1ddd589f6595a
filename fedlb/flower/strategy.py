"""LoadBalancedFedAvg: FedAvg with per-silo batch sizes tuned from measured throughput."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedlb.balance import (
    EMA,
    BatchSizeManager,
    Proportional,
    SpeedEstimator,
    Tuner,
    WorkerReport,
    ideal_round_time,
)
from fedlb.he import CiphertextError

from .checkpoint import Checkpoint, CheckpointError, save_checkpoint
from .grid import PollingGrid
from .he import EncryptedAggregation
from .report import RoundRecord, RoundReporter, SiloRound, record_from_dict, record_to_dict

log = logging.getLogger("fedlb.flower")

# Metrics a silo's train reply carries (see fedlb.flower.silo).
REPORT_KEYS = ("batch-size", "local-steps", "compute-s", "overhead-s")


def default_estimator() -> SpeedEstimator:
    """EMA with α = 0.2 (the paper's), restarting on a lasting ≥ 25% change of speed."""
    return EMA(alpha=0.2, restart_threshold=0.25, restart_after=2)


class LoadBalancedFedAvg(FedAvg):
    """FedAvg whose silos each get their own batch size, so all finish a round together.

    τ (local steps) and the learning rate η are the same for every silo and never tuned
    (LB-BSP Section 3.5: tuning either biases the model on non-IID data). Only B_i moves,
    decided by a `BatchSizeManager` from each silo's measured compute seconds and fixed
    costs, with X = Σ B_i = n·B0 kept. Arrays are averaged weighted by each silo's local
    dataset size (`num-examples`), never by the samples it processed, so a fast silo gains
    no bigger say.

    Round 1 has no measurements: every silo starts at B0 (uniform, as plain FedAvg), and
    the sizes computed from round 1's reports apply from round 2. With
    `probe_steps > 0`, a probe round of that many steps runs first: its reports size
    round 1, its model updates are discarded.

    Args:
        batch_size: B0, every silo's starting batch size. Default 32.
        local_steps: τ, local SGD steps per round. Default 20.
        learning_rate: η sent to every silo. Default 0.05.
        tuner: how sizes move. Default `Proportional()` (overhead-aware LB-BSP
            Algorithm 1); `Static()` gives plain FedAvg.
        estimator: speed-estimator factory, one per silo. Default EMA(α = 0.2) that
            restarts on a lasting ≥ 25% change of speed.
        expected_silos: silos to wait for before round 1 (X = expected_silos·B0).
            Default `min_available_nodes`.
        join_timeout: seconds to wait for them before giving up. Default 600.
        evaluate_every: federated evaluation every k rounds and after the last.
            Default 1 (as FedAvg).
        evaluate_with_train: evaluate the global model inside the next round's train
            message (the silo evaluates what it receives before training; the result is
            reported with its update, and counted in its fixed cost) instead of a separate
            evaluate round trip, which costs about as much framework time as training.
            Only the final model gets a separate evaluate phase. Needs a ClientApp that
            honours the `evaluate` flag (fedlb's does). Default False.
        probe_steps: steps of the optional warm-up probe round. Default 0 (none).
        tune: what the balancer moves: 'batch' (B_i, fedlb's choice) or 'steps' (τ_i with
            B fixed: the Orchestra/FedCompass family, which the LB-BSP paper rejects because
            fast silos then take more local steps and bias the model). Default 'batch'.
        scale_lr_with_batch: η_i = η·B_i/B0 (the paper's other rejected variant: fast
            silos' data gain a bigger say). Default False.
        quorum: keep only the fastest ⌈quorum·n⌉ updates of each round, by the time each
            silo reports (the majority idea of eager-SGD / backup workers); the round
            lasts as long as the slowest kept one. Default None (wait for all).
        poll_interval: seconds between pulls of replies (Flower's own loop sleeps 3 s).
            Default 0.1; None keeps Flower's loop.
        reporter: where round records go. Default a `RoundReporter` that keeps them.
        audit_dir: when set, every round's received updates, their weights and the
            aggregate are written to audit_dir/round-K.npz. Default None.
        seed: seed of node sampling when fraction_train < 1. Default 0.
        rejoin_grace: seconds a silo that missed a round (no reply within the round's
            timeout, or unreachable) is left out while the SuperLink still lists it. A
            killed SuperNode stays listed until its heartbeats lapse (Flower: 2 x 30 s),
            so the default 60 s keeps a dead silo from costing another full timeout; a
            silo still listed after that is alive and is tried again with a fair share.
            Either way X is re-divided among the silos present, and a silo that comes
            back starts afresh: a fair share X/n and a new speed estimate.
        he: CKKS aggregation (`EncryptedAggregation` over a public context): the initial
            model is encrypted, replies must carry ciphertexts under the run's key, and
            the dataset-size-weighted average is computed on ciphertexts; the global
            model stays encrypted, so evaluation is federated only. Default None.
        checkpoint_dir: when set, checkpoint.npz there is replaced (atomically) after
            every round: model, manager and estimators, RNG, round (see `restore`).
            Default None.
        run_settings: the run's settings, stored in checkpoints so a resume can refuse
            different ones. Default None.
        **fedavg: FedAvg's own arguments (fraction_train, min_available_nodes, ...).
    """

    def __init__(
        self,
        *,
        batch_size: int = 32,
        local_steps: int = 20,
        learning_rate: float = 0.05,
        tuner: Tuner | None = None,
        estimator: Callable[[], SpeedEstimator] = default_estimator,
        expected_silos: int | None = None,
        join_timeout: float = 600.0,
        evaluate_every: int = 1,
        evaluate_with_train: bool = False,
        probe_steps: int = 0,
        tune: str = "batch",
        scale_lr_with_batch: bool = False,
        quorum: float | None = None,
        poll_interval: float | None = 0.1,
        reporter: RoundReporter | None = None,
        audit_dir: Path | None = None,
        seed: int = 0,
        rejoin_grace: float = 60.0,
        he: EncryptedAggregation | None = None,
        checkpoint_dir: Path | None = None,
        run_settings: Mapping[str, Any] | None = None,
        **fedavg: Any,
    ) -> None:
        super().__init__(**fedavg)
        if batch_size < 1 or local_steps < 1 or evaluate_every < 1 or probe_steps < 0:
            raise ValueError(
                "batch_size, local_steps and evaluate_every must be >= 1, probe_steps >= 0"
            )
        if not (math.isfinite(learning_rate) and learning_rate > 0):
            raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate}")
        self.batch_size = batch_size
        self.local_steps = local_steps
        self.learning_rate = learning_rate
        self.tuner = tuner if tuner is not None else Proportional()
        self.estimator = estimator
        self.expected_silos = expected_silos or self.min_available_nodes
        self.join_timeout = join_timeout
        self.evaluate_every = evaluate_every
        self.evaluate_with_train = evaluate_with_train
        self.probe_steps = probe_steps
        if tune not in ("batch", "steps"):
            raise ValueError(f"tune must be 'batch' or 'steps', got {tune!r}")
        if quorum is not None and not 0 < quorum <= 1:
            raise ValueError(f"quorum must be a fraction in (0, 1], got {quorum}")
        self.tune = tune
        self.scale_lr_with_batch = scale_lr_with_batch
        self.quorum = quorum
        self.poll_interval = poll_interval
        self.reporter = reporter if reporter is not None else RoundReporter()
        self.audit_dir = audit_dir
        self._eval_started: float | None = None
        self.manager: BatchSizeManager | None = None
        self._rng = random.Random(seed)
        self._num_rounds = 0
        self._sent: dict[int, tuple[int, int]] = {}  # node -> (batch size, steps) sent
        self._messages: list[Message] = []  # this round's train messages (ids set on push)
        self._template: dict[str, tuple[tuple[int, ...], str]] = {}  # global arrays' shapes
        self._started = 0.0
        self._pending: RoundRecord | None = None
        self._labels: dict[int, str] = {}
        if not (math.isfinite(rejoin_grace) and rejoin_grace >= 0):
            raise ValueError(f"rejoin_grace must be a finite number >= 0, got {rejoin_grace}")
        self.rejoin_grace = rejoin_grace
        self._benched: dict[int, float] = {}  # node -> when it missed a round
        self._examples: dict[int, float | None] = {}  # node -> its dataset size
        self._events: list[str] = []  # membership changes and warnings for the next record
        self._too_slow: set[str] = set()  # silos already told to leave
        self.checkpoint_dir = checkpoint_dir
        self.run_settings = dict(run_settings or {})
        self._resume_after = 0  # the round a restored checkpoint ended
        self._server_s = 0.0  # this round's server seconds so far
        self.he = he
        self._global: ArrayRecord | None = None  # this round's global arrays (sent)
        # checked ciphertexts by reply (object id: replies need not have ids of their own yet)
        self._ciphertexts: dict[int, list[Any]] = {}

    # ---- nodes and sizes ---------------------------------------------------------------
    def _wait_for(self, grid: Grid, count: int) -> list[int]:
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
                log.info("waiting for silos: %d of %d joined", len(nodes), count)
                told = time.monotonic()
            time.sleep(0.2)
        return nodes

    def _eligible(self, grid: Grid) -> list[int]:
        """Online nodes, less those benched after missing a round (see `rejoin_grace`);
        while every online node is benched, waits for one to (re)join or its grace to end."""
        warned = False
        while True:
            online = set(self._wait_for(grid, self.expected_silos if self.manager is None else 1))
            now = time.monotonic()
            for node, since in list(self._benched.items()):
                if node not in online:
                    # The SuperLink has let it go; if it comes back (same id with a silo
                    # key, a new id without) it is a newcomer.
                    del self._benched[node]
                elif now - since >= self.rejoin_grace:
                    del self._benched[node]
                    self._events.append(
                        f"{self._label(node)} still connected {now - since:.0f} s after "
                        "missing a round: tried again with a fair share"
                    )
            eligible = sorted(online - set(self._benched))
            if eligible:
                return eligible
            if not warned:
                log.warning("no silo can take the round: waiting for one to (re)join")
                warned = True
            time.sleep(0.5)

    def _select_nodes(self, grid: Grid, fraction: float) -> tuple[list[int], list[int]]:
        """(every eligible node, the ⌈fraction·n⌉ of them sampled for this phase)."""
        nodes = self._eligible(grid)
        count = max(1, math.ceil(fraction * len(nodes)))
        chosen = nodes if count >= len(nodes) else sorted(self._rng.sample(nodes, count))
        return nodes, chosen

    def _manager_for(self, nodes: list[int], present: list[int]) -> BatchSizeManager:
        """The manager, with the workers no longer `present` removed and `nodes` added
        (a fair share and a fresh estimator each), X re-divided each time."""
        if self.manager is None:
            self.manager = BatchSizeManager(
                {str(n): self._initial_load for n in nodes}, self.tuner, self.estimator
            )
            log.info(
                "load balancing %d silos: B0 = %d each, X = %d, τ = %d, η = %g (fixed)",
                len(nodes),
                self.batch_size,
                self.manager.total,
                self.local_steps,
                self.learning_rate,
            )
        manager = self.manager
        gone = [int(w) for w in manager.workers if int(w) not in present]
        # Remove first, so newcomers get X/n of the silos really there; the last worker
        # stays until a newcomer is in.
        for node in gone:
            if len(manager.workers) > 1:
                self._note(f"{self._label(node)} left", manager.remove_worker(str(node)))
        for node in nodes:
            if str(node) not in manager.sizes:
                sizes = manager.add_worker(str(node))
                self._note(
                    f"{self._label(node)} joined with a fair share B = {sizes[str(node)]} "
                    "and a fresh speed estimate",
                    sizes,
                )
        for node in gone:
            if str(node) in manager.sizes:
                self._note(f"{self._label(node)} left", manager.remove_worker(str(node)))
        return manager

    def _note(self, event: str, sizes: dict[str, int]) -> None:
        by_label = {self._label(int(w)): b for w, b in sizes.items()}
        log.info("%s; X = %d re-divided: %s", event, sum(sizes.values()), by_label)
        self._events.append(event)

    @property
    def _initial_load(self) -> int:
        return self.local_steps if self.tune == "steps" else self.batch_size

    def current_sizes(self) -> dict[int, int]:
        """Every known silo's batch size for the next round, by node id."""
        return {} if self.manager is None else {int(k): v for k, v in self.manager.sizes.items()}

    def sizes_by_silo(self) -> dict[str, int]:
        """The same, by silo label (silo-<partition-id> where known)."""
        return {self._label(n): b for n, b in self.current_sizes().items()}

    # ---- training ----------------------------------------------------------------------
    def _train_messages(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        steps: int,
    ) -> list[Message]:
        present, nodes = self._select_nodes(grid, self.fraction_train)
        sizes = self._manager_for(nodes, present).sizes
        self._sent = {
            n: (self.batch_size, sizes[str(n)]) if self.tune == "steps" else (sizes[str(n)], steps)
            for n in nodes
        }
        self._template = {k: (tuple(a.shape), str(a.dtype)) for k, a in arrays.items()}
        self._global = arrays
        self._ciphertexts = {}
        self._started = time.monotonic()
        messages = []
        for node in nodes:
            # A new ConfigRecord and RecordDict per node: Message does not copy its content,
            # and FedAvg shares one RecordDict among all messages.
            node_config = ConfigRecord(dict(config))
            node_config["server-round"] = server_round
            batch, node_steps = self._sent[node]
            node_config["batch-size"] = batch
            node_config["local-steps"] = node_steps
            node_config["learning-rate"] = self.learning_rate * (
                batch / self.batch_size if self.scale_lr_with_batch else 1.0
            )
            if self.evaluate_with_train and self._evaluation_due(server_round - 1):
                node_config["evaluate"] = True  # evaluate the incoming model first
            content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: node_config})
            messages.append(
                Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
            )
        self._messages = messages
        return messages

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.fraction_train == 0.0:
            return []
        return self._train_messages(server_round, arrays, config, grid, self.local_steps)

    def _reply_problem(self, msg: Message) -> str | None:
        """Why a reply cannot be aggregated, or None."""
        content = msg.content
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            return (
                f"expected one ArrayRecord and one MetricRecord, got "
                f"{len(content.array_records)} and {len(content.metric_records)}"
            )
        metrics = next(iter(content.metric_records.values()))
        weight = _numbers(metrics).get(self.weighted_by_key)
        if weight is None or weight <= 0:
            return (
                f"{self.weighted_by_key} must be a finite number > 0, "
                f"got {metrics.get(self.weighted_by_key)!r}"
            )
        arrays = next(iter(content.array_records.values()))
        if self.he is not None:
            assert self._global is not None
            try:
                checked = self.he.check(arrays, self._global)
            except CiphertextError as error:
                return f"encrypted update rejected: {error}"
            self._ciphertexts[id(msg)] = checked
            return None
        if set(arrays.keys()) != set(self._template):
            return "its arrays do not have the global model's keys"
        for key, array in arrays.items():
            shape, dtype = self._template[key]
            if tuple(array.shape) != shape or str(array.dtype) != dtype:
                return (
                    f"array {key} is {array.dtype}{list(array.shape)}, "
                    f"expected {dtype}{list(shape)}"
                )
            try:
                values = array.numpy()
            except Exception as error:  # a corrupt payload must not take the server down
                return f"array {key} cannot be decoded: {error}"
            if not np.all(np.isfinite(values)):
                return f"array {key} holds NaN or infinite values"
        return None

    def _report(self, node: int, metrics: MetricRecord) -> tuple[WorkerReport | None, str]:
        missing = [k for k in REPORT_KEYS if k not in metrics]
        if missing:
            return None, f"missing metric(s) {', '.join(missing)}"
        numbers = _numbers(metrics)
        bad = [k for k in REPORT_KEYS if k not in numbers]
        if bad:
            return None, "metric(s) not finite numbers: " + ", ".join(
                f"{k}={metrics[k]!r}" for k in bad
            )
        for key in ("batch-size", "local-steps"):
            if not numbers[key].is_integer():
                return None, f"{key} must be a whole number, got {numbers[key]!r}"
        examples = numbers.get(self.weighted_by_key)
        known = self._examples.setdefault(node, examples)
        if examples != known:
            self._examples[node] = examples  # said once; the new size holds from now on
            return None, (
                f"{self.weighted_by_key} changed from {known:g} to {examples:g}: its dataset "
                "is not the one its speed was measured on"
            )
        sent = dict(zip(("batch-size", "local-steps"), self._sent.get(node, (0, 0)), strict=True))
        for key, value in sent.items():
            if int(numbers[key]) != value:
                return None, f"{key} {int(numbers[key])} is not the {value} it was sent"
        # The load unit the manager balances: samples per step, or steps of B0 samples.
        by_steps = self.tune == "steps"
        report = WorkerReport(
            worker=str(node),
            batch_size=int(numbers["local-steps" if by_steps else "batch-size"]),
            iterations=1 if by_steps else int(numbers["local-steps"]),
            compute_s=numbers["compute-s"],
            overhead_s=numbers["overhead-s"],
            cpu=numbers.get("cpu"),
            mem=numbers.get("mem"),
        )
        problems = report.problems()
        return (None, "; ".join(problems)) if problems else (report, "")

    def _collect(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[list[Message], RoundRecord]:
        """Validate replies, feed the manager, and describe the round."""
        wall = time.monotonic() - self._started
        assert self.manager is not None
        valid: list[Message] = []
        failed: list[str] = []
        answered: set[int] = set()
        # An error reply the SuperLink makes for a vanished node comes from the SuperLink
        # itself: name the node by the message it answers.
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in self._messages}
        for msg in replies:
            node = sent_to.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
            answered.add(node)
            if msg.has_error():
                failed.append(f"node-{node}: {msg.error.reason}")
                if msg.metadata.src_node_id != node:  # the SuperLink answered: unreachable
                    self._bench(node, server_round, "unreachable")
                continue
            problem = self._reply_problem(msg)
            if problem is not None:
                log.warning(
                    "round %d: update from node %d rejected: %s", server_round, node, problem
                )
                failed.append(f"node-{node}: {problem}")
                continue
            valid.append(msg)
        for node in self._sent:
            if node not in answered:
                failed.append(f"node-{node}: no reply within the round timeout")
                self._bench(node, server_round, "no reply within the round timeout")
        for line in failed:
            log.warning("round %d: %s", server_round, line)
        # Replies arrive in any order; summing floats in a fixed one makes a run repeatable
        # bit for bit (a resumed run ends exactly as an uninterrupted one).
        valid.sort(key=lambda m: m.metadata.src_node_id)
        if self.quorum is not None and valid:
            valid, late = self._fastest(valid)
            dropped = [f"node-{m.metadata.src_node_id}: not among the quorum" for m in late]
            for line in dropped:  # the policy working as designed, not a fault
                log.info("round %d: %s", server_round, line)
            failed += dropped
        reports: list[WorkerReport] = []
        rejected: list[str] = []
        metrics_of: dict[int, dict[str, float]] = {}
        for msg in valid:
            node = msg.metadata.src_node_id
            metrics = next(iter(msg.content.metric_records.values()))
            metrics_of[node] = _numbers(metrics)
            if "partition-id" in metrics_of[node]:
                self._labels[node] = f"silo-{int(metrics_of[node]['partition-id'])}"
            report, why = self._report(node, metrics)
            if report is None:
                log.warning(
                    "round %d: report of node %d dropped (its update is used): %s",
                    server_round,
                    node,
                    why,
                )
                rejected.append(f"{self._label(node)}: {why}")
            else:
                reports.append(report)
        next_sizes = self.manager.step(reports)
        rejected += [f"{self._label(int(w))}: {why}" for w, why in self.manager.last_rejected]
        for worker in sorted(self.manager.removal_candidates - self._too_slow):
            self._events.append(
                f"{self._label(int(worker))} cannot keep up even at the smallest batch size: "
                "it holds every round back and should leave the federation"
            )
        self._too_slow = self.manager.removal_candidates
        record = self._record(server_round, reports, metrics_of, next_sizes, wall)
        record.failed = failed
        record.rejected = rejected
        record.events, self._events = self._events, []
        return valid, record

    def _bench(self, node: int, server_round: int, why: str) -> None:
        """Leave a silo that missed a round out until it reconnects or `rejoin_grace` passes."""
        self._benched[node] = time.monotonic()
        self._events.append(f"{self._label(node)} missed round {server_round} ({why})")
        manager = self.manager
        if manager is not None and str(node) in manager.sizes and len(manager.workers) > 1:
            self._note(f"{self._label(node)} left", manager.remove_worker(str(node)))

    def _fastest(self, valid: list[Message]) -> tuple[list[Message], list[Message]]:
        """The quorum: the ⌈quorum·n⌉ replies whose silos report the shortest busy time."""
        assert self.quorum is not None

        def busy(msg: Message) -> float:
            m = _numbers(next(iter(msg.content.metric_records.values())))
            return m.get("compute-s", math.inf) + m.get("overhead-s", 0.0)

        keep = max(1, math.ceil(self.quorum * len(self._sent)))
        ranked = sorted(valid, key=busy)
        return ranked[:keep], ranked[keep:]

    def _label(self, node: int) -> str:
        return self._labels.get(node, f"node-{node}")

    def _record(
        self,
        server_round: int,
        reports: list[WorkerReport],
        metrics_of: dict[int, dict[str, float]],
        next_sizes: dict[str, int],
        wall: float,
    ) -> RoundRecord:
        by_node = {int(r.worker): r for r in reports}
        busy = {n: r.round_s for n, r in by_node.items()}
        slowest = max(busy.values()) if busy else math.nan
        ideal = efficiency = idle = math.nan
        if by_node:
            ideal = ideal_round_time(
                {str(n): r.speed for n, r in by_node.items()},
                sum(r.batch_size for r in reports),
                {str(n): r.iterations for n, r in by_node.items()},
                {str(n): r.overhead_s for n, r in by_node.items()},
            )
            efficiency = ideal / slowest
            idle = 1.0 - sum(busy.values()) / (len(busy) * slowest)
        emulated = any(m.get("emulated-speed", 0.0) > 0 for m in metrics_of.values())
        modelled = any(m.get("model-clock", 0.0) > 0 for m in metrics_of.values())
        silos = []
        for node, metrics in sorted(metrics_of.items(), key=lambda kv: self._label(kv[0])):
            report = by_node.get(node)
            silos.append(
                SiloRound(
                    silo=self._label(node),
                    node=node,
                    batch_size=self._sent[node][0],
                    local_steps=self._sent[node][1],
                    compute_s=report.compute_s if report else math.nan,
                    fixed_s=report.overhead_s if report else math.nan,
                    round_s=busy.get(node, math.nan),
                    idle_s=slowest - busy[node] if node in busy else math.nan,
                    train_loss=metrics.get("train-loss", math.nan),
                    num_examples=int(metrics[self.weighted_by_key]),
                    emulated_speed=metrics.get("emulated-speed", 0.0),
                    next_batch_size=next_sizes[str(node)],
                    he_s=metrics.get("he-s", 0.0),
                )
            )
        return RoundRecord(
            round=server_round,
            clock="model" if modelled else "measured (emulated speeds)" if emulated else "measured",
            silos=silos,
            round_s=_none_if_nan(slowest),
            ideal_s=_none_if_nan(ideal),
            efficiency=_none_if_nan(efficiency),
            idle_fraction=_none_if_nan(idle),
            wall_s=wall,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        valid, record = self._collect(server_round, replies)
        if self.evaluate_with_train and self._pending is not None:
            # These replies carry the evaluation of the model this round started from:
            # the previous round's result.
            self._attach_evaluation(self._pending, valid, "eval-examples")
        self._flush()
        self._pending = record
        if not valid:
            log.warning(
                "round %d: no usable update; the global model stays as it was", server_round
            )
            return None, None
        contents = [m.content for m in valid]
        if self.he is not None:
            assert self._global is not None
            weights = [
                _numbers(next(iter(c.metric_records.values())))[self.weighted_by_key]
                for c in contents
            ]
            arrays = self.he.average(
                [self._ciphertexts[id(m)] for m in valid], weights, self._global
            )
        else:
            arrays = aggregate_arrayrecords(contents, self.weighted_by_key)
        if self.audit_dir is not None:
            self._audit(server_round, valid, arrays)
        numbers = [_numbers(next(iter(c.metric_records.values()))) for c in contents]
        with_loss = [n for n in numbers if "train-loss" in n]
        metrics = MetricRecord()
        if with_loss:
            metrics["train-loss"] = sum(
                n[self.weighted_by_key] * n["train-loss"] for n in with_loss
            ) / sum(n[self.weighted_by_key] for n in with_loss)
        for key in ("efficiency", "round_s", "ideal_s", "idle_fraction"):
            value = getattr(record, key)
            if value is not None:
                metrics[key.replace("_", "-")] = float(value)
        return arrays, metrics

    def _audit(self, server_round: int, valid: list[Message], aggregate: ArrayRecord) -> None:
        assert self.audit_dir is not None
        self.audit_dir.mkdir(parents=True, exist_ok=True)
        saved: dict[str, np.ndarray] = {}
        for msg in valid:
            node = msg.metadata.src_node_id
            metrics = _numbers(next(iter(msg.content.metric_records.values())))
            saved[f"weight/{node}"] = np.asarray(metrics[self.weighted_by_key])
            for key, array in next(iter(msg.content.array_records.values())).items():
                saved[f"update/{node}/{key}"] = array.numpy()
        for key, array in aggregate.items():
            saved[f"aggregate/{key}"] = array.numpy()
        with (self.audit_dir / f"round-{server_round}.npz").open("wb") as handle:
            np.savez(handle, **saved)  # type: ignore[arg-type]

    # ---- evaluation --------------------------------------------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        due = server_round == self._num_rounds or (
            not self.evaluate_with_train and self._evaluation_due(server_round)
        )
        if self.fraction_evaluate == 0.0 or not due:
            return []
        _, nodes = self._select_nodes(grid, self.fraction_evaluate)
        self._eval_started = time.monotonic()
        eval_config = ConfigRecord(dict(config))
        eval_config["server-round"] = server_round
        return [
            Message(
                content=RecordDict(
                    {self.arrayrecord_key: arrays, self.configrecord_key: eval_config}
                ),
                message_type=MessageType.EVALUATE,
                dst_node_id=node,
            )
            for node in nodes
        ]

    def _evaluation_due(self, server_round: int) -> bool:
        return server_round >= 1 and (
            server_round % self.evaluate_every == 0 or server_round == self._num_rounds
        )

    def _attach_evaluation(self, record: RoundRecord, replies: list[Message], key: str) -> None:
        """Weighted accuracy and loss of the replies' `eval-acc`/`eval-loss` (weights under
        `key`) into the record, per silo and overall."""
        per_node: dict[int, tuple[float, float, float]] = {}
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error() or len(msg.content.metric_records) != 1:
                log.warning("round %d: evaluation from node %d unusable", record.round, node)
                continue
            m = _numbers(next(iter(msg.content.metric_records.values())))
            if "eval-acc" not in m and key != self.weighted_by_key:
                continue  # this silo was not asked to evaluate
            keys = (key, "eval-acc", "eval-loss")
            if any(k not in m for k in keys) or m[key] <= 0:
                log.warning(
                    "round %d: evaluation from node %d has bad metrics %s", record.round, node, m
                )
                continue
            per_node[node] = (m[keys[0]], m[keys[1]], m[keys[2]])
        if not per_node:
            return
        total = sum(w for w, _, _ in per_node.values())
        record.accuracy = sum(w * a for w, a, _ in per_node.values()) / total
        record.loss = sum(w * v for w, _, v in per_node.values()) / total
        for silo in record.silos:
            if silo.node in per_node:
                _, silo.accuracy, silo.loss = per_node[silo.node]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        record = self._pending
        if record is None or record.round != server_round:
            return None
        if self._eval_started is not None:
            record.eval_wall_s = time.monotonic() - self._eval_started
            self._eval_started = None
        self._attach_evaluation(record, list(replies), self.weighted_by_key)
        if record.accuracy is None or record.loss is None:
            return None
        return MetricRecord({"eval-acc": record.accuracy, "eval-loss": record.loss})

    # ---- the run -----------------------------------------------------------------------
    def _flush(self) -> None:
        if self._pending is not None:
            self.reporter.publish(self._pending)
            self._pending = None

    def _probe(self, grid: Grid, arrays: ArrayRecord, config: ConfigRecord, timeout: float) -> None:
        """A short round whose reports size round 1; its updates are discarded."""
        probe_config = ConfigRecord(dict(config))
        probe_config["probe"] = True
        messages = self._train_messages(0, arrays, probe_config, grid, self.probe_steps)
        _, record = self._collect(0, grid.send_and_receive(messages, timeout=timeout))
        self._pending = record
        self._flush()
        log.info("probe round: sizes for round 1 are %s", self.current_sizes())

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
        """Run the rounds (as flwr's Strategy.start), polling replies every
        `poll_interval` s, publishing every round's record and, with `checkpoint_dir`,
        checkpointing after every round. After `restore(checkpoint)`, it goes on from the
        round after the checkpoint's with the checkpoint's model (pass it as
        `initial_arrays`)."""
        self._num_rounds = num_rounds
        first = self._resume_after + 1
        if self.he is not None:
            if evaluate_fn is not None:
                raise ValueError(
                    "under HE the server holds only ciphertexts and cannot evaluate the "
                    "model: pass no evaluate_fn (silos evaluate it: federated evaluation)"
                )
            if first == 1:  # a restored model is already encrypted
                initial_arrays = self.he.encrypt(initial_arrays)
        if self.poll_interval is not None:
            grid = PollingGrid(grid, self.poll_interval)
        train_config = train_config if train_config is not None else ConfigRecord()
        evaluate_config = evaluate_config if evaluate_config is not None else ConfigRecord()
        result = Result(arrays=initial_arrays)
        arrays = initial_arrays
        if first == 1:
            if self.probe_steps > 0:
                self._probe(grid, arrays, train_config, timeout)
            if evaluate_fn is not None and (metrics := evaluate_fn(0, arrays)) is not None:
                result.evaluate_metrics_serverapp[0] = metrics
        else:
            log.info("resuming after round %d of %d", self._resume_after, num_rounds)
        for current in range(first, num_rounds + 1):
            log.info("[ROUND %d/%d]", current, num_rounds)
            self._server_s = 0.0
            with self._server_time():
                messages = self.configure_train(current, arrays, train_config, grid)
            replies = grid.send_and_receive(messages, timeout=timeout)
            with self._server_time():
                new_arrays, train_metrics = self.aggregate_train(current, replies)
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[current] = train_metrics
            with self._server_time():
                messages = self.configure_evaluate(current, arrays, evaluate_config, grid)
            replies = grid.send_and_receive(messages, timeout=timeout)
            with self._server_time():
                metrics = self.aggregate_evaluate(current, replies)
            if metrics is not None:
                result.evaluate_metrics_clientapp[current] = metrics
            if evaluate_fn is not None:
                metrics = self._server_evaluate(evaluate_fn, current, arrays)
                if metrics is not None:
                    result.evaluate_metrics_serverapp[current] = metrics
            with self._server_time():
                if self.checkpoint_dir is not None:
                    self._checkpoint(current, num_rounds, arrays)
            if self._pending is not None and self._pending.round == current:
                self._pending.server_s = self._server_s
                self._pending.server_rss_mb = psutil.Process().memory_info().rss / 2**20
        self._flush()
        return result

    @contextlib.contextmanager
    def _server_time(self) -> Iterator[None]:
        """Add the block's seconds to this round's server time (the strategy's own work:
        selecting, sizing, checking and averaging, checkpointing; not waiting for silos)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._server_s += time.perf_counter() - started

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of this strategy (JSON-serialisable)."""
        version, internal, gauss = self._rng.getstate()
        return {
            "manager": None if self.manager is None else self.manager.state_dict(),
            "rng": [version, list(internal), gauss],
            "labels": {str(n): label for n, label in self._labels.items()},
            "benched": sorted(self._benched),
            "too_slow": sorted(self._too_slow),
            "pending": None if self._pending is None else record_to_dict(self._pending),
        }

    def restore(self, checkpoint: Checkpoint) -> ArrayRecord:
        """Take up a checkpointed run: the manager with its estimators and tuner, the
        sampling RNG, labels, silos left out, and the last round's record. `start` then
        runs the rounds after `checkpoint.round`; pass it the returned model."""
        state = checkpoint.strategy
        try:
            if state["manager"] is not None:
                manager_state = state["manager"]
                self.manager = BatchSizeManager(
                    {w: int(b) for w, b in manager_state["sizes"].items()},
                    self.tuner,
                    self.estimator,
                )
                self.manager.load_state_dict(manager_state)
            version, internal, gauss = state["rng"]
            self._rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
            self._labels = {int(n): str(label) for n, label in state["labels"].items()}
            # Left out before the stop: wait out a fresh grace (the clock restarted).
            self._benched = {int(n): time.monotonic() for n in state["benched"]}
            self._too_slow = {str(w) for w in state["too_slow"]}
            pending = state["pending"]
            self._pending = None if pending is None else record_from_dict(pending)
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"the checkpoint's strategy state does not fit this strategy: {error!r}"
            ) from error
        self._resume_after = checkpoint.round
        return checkpoint.arrays

    def _checkpoint(self, server_round: int, num_rounds: int, arrays: ArrayRecord) -> None:
        assert self.checkpoint_dir is not None
        save_checkpoint(
            self.checkpoint_dir,
            Checkpoint(server_round, num_rounds, arrays, self.state_dict(), self.run_settings),
        )

    def _server_evaluate(
        self,
        inner: Callable[[int, ArrayRecord], MetricRecord | None],
        server_round: int,
        arrays: ArrayRecord,
    ) -> MetricRecord | None:
        metrics = inner(server_round, arrays)
        if (
            metrics is not None
            and self._pending is not None
            and self._pending.round == server_round
        ):
            numbers = _numbers(metrics)
            self._pending.server_accuracy = numbers.get("accuracy")
            self._pending.server_loss = numbers.get("loss")
        return metrics


def _numbers(metrics: MetricRecord) -> dict[str, float]:
    """The record's finite scalar values as floats; anything else is left out."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value
