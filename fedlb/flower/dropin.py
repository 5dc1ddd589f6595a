"""Load balancing for a ClientApp somebody already has: `balance_mod` and `balanced_loader`.

A stock Flower PyTorch ClientApp becomes load-balanced with two changed lines; its loop,
optimizer, learning rate and metrics stay as they are:

    app = ClientApp(mods=[balance_mod()])                  # was: ClientApp()
    ...
    trainloader, _ = load_data(partition_id, num_partitions, batch_size)
    trainloader = balanced_loader(msg, trainloader)        # the one added line
    train_loss = train_fn(model, trainloader, epochs, lr, device)   # unchanged

`balanced_loader` keeps the loader's dataset, collate_fn, workers and pinning, has a
`len()` (the original loader's: the app's loop runs the same number of steps every round
as in round 1), and yields batches of the size the server sent (the loader's own in round
1), timing them. `balance_mod` reads the server's orders before the handler runs and adds
what the server needs to the reply's metrics afterwards (fedlb's keys, see
fedlb.flower.protocol; the app's own metrics pass through untouched). It works beside
`he_mod()` in either order.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from torch.utils.data import DataLoader, IterableDataset

from fedlb.training import (
    EmulatedCurve,
    EmulatedSpeed,
    Pace,
    ResizableBatchSampler,
    ResourceProbe,
    synchronize,
)

from .emulation import SiloClock, emulated_timing
from .identity import node_label, silo_label
from .packing import pack_in_place, sent_layout, unpack_in_place
from .profiles import (
    PROFILE_OF,
    SiloProfile,
    hardware,
    load_profile,
    model_key,
    profile_reply,
    record_round,
)
from .protocol import (
    NODE_PARTITION_ID,
    NOTICE_LINE,
    STREAM_STATE,
    TASK_STARTED_ENV,
    Orders,
    SiloReport,
    read_emulation,
    sent_config,
)

if TYPE_CHECKING:
    # A ClientApp's call chain and a mod, as the public `ClientApp(mods=...)` spells them
    # (Flower's own aliases, in flwr/clientapp/typing.py, are not exported)
    ClientAppCallable = Callable[[Message, Context], Message]
    Mod = Callable[[Message, Context, ClientAppCallable], Message]

log = logging.getLogger("fedlb.flower")


@dataclass
class RoundTiming:
    """What the balanced loaders of one train message drew and how long it took."""

    orders: Orders
    pace: Pace | None
    batch_size: int | None = None
    own_batch_size: int | None = None  # the app's loader's: the silo's B0
    steps: int = 0
    compute_s: float = 0.0  # as the silo lived it (padded when emulated)
    real_compute_s: float = 0.0
    step_s: list[float] = field(default_factory=list)  # each step, as lived

    def split(self) -> tuple[float, float]:
        """(compute seconds, seconds of one-off cost). Steps that take far longer than the
        rest pay costs that do not scale with B (a fresh process's first convolutions,
        allocator warm-up, a stall): compute is the steps' median times their count, so a
        silo's speed is not misjudged from every round's start; the excess is fixed cost
        (the round's total is unchanged)."""
        if self.steps < 3:
            return self.compute_s, 0.0
        compute = min(self.compute_s, statistics.median(self.step_s) * self.steps)
        return compute, self.compute_s - compute


_CURRENT: contextvars.ContextVar[RoundTiming | None] = contextvars.ContextVar(
    "fedlb_round_timing", default=None
)


def clientapp_age() -> float | None:
    """Seconds since this ClientApp process started, where it was started for this
    message: Flower's `flwr-clientapp` (Python, imports, Flower's pull of the message, the
    app's loading) or a warm silo's fork of it (fedlb.deploy.warm). None elsewhere (a
    simulation's long-lived worker, a test): there the age says nothing of this message."""
    forked = os.environ.get(TASK_STARTED_ENV)
    if forked:
        with contextlib.suppress(ValueError):
            return max(0.0, time.time() - float(forked))
    if Path(sys.argv[0]).name == "flwr-clientapp":
        return max(0.0, time.time() - float(psutil.Process().create_time()))
    return None


_SAID: set[str] = set()  # what this process has said once


def _say_once(key: str, text: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        log.warning("%s", text)


def warm_up_torch() -> None:
    """Pay torch's one-time lazy initialisation (autograd, optimizer step: ~1.5 s in a
    fresh process here) outside the timed steps, on a throwaway parameter. It runs a
    backward: never in a process that forks workers afterwards (on a CUDA build its
    children could not run backward; fedlb's warm servers warm up without autograd,
    fedlb.deploy.fork_safety), only in the process that trains."""
    weight = torch.zeros(1, requires_grad=True)
    optimiser = torch.optim.SGD([weight], lr=0.1)
    (weight * 2).sum().backward()  # type: ignore[no-untyped-call]
    optimiser.step()


def _curve_name(silo_clock: SiloClock | None, pace: Pace | None) -> str:
    """The step-time curve the silo emulated, by name ('' : none)."""
    if silo_clock is not None:
        return silo_clock.curve_name
    return pace.curve.name if isinstance(pace, EmulatedCurve) else ""


def _partition_id(context: Context) -> int | None:
    value = context.node_config.get(NODE_PARTITION_ID)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if float(value).is_integer() else None


def _label(context: Context) -> str:
    """The silo's name for its stored profile: silo-<partition-id>, else its node id."""
    partition = _partition_id(context)
    return silo_label(partition) if partition is not None else node_label(context.node_id)


def _plain_arrays(content: RecordDict) -> dict[str, np.ndarray] | None:
    """The message's model as floating-point arrays, or None where there is none or it
    travels encrypted (ciphertexts are bytes: the HE mod runs outside this one)."""
    records = content.array_records
    if not records:
        return None
    arrays = {k: a.numpy() for k, a in next(iter(records.values())).items()}
    floats = {k: a for k, a in arrays.items() if np.issubdtype(a.dtype, np.floating)}
    return floats or None


def _distance(
    before: dict[str, np.ndarray] | None, after: dict[str, np.ndarray] | None
) -> float | None:
    """||after − before||₂ over the model's floating-point arrays (None where the two are
    not the same model: another layout, or ciphertexts); inf where it is not finite."""
    if before is None or after is None or before.keys() != after.keys():
        return None
    if any(before[k].shape != after[k].shape for k in before):
        return None
    total = math.fsum(
        float(np.sum(np.square(after[k].astype(np.float64) - before[k]))) for k in before
    )
    return math.sqrt(total) if math.isfinite(total) else math.inf


def balance_mod(clock: Callable[[Context], SiloClock | None] | None = None) -> Mod:
    """A Flower mod that makes a ClientApp's training load-balanced with `balanced_loader`.

    For train messages it reads the server's orders, runs the handler, and adds fedlb's
    report to the reply's MetricRecord: the batch size and steps drawn, the seconds of
    the steps (compute) and of the rest of the handler (fixed cost), CPU and memory use,
    and the node config's partition-id as the silo's label. Other messages pass through.

    Emulation (one machine standing in for many, every output names its clock): a node
    config `emulated-speed` (samples/s) pads each step with sleep to that speed, and
    `emulated-curve` ("h200/cnn", "cpu1/cnn*20": fedlb.training's STEP_CURVES) to a
    measured step-time curve's seconds at the step's B; in Flower's simulation, whose
    nodes have no config of their own, the run config's `fedlb-emulated-speeds =
    "400,200,100"` or `fedlb-emulated-curves = "h200/cnn,cpu4/cnn,cpu1/cnn"` gives each
    partition-id its own. Node config `emulated-clock` (or run config
    `fedlb-emulated-clock`) = "model" runs them on the model clock instead: no sleeping,
    τ·B/v or τ·curve(B) reported (fedlb.flower.emulation). `clock` (experiments) gives
    each silo its emulated clock from its Context.
    """
    return BalanceMod(clock)


class BalanceMod:
    """The mod `balance_mod()` returns: an instance of an importable class, so that
    Flower's simulation can ship it to its Ray workers (a closure over this module's
    context variable would not pickle)."""

    def __init__(self, clock: Callable[[Context], SiloClock | None] | None = None) -> None:
        self.clock = clock

    def __call__(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        layout = sent_layout(msg.content) if msg.has_content() else None
        if layout is None:
            return self._handle(msg, context, call_next)
        # The server packed the model (fedlb.flower.packing): the app sees its arrays, and
        # a train reply of the same model goes back packed.
        unpack_in_place(msg, layout)
        reply = self._handle(msg, context, call_next)
        if msg.metadata.message_type == MessageType.TRAIN:
            pack_in_place(reply, layout)
        return reply

    def _handle(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type == MessageType.TRAIN and PROFILE_OF in sent_config(msg):
            # the server's question before round 1, answered without the app (a train
            # message, as Flower runs a mod only around a handler the app registered)
            model = str(sent_config(msg)[PROFILE_OF])
            profile = load_profile(_label(context), model, hardware(context.node_config))
            return profile_reply(msg, profile, _partition_id(context))
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        started = time.perf_counter()
        start_s = clientapp_age()
        probe = ResourceProbe()
        orders = Orders.read(sent_config(msg))
        if orders.notice:  # its log, which `fedlb silo` echoes on the silo's console
            print(f"{NOTICE_LINE} {orders.notice}", flush=True)
        silo_clock, pace = emulated_timing(read_emulation(context.node_config, context.run_config))
        if self.clock is not None:  # an experiment's clock, for this silo
            silo_clock = self.clock(context)
        if silo_clock is not None:
            pace = silo_clock.pace(orders.server_round)
        received = _plain_arrays(msg.content)
        warm_up = time.perf_counter()
        warm_up_torch()
        warm_up_s = time.perf_counter() - warm_up  # process start-up: neither cost
        timing = RoundTiming(orders, pace)
        token = _CURRENT.set(timing)
        try:
            reply = call_next(msg, context)
        finally:
            _CURRENT.reset(token)
        if reply.has_error() or not reply.has_content():
            return reply
        if timing.steps == 0 or timing.batch_size is None:
            log.warning(
                "the train handler drew no batch from balanced_loader(msg, loader): no "
                "balancing report is sent (the server uses the update, keeps the sizes)"
            )
            return reply
        compute, _ = timing.split()  # the one-off part stays in the handler's rest
        fixed = max(0.0, time.perf_counter() - started - warm_up_s - compute)
        if silo_clock is not None:
            cost = silo_clock.fixed_cost(orders.server_round)
            time.sleep(cost)
            compute, fixed = silo_clock.report(
                orders.server_round, timing.batch_size, timing.steps, compute, fixed + cost
            )
        if pace is not None and timing.real_compute_s > timing.compute_s * 0.999:
            log.warning("this silo cannot keep up with its emulated speed: steps ran unpadded")
        if not orders.balanced:
            _say_once(
                "stock",
                "the server sent no fedlb orders (its strategy is not wrapped in LoadBalanced): "
                "this silo trains at its loader's own batch size and sends no balancing "
                "report, which the server would average into the app's metrics",
            )
            return reply
        resources = probe.sample()
        sent = _plain_arrays(reply.content)
        report = SiloReport(
            batch_size=timing.batch_size,
            local_steps=timing.steps,
            compute_s=compute,
            overhead_s=fixed,
            cpu=resources.cpu,
            mem=resources.mem,
            partition_id=_partition_id(context),
            emulated_speed=pace.samples_per_s if isinstance(pace, EmulatedSpeed) else 0.0,
            model_clock=silo_clock is not None and silo_clock.name == "model",
            update_norm=_distance(received, sent),
            start_s=None if start_s is None else start_s + warm_up_s,
            emulated_curve=_curve_name(silo_clock, pace),
        )
        if not reply.content.metric_records:
            reply.content["metrics"] = MetricRecord()
        target = next(iter(reply.content.metric_records.values()))
        for key, value in report.metrics().items():
            target[key] = value
        if received is not None and compute > 0:
            record_round(
                _label(context),
                model_key(next(iter(msg.content.array_records.values()))),
                hardware(context.node_config),
                msg.metadata.run_id,
                SiloProfile(
                    speed=timing.batch_size * timing.steps / compute,
                    overhead_s=fixed,
                    batch_size=timing.own_batch_size or timing.batch_size,
                    local_steps=timing.steps,
                    measured_at=time.time(),
                ),
                capped=orders.round_steps is not None and timing.steps >= orders.round_steps,
            )
        return reply


class BalancedLoader:
    """What `balanced_loader` returns: iterates like the app's DataLoader (same dataset,
    collate_fn, workers, pinning, same len()), drawing the server's batch size."""

    def __init__(
        self, loader: DataLoader[Any], timing: RoundTiming, carry: Context | None = None
    ) -> None:
        if isinstance(loader.dataset, IterableDataset):
            raise TypeError(
                "balanced_loader needs a map-style dataset (with __getitem__ and __len__): "
                "an IterableDataset cannot be drawn at a batch size of fedlb's choosing"
            )
        own = loader.batch_size
        if own is None:
            raise ValueError(
                "balanced_loader needs a DataLoader built with batch_size=..., not a "
                "batch_sampler: that batch size is the silo's B0"
            )
        self.original = loader
        self.timing = timing
        timing.own_batch_size = own
        self.batch_size = timing.orders.batch_size or own
        steps = timing.orders.local_steps
        self.steps_per_pass = steps if steps is not None else len(loader)
        # the round's cap, all passes together (the second lever at the edge: fewer steps
        # at the silo's own batch size); len() says it where one pass holds it all, so a
        # loop that averages its loss over len(loader) averages what it ran
        self.round_steps = timing.orders.round_steps
        if self.batch_size != own and timing.orders.balanced:
            drawn = self.batch_size * self.steps_per_pass / max(1, len(loader.dataset))  # type: ignore[arg-type]
            _say_once(
                "pass",
                f"balanced_loader: B = {self.batch_size} this round (the loader's own is {own}) "
                f"for {self.steps_per_pass} steps per pass: a pass covers {drawn:.2f}x this "
                "silo's data, not one epoch (LB-BSP keeps the steps and balances B); a loop "
                "that counts epochs counts these passes",
            )
        if timing.batch_size is None:
            timing.batch_size = self.batch_size
        elif timing.batch_size != self.batch_size:
            raise ValueError("two balanced loaders with different batch sizes in one round")
        # Each epoch's order comes from the app's own sampler, drawn when the epoch starts,
        # and an epoch ends in a short batch, as the app's loader does: at B = B0 and
        # τ = len(loader) a round draws exactly the app's batches for the same torch seed.
        app_sampler = loader.sampler
        self.sampler = ResizableBatchSampler(
            loader.dataset,  # type: ignore[arg-type]
            self.batch_size,
            span_epochs=False,
            epoch_order=lambda: iter(app_sampler),
        )
        self._carry = carry
        if carry is not None and STREAM_STATE in carry.state:
            self.sampler.load_state_dict(dict(carry.state.config_records[STREAM_STATE]))
            self.sampler.batch_size = self.batch_size  # this round's
        workers = loader.num_workers
        self._loader: DataLoader[Any] = DataLoader(
            loader.dataset,
            batch_sampler=self.sampler,
            num_workers=workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context if workers else None,
            generator=loader.generator,
            prefetch_factor=loader.prefetch_factor if workers else None,
            persistent_workers=loader.persistent_workers,
            pin_memory_device=loader.pin_memory_device,
        )
        # Without workers each pass starts a new iterator, as the app's loop does (and so
        # draws what it draws); with workers one iterator runs across passes, so that no
        # batch the workers prefetched is lost between them.
        self._stream: Iterator[Any] | None = None

    @property
    def dataset(self) -> Any:
        return self.original.dataset

    def __len__(self) -> int:
        if self.round_steps is not None:
            return min(self.steps_per_pass, self.round_steps)
        return self.steps_per_pass

    def __iter__(self) -> Iterator[Any]:
        if self._stream is None or self.original.num_workers == 0:
            self._stream = iter(self._loader)
        return self._timed_pass(self._stream)

    def __getattr__(self, name: str) -> Any:  # sampler, num_workers, ...: the app's loader's
        return getattr(self.original, name)

    def _timed_pass(self, stream: Iterator[Any]) -> Iterator[Any]:
        """One pass: `steps_per_pass` batches. A step's time runs from asking for its
        batch to asking for the next (or the end of the pass): loading plus the app's own
        forward, backward and optimizer step. On a GPU each boundary waits for the work
        queued there (the app's loop need not call .item()): otherwise the host's clock
        would time kernel launches, not the steps."""
        synchronize()
        last = time.perf_counter()
        try:
            for _ in range(self.steps_per_pass):
                if self.round_steps is not None and self.timing.steps >= self.round_steps:
                    break  # the round's steps are run: this pass, and any after it, end
                batch = next(stream)
                try:
                    yield batch
                finally:  # also when the app's loop stops early
                    self._step_done(last)
                    last = time.perf_counter()
        finally:
            if self._carry is not None:  # where the next round goes on
                self._carry.state[STREAM_STATE] = ConfigRecord(self.sampler.state_dict())

    def _step_done(self, last: float) -> None:
        """Time the step that began at `last` (padded to the emulated speed, if any)."""
        timing = self.timing
        synchronize()
        elapsed = real = time.perf_counter() - last
        if timing.pace is not None:
            target = timing.pace(real, self.batch_size)
            if target > real:
                time.sleep(target - real)
            elapsed = max(real, target)
        timing.step_s.append(elapsed)
        timing.steps += 1
        timing.compute_s += elapsed
        timing.real_compute_s += real


def balanced_loader(
    msg: Message, loader: DataLoader[Any], carry: Context | None = None
) -> BalancedLoader:
    """The app's training DataLoader, drawn at the batch size the server sent in `msg`
    (the loader's own when the server sent none: round 1) for len(loader) steps per pass,
    and timed for `balance_mod()`, which must be in the ClientApp's mods.

    The batches follow the app's own sampler: each epoch's order is what `loader.sampler`
    yields when the epoch starts (a shuffling loader draws it from torch's RNG, as its
    own iteration would), cut into batches of the server's size, the epoch's last batch
    short where that size does not divide it. At the app's own batch size and step count
    a round therefore yields exactly the app's batches for the same torch seed; at
    another size a pass runs on into the next epoch (a fresh order) or stops inside one.
    Each round starts a fresh epoch. With `carry` (the handler's Context) the stream goes
    on across rounds instead, kept in `carry.state`: each round continues the last one's
    epoch (FLamby's benchmarks train so). With num_workers > 0 the batches a worker
    prefetched at a round's end are skipped."""
    timing = _CURRENT.get()
    if timing is None:
        raise RuntimeError(
            "balanced_loader(msg, loader) needs balance_mod() in the ClientApp's mods: "
            "app = ClientApp(mods=[balance_mod()])"
        )
    if Orders.read(sent_config(msg)) != timing.orders:
        raise ValueError("balanced_loader got another message than the one being handled")
    return BalancedLoader(loader, timing, carry)
