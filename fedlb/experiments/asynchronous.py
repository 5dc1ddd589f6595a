"""Asynchronous FL peers, compared on the same harness: FedBuff and FedCompass.

Neither waits for the slowest silo: a silo that finishes gets the newest model at once,
and the server moves the model when enough updates are in (FedBuff: K of them, from any
silos; FedCompass: a whole arrival group). Both run on the silos' own clock (the model
clock's profile times, or the measured ones): every reply reports the seconds its silo
was busy, and the server replays the federation as a discrete-event schedule on those
seconds (a silo sent a model at t delivers at t + its busy seconds; events in time
order). The messages are real (Flower's grid, the same silo handler and balancing mod
as every policy); only the order of events comes from the reported seconds, so a run is
as repeatable as its clock.

- FedBuff (Nguyen et al., AISTATS 2022): each silo trains τ steps of B0 from the model
  it was sent; the server keeps Δ = w_silo − w_sent weighted by s(staleness) =
  1/√(1+staleness) in a buffer and, once it holds K, moves the model by their mean
  (server learning rate 1). Staleness: server updates since the silo's model was sent.
- FedCompass (Li et al., 2023, APPFL's scheduler): the server estimates each silo's
  seconds per step and gives it the τ_i in [τ_min, τ_max] that makes it arrive with an
  arrival group (the latest group it can reach), else opens a group due after τ_max of
  its steps; a group's updates are applied together, with the same staleness weights,
  when its last member arrives, or at its first arrival past its deadline plus a grace.
  A silo's first update (no speed known yet) is applied on its own as it arrives.

At equal work: an asynchronous run ends once its applied updates hold as many local
steps as FedAvg's rounds (silos × rounds × τ), so its records are server updates, each
with round_s = the clock's advance since the previous one. E means nothing without a
barrier (None); no silo idles (0).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedlb.flower import LoadBalancedFedAvg, RoundRecord, round_record
from fedlb.flower.protocol import Orders, SiloReport, numbers

Model = dict[str, torch.Tensor]


def staleness_weight(staleness: int) -> float:
    """The weight of an update `staleness` server updates old (FedBuff's, FedCompass's)."""
    return 1.0 / math.sqrt(1.0 + staleness)


@dataclass(order=True)
class Arrival:
    """A silo's update, due at `at` on the clock (ordered by time, then dispatch order)."""

    at: float
    order: int
    sent_at: float = field(compare=False)
    node: int = field(compare=False)
    version: int = field(compare=False)  # the server update its model came from
    reply: Message = field(compare=False)
    report: SiloReport = field(compare=False)


class AsynchronousFedAvg(LoadBalancedFedAvg):
    """The event loop the peers share. A subclass says how many steps a silo runs next
    (`_steps_for`) and which of the updates in hand are applied when one arrives
    (`_to_apply`). B stays B0 and η the app's; the balancer is not used."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.batch_size is None or self.local_steps is None:
            raise ValueError("an asynchronous policy needs batch_size and local_steps")
        if self.he is not None:
            raise ValueError("the asynchronous peers do not run under HE")
        self.clock = 0.0  # now, on the silos' clock
        self.version = 0  # server updates applied so far
        self._dispatched = 0

    def _steps_for(self, node: int) -> int:
        return int(self.local_steps or 1)

    def _to_apply(self, arrival: Arrival, buffer: list[Arrival]) -> list[Arrival]:
        """Of `buffer` (`arrival` last in it), the updates to apply now; [] : wait."""
        raise NotImplementedError

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
        """Run until the applied updates hold FedAvg's `num_rounds` rounds of steps."""
        config = train_config or ConfigRecord()
        nodes = self.members.wait_for(grid, self.members.expected)
        work_left = len(nodes) * num_rounds * int(self.local_steps or 1)
        model = {k: v.detach().clone() for k, v in initial_arrays.to_torch_state_dict().items()}
        sent: dict[int, Model] = {0: model}  # the models silos are training from
        result = Result()
        if evaluate_fn is not None:
            self._evaluate(evaluate_fn, 0, model, result)
        flwr_log(
            INFO,
            "fedlb: %s on %d silos until %d local steps are applied (FedAvg's %d rounds)",
            type(self).__name__,
            len(nodes),
            work_left,
            num_rounds,
        )
        pending: list[Arrival] = []
        for arrival in self._dispatch(grid, nodes, model, config, timeout):
            heapq.heappush(pending, arrival)
        buffer: list[Arrival] = []
        last_at, wall = 0.0, time.monotonic()
        while work_left > 0 and pending:
            arrival = heapq.heappop(pending)
            self.clock = arrival.at
            buffer.append(arrival)
            if chosen := self._to_apply(arrival, buffer):
                model = self._apply(model, chosen, sent)
                work_left -= sum(a.report.local_steps for a in chosen)
                self.version += 1
                sent[self.version] = model
                self.rounds.open(self._record(chosen, self.clock - last_at, wall))
                if evaluate_fn is not None and (
                    work_left <= 0 or self._evaluation_due(self.version)
                ):
                    self._evaluate(evaluate_fn, self.version, model, result)
                self.rounds.close(self.version, publish=True)
                last_at, wall = self.clock, time.monotonic()
                buffer = [a for a in buffer if a not in chosen]
            if work_left > 0:  # the silo is free at once: the newest model, its next task
                for again in self._dispatch(grid, [arrival.node], model, config, timeout):
                    heapq.heappush(pending, again)
            in_use = {a.version for a in [*pending, *buffer]} | {self.version}
            for old in [v for v in sent if v not in in_use]:
                del sent[old]
        if work_left > 0:
            flwr_log(WARNING, "fedlb: every silo left before the run's work was done")
        result.arrays = ArrayRecord(model)
        return result

    def _dispatch(
        self,
        grid: Grid,
        nodes: Iterable[int],
        model: Model,
        config: ConfigRecord,
        timeout: float,
    ) -> list[Arrival]:
        """Send `nodes` the model now, wait for their replies (real time), and place each
        on the clock where its silo would deliver it. A silo that fails leaves the run."""
        arrays = ArrayRecord(model)
        messages, told = [], {}
        for node in nodes:
            orders = Orders(
                self.version + 1, batch_size=self.batch_size, local_steps=self._steps_for(node)
            )
            told[node] = (orders.batch_size, orders.local_steps)
            content = RecordDict(
                {
                    self.arrayrecord_key: arrays,
                    self.configrecord_key: self._node_config(node, orders, config),
                }
            )
            messages.append(
                Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
            )
        arrivals: list[Arrival] = []
        for reply in grid.send_and_receive(messages, timeout=timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                flwr_log(WARNING, "fedlb: node %d failed, it leaves: %s", node, reply.error.reason)
                continue
            metrics = reply.content.metric_records.get("metrics", MetricRecord())
            report, why = self.balance.report_check.read(node, metrics, told.get(node, (0, 0)))
            if report is None:
                flwr_log(WARNING, "fedlb: node %d's reply is unusable, it leaves: %s", node, why)
                continue
            self.members.name(node, report.partition_id)
            busy = report.compute_s + report.overhead_s
            self._dispatched += 1  # dispatch order breaks ties on the clock
            arrivals.append(
                Arrival(
                    self.clock + busy,
                    self._dispatched,
                    self.clock,
                    node,
                    self.version,
                    reply,
                    report,
                )
            )
        return arrivals

    def _apply(self, model: Model, buffer: list[Arrival], sent: dict[int, Model]) -> Model:
        """w + the mean over the buffer of s(staleness)·(w_silo − w_sent)."""
        step = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in model.items()}
        for arrival in buffer:
            weight = staleness_weight(self.version - arrival.version)
            local = next(iter(arrival.reply.content.array_records.values())).to_torch_state_dict()
            base = sent[arrival.version]
            for key, total in step.items():
                total += weight * (local[key].double() - base[key].double())
        return {
            # integer buffers (batch norm's counters) move by whole steps
            k: (v.double() + step[k] / len(buffer)).to(v.dtype)
            for k, v in model.items()
        }

    def _record(self, buffer: list[Arrival], advance_s: float, wall: float) -> RoundRecord:
        """The server update as a round record: each update a silo line (several lines for
        a silo that sent several), round_s the clock's advance, no E, no idling."""
        silos = []
        for arrival in buffer:
            node, report = arrival.node, arrival.report
            one = round_record(
                self.version,
                {node: self._load_report(node, report)},
                {node: report},
                {node: numbers(arrival.reply.content.metric_records.get("metrics", {}))},
                dict(self.members.labels),
                {node: self.batch_size or 0},
                {node: (report.batch_size, report.local_steps)},
                0.0,
                self.weighted_by_key,
            )
            silos.extend(one.silos)
        record = round_record(
            self.version,
            {},
            {a.node: a.report for a in buffer},
            {},
            {},
            {},
            {},
            time.monotonic() - wall,
            self.weighted_by_key,
        )
        for line in silos:
            line.idle_s = 0.0
        record.silos = silos
        record.round_s = advance_s
        record.idle_fraction = 0.0
        record.events = [
            f"{self.members.label(a.node)} staleness {self.version - 1 - a.version} "
            f"(sent at {a.sent_at:.3f} s)"
            for a in buffer
        ]
        return record

    def _evaluate(
        self,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None],
        version: int,
        model: Model,
        result: Result,
    ) -> None:
        metrics = evaluate_fn(version, ArrayRecord(model))
        if metrics is not None:
            result.evaluate_metrics_serverapp[version] = metrics
            self.rounds.server_evaluated(version, metrics)


class FedBuff(AsynchronousFedAvg):
    """Buffered asynchronous aggregation: apply K staleness-weighted updates at a time.

    Args:
        buffer_size: K; None: half the silos, rounded up.
    """

    def __init__(self, buffer_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if buffer_size is not None and buffer_size < 1:
            raise ValueError(f"FedBuff's buffer size K must be >= 1, got {buffer_size}")
        self.buffer_size = buffer_size

    def _to_apply(self, arrival: Arrival, buffer: list[Arrival]) -> list[Arrival]:
        k = self.buffer_size or max(1, math.ceil(self.members.expected / 2))
        return list(buffer) if len(buffer) >= k else []


@dataclass
class Group:
    """A FedCompass arrival group: when its members are due, and who has arrived."""

    due: float
    opened: float
    members: set[int] = field(default_factory=set)
    arrived: set[int] = field(default_factory=set)


class FedCompass(AsynchronousFedAvg):
    """Computing-power-aware scheduling into arrival groups (module docstring).

    Args:
        min_steps: τ_min (None: τ/2, τ the app's steps).
        max_steps: τ_max (None: 2τ).
        grace: how long past its deadline a group waits for late members, as a share of
            the group's span (FedCompass's latest-arrival buffer).
    """

    def __init__(
        self,
        min_steps: int | None = None,
        max_steps: int | None = None,
        grace: float = 0.2,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        tau = int(self.local_steps or 1)
        self.min_steps = min_steps or max(1, tau // 2)
        self.max_steps = max_steps or 2 * tau
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(
                f"FedCompass needs 1 <= τ_min <= τ_max, got {self.min_steps}, {self.max_steps}"
            )
        if grace < 0:
            raise ValueError(f"FedCompass's grace must be >= 0, got {grace}")
        self.grace = grace
        self.step_s: dict[int, float] = {}  # each silo's seconds per step, last reported
        self.fixed_s: dict[int, float] = {}
        self.groups: dict[int, Group] = {}
        self.group_of: dict[int, int] = {}  # silo -> the group it is due with
        self.arrived_with: dict[int, int] = {}  # arrival (its order) -> its group
        self._opened = 0

    def _steps_for(self, node: int) -> int:
        """The latest group this silo can reach within [τ_min, τ_max] steps, else a new
        group due after τ_max of its steps; the app's τ while its speed is unknown."""
        step_s = self.step_s.get(node)
        if step_s is None or step_s <= 0:
            return int(self.local_steps or 1)
        fixed = self.fixed_s.get(node, 0.0)
        reachable = [
            (group.due, number, steps)
            for number, group in self.groups.items()
            if self.min_steps
            <= (steps := math.floor((group.due - self.clock - fixed) / step_s))
            <= self.max_steps
        ]
        if reachable:
            _, number, steps = max(reachable)
        else:
            number, steps = self._opened, self.max_steps
            self._opened += 1
            self.groups[number] = Group(self.clock + fixed + steps * step_s, self.clock)
        self.groups[number].members.add(node)
        self.group_of[node] = number
        return steps

    def _to_apply(self, arrival: Arrival, buffer: list[Arrival]) -> list[Arrival]:
        """A group once all its members are in, or at its first arrival past its deadline
        and grace; an update from no group (a silo's first, or one that missed its
        group's apply) on its own, at once."""
        report, node = arrival.report, arrival.node
        if report.local_steps > 0:
            self.step_s[node] = report.compute_s / report.local_steps
        self.fixed_s[node] = report.overhead_s
        number = self.group_of.pop(node, None)
        if number is None or number not in self.groups:
            return [arrival]
        self.arrived_with[arrival.order] = number
        group = self.groups[number]
        group.arrived.add(node)
        late = self.clock >= group.due + self.grace * (group.due - group.opened)
        if not (group.arrived >= group.members or late):
            return []
        del self.groups[number]
        chosen = [a for a in buffer if self.arrived_with.get(a.order) == number]
        for a in chosen:
            del self.arrived_with[a.order]
        return chosen
