"""fedlb's wire protocol: every key fedlb adds to Flower's messages, in one place.

The server tells each silo, inside the train message's ConfigRecord (next to the app's own
keys and Flower's `server-round`), its `Orders`: the batch size to draw, and optionally the
local steps to run. The silo answers, inside its reply's MetricRecord (next to the app's
own metrics and the weighting key, `num-examples` by default), a `SiloReport`: what it ran
and how long the run took. fedlb's keys all start with `fedlb.`, so they never clash with
an app's own names, and `user_metrics` takes them out again before an app's metric
aggregation sees the record.

What a silo is told to emulate (a speed or a measured step-time curve, on the measured or
the model clock) comes from its node config or the run config: `read_emulation`.

The same module names the metrics of fedlb's own silo app (its learning rate, evaluation
inside the train reply) and the usual names other apps give accuracy and loss, which the
server's round records look for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Message, MetricRecord

from .identity import worker_name

if TYPE_CHECKING:  # the silo side never needs the balancer: imported where a server uses it
    from fedlb.balance import WorkerReport

PREFIX = "fedlb."

# server -> silo, in the train ConfigRecord
# in every train message of a balancing server: a silo's balance_mod reports only then
# (a stock strategy's server would average fedlb's keys into the app's metrics)
PROTOCOL = "fedlb.protocol"
PROTOCOL_VERSION = 1
BATCH_SIZE = "fedlb.batch-size"  # absent: the silo draws its own loader's batch size (B0)
LOCAL_STEPS = "fedlb.local-steps"  # absent: as many steps as the silo's loop runs
# the most steps the silo's loader yields in the round, all passes together (the second
# lever at the edge of stability: fewer steps at the silo's own batch size); absent: no cap
ROUND_STEPS = "fedlb.round-steps"
EVALUATE_FIRST = "fedlb.evaluate"  # fedlb's silo app: evaluate the incoming model first
NOTICE = "fedlb.notice"  # what became of the silo's last update, when it was left out
NOTICE_LINE = "fedlb: the server says:"  # how balance_mod prints a notice in the silo's log
NOTICE_CHARS = 500  # a notice is one line of a console, not a document
SERVER_ROUND = "server-round"  # Flower's own key (FedAvg sets it too)

# silo -> server, in the train reply's MetricRecord
COMPUTE_S = "fedlb.compute-s"  # seconds of the local steps: the part that scales with B
OVERHEAD_S = "fedlb.overhead-s"  # the rest of the handler: loading, evaluating, encrypting
CPU = "fedlb.cpu"  # the silo machine's CPU use, 0..1
MEM = "fedlb.mem"  # and memory use, 0..1
PARTITION_ID = "fedlb.partition-id"  # the node config's partition-id: a stable silo label
EMULATED_SPEED = "fedlb.emulated-speed"  # samples/s it emulated (0: real hardware speed)
# the step-time curve it emulated, by name (fedlb.training's STEP_CURVES, "NAME*K"), as
# its UTF-8 bytes: a MetricRecord holds numbers only. Absent: none
EMULATED_CURVE = "fedlb.emulated-curve"
CURVE_NAME_BYTES = 200  # a longer name is no curve's: ignored
MODEL_CLOCK = "fedlb.model-clock"  # 1: the times are the model clock's, not measured
HE_S = "fedlb.he-s"  # of overhead-s: CKKS decryption, encryption and serialisation
# seconds from the ClientApp's process start to its training handler: Python, imports,
# Flower's message pull, the FAB, torch's first use (a warm silo's fork: milliseconds)
START_S = "fedlb.start-s"
# ||w_i − w||: how far the silo's update moved the model it received (absent where the
# mod saw only ciphertexts); the server's StabilityGuard watches it
UPDATE_NORM = "fedlb.update-norm"
REPORT_KEYS = (BATCH_SIZE, LOCAL_STEPS, COMPUTE_S, OVERHEAD_S)  # a report needs these
LARGEST = 2**24  # the most samples per step, or steps per round, a report may claim
# Physical bounds on a report's times: a round takes less than ~11 days, and no machine
# trains a billion samples a second (an H200 runs a small MLP at ~10^7); a report past them
# is dropped with the reason (1e-298 s once set the round's ideal time and E for everyone)
MOST_SECONDS = 1e6
MOST_SPEED = 1e9  # samples/s

# server -> the app's Result, beside the app's aggregated train metrics: the round's
# balance (key -> RoundRecord field)
ROUND_FIGURES = {
    "fedlb.efficiency": "efficiency",
    "fedlb.round-s": "round_s",
    "fedlb.ideal-s": "ideal_s",
    "fedlb.idle-fraction": "idle_fraction",
}

# The silo's Context.state: where its carried batch stream stands (balanced_loader(carry=))
STREAM_STATE = "fedlb.batch-stream"

# node config (SuperNode --node-config) keys fedlb reads
NODE_PARTITION_ID = "partition-id"  # its part of the federation's dataset (and its label)
NODE_NUM_PARTITIONS = "num-partitions"
NODE_DATA_PATH = "data-path"  # its own .npz instead of a partition
NODE_EMULATED_SPEED = "emulated-speed"  # samples/s to emulate (0: real speed)
NODE_EMULATED_CURVE = "emulated-curve"  # a step-time curve to emulate ("NAME" or "NAME*K")
NODE_THREADS = "threads"  # torch threads (0: torch's default)
NODE_DEVICE = "device"  # where it trains: auto (a GPU if it has one), cpu, cuda, cuda:N
NODE_HE_CONTEXT = "he-context"  # the silos' secret CKKS context file

# environment: the time.time() a warm silo forked the ClientApp handling this message
# (fedlb.deploy.warm sets it, the balancing mod reads it for its start-s)
TASK_STARTED_ENV = "FEDLB_TASK_STARTED"

# run config ([tool.flwr.app.config] or `flwr run --run-config`) keys fedlb reads
# samples/s to emulate per partition-id, "400,200,100": heterogeneous silos in Flower's
# simulation, whose nodes' config holds only partition-id and num-partitions
RUN_EMULATED_SPEEDS = "fedlb-emulated-speeds"
# step-time curves to emulate per partition-id, "h200/cnn,cpu4/cnn,cpu1/cnn" (an empty
# entry: none for that partition)
RUN_EMULATED_CURVES = "fedlb-emulated-curves"
# the clock those speeds run on: "measured" (steps padded with sleep, the default) or
# "model" (no sleeping: the silo reports τ·B/v, deterministic, for studies of accuracy)
NODE_EMULATED_CLOCK = "emulated-clock"
RUN_EMULATED_CLOCK = "fedlb-emulated-clock"
EMULATED_CLOCKS = ("measured", "model")

# fedlb's own silo app: its config and metric names (an app's own, not fedlb's protocol)
LEARNING_RATE = "learning-rate"
TRAIN_LOSS = "train-loss"
EVAL_ACC = "eval-acc"
EVAL_LOSS = "eval-loss"
EVAL_EXAMPLES = "eval-examples"  # the weight of an evaluation carried in a train reply

# What the server's round records read from any app's metrics, first match wins.
ACCURACY_NAMES = (EVAL_ACC, "eval_acc", "accuracy", "acc", "eval_accuracy", "val_accuracy")
LOSS_NAMES = (EVAL_LOSS, "eval_loss", "loss", "val_loss")
TRAIN_LOSS_NAMES = (TRAIN_LOSS, "train_loss", "loss")


class ProtocolError(ValueError):
    """A message that does not follow fedlb's protocol; the text says what and why."""


def _whole(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value) or not float(value).is_integer() or value < 1:
        raise ProtocolError(f"{what} must be a whole number >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Orders:
    """What the server tells one silo for a train round."""

    server_round: int
    batch_size: int | None = None  # None: the silo's own loader's batch size
    local_steps: int | None = None  # None: as many as its loop runs (fixed after round 1)
    evaluate_first: bool = False
    notice: str = ""  # why its last update was left out (the silo's console says it)
    balanced: bool = True  # False: no fedlb server sent them (a stock strategy's message)
    round_steps: int | None = None  # None: no cap on the round's steps (all passes)

    def into(self, config: ConfigRecord) -> ConfigRecord:
        """`config` (the app's train config, copied) with the orders added."""
        out = ConfigRecord(dict(config))
        out[PROTOCOL] = PROTOCOL_VERSION
        out[SERVER_ROUND] = self.server_round
        if self.batch_size is not None:
            out[BATCH_SIZE] = self.batch_size
        if self.local_steps is not None:
            out[LOCAL_STEPS] = self.local_steps
        if self.round_steps is not None:
            out[ROUND_STEPS] = self.round_steps
        if self.evaluate_first:
            out[EVALUATE_FIRST] = True
        if self.notice:
            out[NOTICE] = self.notice
        return out

    @classmethod
    def read(cls, config: Mapping[str, Any]) -> Orders:
        """The orders in a train message's ConfigRecord; ProtocolError if malformed."""
        server_round = config.get(SERVER_ROUND, 0)
        batch = config.get(BATCH_SIZE)
        steps = config.get(LOCAL_STEPS)
        cap = config.get(ROUND_STEPS)
        return cls(
            server_round=0
            if server_round == 0 and not isinstance(server_round, bool)
            else _whole(server_round, SERVER_ROUND),
            batch_size=None if batch is None else _whole(batch, f"the server's {BATCH_SIZE}"),
            local_steps=None if steps is None else _whole(steps, f"the server's {LOCAL_STEPS}"),
            round_steps=None if cap is None else _whole(cap, f"the server's {ROUND_STEPS}"),
            evaluate_first=config.get(EVALUATE_FIRST) is True,
            notice=str(config.get(NOTICE, ""))[:NOTICE_CHARS],
            balanced=PROTOCOL in config,
        )


@dataclass(frozen=True)
class SiloReport:
    """What a silo ran in a train round and what it cost, in its own seconds."""

    batch_size: int
    local_steps: int
    compute_s: float
    overhead_s: float
    cpu: float | None = None
    mem: float | None = None
    partition_id: int | None = None
    emulated_speed: float = 0.0
    model_clock: bool = False
    update_norm: float | None = None  # inf: the update was not finite
    start_s: float | None = None  # its ClientApp's start-up before the handler
    emulated_curve: str = ""  # the step-time curve it emulated ('' : none)

    def metrics(self) -> dict[str, int | float | list[int]]:
        """The report as MetricRecord entries (fedlb's keys only)."""
        out: dict[str, int | float | list[int]] = {
            BATCH_SIZE: self.batch_size,
            LOCAL_STEPS: self.local_steps,
            COMPUTE_S: self.compute_s,
            OVERHEAD_S: self.overhead_s,
            EMULATED_SPEED: self.emulated_speed,
        }
        for key, value in ((CPU, self.cpu), (MEM, self.mem), (PARTITION_ID, self.partition_id)):
            if value is not None:
                out[key] = value
        if self.model_clock:
            out[MODEL_CLOCK] = 1
        if self.update_norm is not None:
            out[UPDATE_NORM] = self.update_norm
        if self.start_s is not None:
            out[START_S] = self.start_s
        if self.emulated_curve:
            out[EMULATED_CURVE] = list(self.emulated_curve.encode()[:CURVE_NAME_BYTES])
        return out

    def samples_per_s(self) -> float | None:
        """The speed the silo ran at, samples per second of compute (None: no compute
        time to divide by)."""
        if not (self.compute_s > 0 and math.isfinite(self.compute_s)):
            return None
        return self.batch_size * self.local_steps / self.compute_s

    def worker_report(self, node: int) -> WorkerReport:
        """The report of the silo on `node` as the balancer's WorkerReport."""
        from fedlb.balance import WorkerReport

        return WorkerReport(
            worker=worker_name(node),
            batch_size=self.batch_size,
            iterations=self.local_steps,
            compute_s=self.compute_s,
            overhead_s=self.overhead_s,
            cpu=self.cpu,
            mem=self.mem,
        )


@dataclass(frozen=True)
class Emulation:
    """What a silo is told to emulate (one machine standing in for many): a speed in
    samples/s (0: none) or a step-time curve by name ('' : none), on the `measured` clock
    (steps padded with sleep) or the `model` one (no sleeping: the model's times reported)."""

    speed: float = 0.0
    curve: str = ""
    clock: str = "measured"


def read_emulation(node_config: Mapping[str, Any], run_config: Mapping[str, Any]) -> Emulation:
    """A silo's emulation: its node config's `emulated-speed` and `emulated-curve`, else
    its partition-id's entries in the run config's `fedlb-emulated-speeds` and
    `fedlb-emulated-curves` (Flower's simulation gives nodes no config of their own); the
    clock from node config `emulated-clock`, else run config `fedlb-emulated-clock`, else
    "measured". ValueError names a bad setting, or a silo given both a speed and a curve."""
    value = node_config.get(NODE_PARTITION_ID)
    partition = (
        int(value)
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and float(value).is_integer()
        else None
    )
    speed, speed_from = _emulated_speed(node_config, run_config, partition)
    curve, curve_from = _emulated_curve(node_config, run_config, partition)
    if speed > 0 and curve:
        raise ValueError(
            f"{speed_from} and {curve_from} are both set: a silo emulates a speed or a "
            "step-time curve, not both"
        )
    clock = node_config.get(NODE_EMULATED_CLOCK)
    if clock is None:
        clock = run_config.get(RUN_EMULATED_CLOCK) or "measured"
    if clock not in EMULATED_CLOCKS:
        raise ValueError(
            f"the emulated clock must be one of {', '.join(EMULATED_CLOCKS)}, got {clock!r}"
        )
    return Emulation(speed, curve, str(clock))


def _emulated_speed(
    node_config: Mapping[str, Any], run_config: Mapping[str, Any], partition: int | None
) -> tuple[float, str]:
    """(samples/s to emulate, the setting that says so); 0: the silo's real speed."""
    if NODE_EMULATED_SPEED in node_config:
        speed = node_config[NODE_EMULATED_SPEED]
        where = f"node config {NODE_EMULATED_SPEED}"
    elif str(run_config.get(RUN_EMULATED_SPEEDS, "")).strip():  # "": real speeds
        listed = str(run_config[RUN_EMULATED_SPEEDS])
        try:
            speeds = [float(x) for x in listed.split(",")]
        except ValueError:
            raise ValueError(
                f"run config {RUN_EMULATED_SPEEDS} must list samples/s per partition-id, "
                f'e.g. "400,200,100"; got {listed!r}'
            ) from None
        if partition is None or not 0 <= partition < len(speeds):
            raise ValueError(
                f"run config {RUN_EMULATED_SPEEDS}={listed!r} has no entry for this silo's "
                f"partition-id {partition!r}: list one speed per partition (0 = real speed)"
            )
        speed = speeds[partition]
        where = f"run config {RUN_EMULATED_SPEEDS} (partition-id {partition})"
    else:
        return 0.0, ""
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not speed >= 0:
        raise ValueError(f"{where} must be a number >= 0, got {speed!r}")
    if not math.isfinite(speed):
        raise ValueError(f"{where} must be finite, got {speed!r}")
    return float(speed), where


def _emulated_curve(
    node_config: Mapping[str, Any], run_config: Mapping[str, Any], partition: int | None
) -> tuple[str, str]:
    """(the curve to emulate, by name, the setting that says so); '' : none. The name is
    read here, not looked up: fedlb.training's step_curve knows the curves."""
    if NODE_EMULATED_CURVE in node_config:
        curve = node_config[NODE_EMULATED_CURVE]
        where = f"node config {NODE_EMULATED_CURVE}"
        if not isinstance(curve, str):
            raise ValueError(f"{where} must name a step-time curve, got {curve!r}")
        return curve.strip(), where
    listed = str(run_config.get(RUN_EMULATED_CURVES, ""))
    if not listed.strip():
        return "", ""
    curves = [c.strip() for c in listed.split(",")]
    if partition is None or not 0 <= partition < len(curves):
        raise ValueError(
            f"run config {RUN_EMULATED_CURVES}={listed!r} has no entry for this silo's "
            f"partition-id {partition!r}: list one curve per partition (an empty entry: none)"
        )
    return curves[partition], f"run config {RUN_EMULATED_CURVES} (partition-id {partition})"


def sent_config(msg: Message) -> Mapping[str, Any]:
    """The train message's ConfigRecord (the app's keys and fedlb's orders); {} if none."""
    records = msg.content.config_records
    return next(iter(records.values())) if records else {}


def numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The record's finite scalar values as floats; anything else is left out."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def read_report(metrics: Mapping[str, Any]) -> SiloReport:
    """The SiloReport in a train reply's metrics; ProtocolError says what is missing or
    malformed (an app without `balance_mod()`, a corrupt or hostile reply)."""
    missing = [k for k in REPORT_KEYS if k not in metrics]
    if missing:
        raise ProtocolError(
            f"missing metric(s) {', '.join(missing)} (is balance_mod() in the ClientApp's "
            "mods, and does its train loop draw from balanced_loader?)"
        )
    values = numbers(metrics)
    bad = [k for k in REPORT_KEYS if k not in values]
    if bad:
        raise ProtocolError(
            "metric(s) not finite numbers: " + ", ".join(f"{k}={metrics[k]!r}" for k in bad)
        )
    for key in (BATCH_SIZE, LOCAL_STEPS):
        if not values[key].is_integer():
            raise ProtocolError(f"{key} must be a whole number, got {values[key]!r}")
        if not 1 <= values[key] <= LARGEST:
            raise ProtocolError(f"{key} must be in 1..{LARGEST}, got {values[key]:g}")
    for key in (COMPUTE_S, OVERHEAD_S):
        if not 0 <= values[key] <= MOST_SECONDS:
            raise ProtocolError(f"{key} must be in 0..{MOST_SECONDS:g} s, got {values[key]:g}")
    samples = values[BATCH_SIZE] * values[LOCAL_STEPS]
    if samples > MOST_SPEED * values[COMPUTE_S]:
        raise ProtocolError(
            f"{samples:g} samples in {values[COMPUTE_S]:g} s of {COMPUTE_S} is faster than "
            f"{MOST_SPEED:g} samples/s, which no machine trains: not a measured time"
        )
    partition = values.get(PARTITION_ID)
    return SiloReport(
        batch_size=int(values[BATCH_SIZE]),
        local_steps=int(values[LOCAL_STEPS]),
        compute_s=values[COMPUTE_S],
        overhead_s=values[OVERHEAD_S],
        cpu=values.get(CPU),
        mem=values.get(MEM),
        partition_id=None if partition is None or not partition.is_integer() else int(partition),
        emulated_speed=values.get(EMULATED_SPEED, 0.0),
        model_clock=values.get(MODEL_CLOCK, 0.0) > 0,
        update_norm=_update_norm(metrics.get(UPDATE_NORM)),
        start_s=values[START_S] if values.get(START_S, -1.0) >= 0 else None,
        emulated_curve=_curve_name(metrics.get(EMULATED_CURVE)),
    )


def _curve_name(value: Any) -> str:
    """A reported curve's name from its bytes; '' where absent or not a name's bytes."""
    if not isinstance(value, list) or not 0 < len(value) <= CURVE_NAME_BYTES:
        return ""
    if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in value):
        return ""
    try:
        name = bytes(value).decode()
    except UnicodeDecodeError:
        return ""
    return name if name.isprintable() else ""


def _update_norm(value: Any) -> float | None:
    """A reported update norm: None when absent or not a number, inf when not finite
    (a NaN or infinite update is a diverged one) or negative."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else math.inf


def partition_of(metrics: MetricRecord) -> int | None:
    """The partition id a silo's reply claims (None: it names none, e.g. its own data)."""
    value = numbers(metrics).get(PARTITION_ID)
    return None if value is None or not value.is_integer() else int(value)


def only_metrics(msg: Message) -> MetricRecord:
    """A reply's one MetricRecord (UpdateCheck has checked it has one)."""
    return next(iter(msg.content.metric_records.values()))


def user_metrics(metrics: MetricRecord) -> MetricRecord:
    """The record without fedlb's keys: what the app itself reported."""
    return MetricRecord({k: v for k, v in metrics.items() if not k.startswith(PREFIX)})


def add_he_seconds(metrics: MetricRecord, he_s: float) -> None:
    """Count the seconds an encryption mod spent as the silo's fixed cost (when the
    balancing mod has already reported, i.e. it runs inside the encryption mod)."""
    if OVERHEAD_S in metrics:
        metrics[OVERHEAD_S] = float(metrics[OVERHEAD_S]) + he_s  # type: ignore[arg-type]
    metrics[HE_S] = float(metrics.get(HE_S, 0.0)) + he_s  # type: ignore[arg-type]


def first_number(values: Mapping[str, float], names: tuple[str, ...]) -> float | None:
    """The first of `names` present in `values` (e.g. an app's accuracy metric)."""
    return next((values[name] for name in names if name in values), None)
