"""Round 1 balanced: each silo keeps its measured speed profile, the server asks for it.

Without a profile, round 1 runs every silo at its own B0 (E 0.44 at speeds 1:2:4): the
server knows nothing of the silos until their first reports. Each silo's balancing mod
stores what it measured (samples/s, fixed seconds, its B0 and τ) after every train round,
keyed by what the speed depends on: the model (its arrays' names, shapes and dtypes), the
silo (its label) and its hardware (CPU model, cores, torch threads, device, emulated
speed and clock). A server that has run this model before asks the silos for their
profiles before round 1 (one train message without a model, answered by the balancing
mod without the app) and starts balanced. A profile is a prior, never trusted blindly:
a silo answers only for the same model and hardware; its age is sent along and one older than
`MAX_AGE_S` is ignored; after round 1 the measured speed is compared with the profile's
and a profile off by more than `STALE` is said to be stale (the estimator then follows
the measurement, as after any change of speed).

Where: $FEDLB_PROFILE_DIR, else $XDG_CACHE_HOME/fedlb/profiles, else
~/.cache/fedlb/profiles; FEDLB_PROFILE_DIR=off turns profiles off. Files are 0600.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedlb.data import profile_cache_dir
from fedlb.security import StoredFileError, read_json_object, set_aside

from .protocol import MOST_SECONDS, MOST_SPEED, PARTITION_ID, SERVER_ROUND, SiloReport, numbers

if TYPE_CHECKING:  # a silo answering a query never needs the server side
    from flwr.serverapp import Grid

log = logging.getLogger("fedlb.flower")

MAX_AGE_S = 30 * 24 * 3600.0  # older profiles are ignored: hardware and software drift
QUERY_TIMEOUT_S = 20.0  # a silo that has not answered by then: round 1 at B0
STALE = 0.3  # measured speed off the profile's by more than this: the profile was stale
SEEN_FILE = "models-seen.json"  # the server's: models it has balanced before

# server -> silo, in the ConfigRecord of a train message without a model: the model whose
# profile the server asks for (the query)
PROFILE_OF = "fedlb.profile-of"
# silo -> server, in the reply's MetricRecord
PROFILE_SPEED = "fedlb.profile-speed"  # samples/s
PROFILE_OVERHEAD = "fedlb.profile-overhead-s"
PROFILE_BATCH = "fedlb.profile-batch"  # its own B0
PROFILE_STEPS = "fedlb.profile-steps"  # τ it ran
PROFILE_AGE = "fedlb.profile-age-s"
PROFILE_ROUNDS = "fedlb.profile-rounds"
MOST_ROUNDS = 5  # a profile counts as at most this many rounds' reports
# What a measurement can be: a profile with a figure outside these is ignored, with the
# reason (a speed of 1e300 samples/s would otherwise be "balanced from", then found stale;
# a B0 and τ of 2^24 made round 1's sizes 1.4 M and 14 M, and every silo missed its
# timeout). The same bounds as a train report's (protocol's MOST_SPEED, MOST_SECONDS),
# tighter on sizes: a profile's are the silo's own B0 and τ, which the balancer sums into X.
MAX_BATCH = 2**16  # a silo's own B0: 65,536 samples a step (typical: 16 to 512)
MAX_STEPS = 2**16  # τ
MAX_SAMPLES = 2**24  # B0·τ: ~17 M samples a round, 13 passes over ImageNet-1k
# A profile file is a few hundred bytes; the folder's shared files (models seen, the
# guard's verdicts) an entry per model or app. Larger is damage, refused before reading.
MAX_PROFILE_BYTES = 2**16
MAX_KEPT_BYTES = 2**23
PROFILE_PARTITION = PARTITION_ID  # the same key as a train report's


@dataclass(frozen=True)
class SiloProfile:
    """What a silo measured of itself for one model on its hardware."""

    speed: float  # samples/s of its local steps
    overhead_s: float  # its fixed seconds per round
    batch_size: int  # its own B0 (what it brings to X)
    local_steps: int
    measured_at: float  # time.time()
    rounds: int = 1  # the rounds of one run its speed and fixed cost are the mean of
    run_id: int = 0  # that run's

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.measured_at)

    @classmethod
    def checked(
        cls,
        speed: Any,
        overhead_s: Any,
        batch_size: Any,
        local_steps: Any,
        measured_at: Any,
        rounds: Any = 1,
        run_id: Any = 0,
    ) -> SiloProfile:
        """A profile from stored or sent figures; ValueError, saying which figure, where
        one is not a number or not what a measurement can be (not finite, not above
        zero, beyond MOST_SPEED, MAX_BATCH, MAX_STEPS, B0·τ beyond MAX_SAMPLES or
        MOST_SECONDS of compute at its speed): a profile to ignore."""
        figures = {  # name: (value, least, most, unit); a speed must be above zero
            "speed": (speed, 0.0, MOST_SPEED, " samples/s"),
            "fixed cost": (overhead_s, 0.0, MOST_SECONDS, " s"),
            "batch size": (batch_size, 1, MAX_BATCH, ""),
            "local steps": (local_steps, 1, MAX_STEPS, ""),
            "rounds": (rounds, 1, 2**31, ""),
            "run id": (run_id, 0, 2**64 - 1, ""),  # Flower's run ids are unsigned 64-bit
        }
        for name, (value, least, most, unit) in figures.items():
            if not is_finite_number(value):
                shown = f"{value}{unit}" if isinstance(value, float) else f"{value!r:.20}"
                raise ValueError(f"{name} {shown}, not a finite number")
            if not least <= value <= most or (name == "speed" and value == 0):
                opening = "(" if name == "speed" else "["
                raise ValueError(f"{name} {value:.3g}{unit}, not in {opening}{least:g}, {most:g}]")
            if isinstance(least, int) and not float(value).is_integer():  # a count
                raise ValueError(f"{name} {value:g}, not a whole number")
        if not is_finite_number(measured_at):
            raise ValueError(f"measured at {measured_at!r:.20}, not a time")
        # each figure in range, a round of them may still be none a silo ran
        samples = batch_size * local_steps
        if samples > MAX_SAMPLES:
            raise ValueError(
                f"batch size {batch_size} x {local_steps} local steps: {samples:.3g} samples "
                f"a round, more than {MAX_SAMPLES:g}"
            )
        if samples / speed > MOST_SECONDS:
            raise ValueError(
                f"{samples} samples a round at {speed:.3g} samples/s: {samples / speed:.3g} s "
                f"of compute, more than {MOST_SECONDS:g}"
            )
        return cls(
            speed=float(speed),
            overhead_s=float(overhead_s),
            batch_size=int(batch_size),
            local_steps=int(local_steps),
            measured_at=float(measured_at),
            rounds=int(rounds),
            run_id=int(run_id),
        )


def is_finite_number(value: Any) -> bool:
    """A real number, finite (JSON has NaN and Infinity; a bool is no figure)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def model_key(arrays: ArrayRecord) -> str:
    """The model's identity for speed: its arrays' names, shapes and dtypes."""
    layout = [[name, list(array.shape), str(array.dtype)] for name, array in arrays.items()]
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (read once per process: a silo asks every round)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def hardware(node_config: Mapping[str, Any]) -> dict[str, Any]:
    """What a silo's speed depends on besides the model: the machine, and the node
    config's threads, device and emulation (torch's thread count itself is not read: an
    app may set it inside its handler, after a query was answered)."""
    machine = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads": node_config.get("threads", 0),
        "device": str(node_config.get("device", "")),
        "emulated-speed": node_config.get("emulated-speed", 0),
        "emulated-clock": str(node_config.get("emulated-clock", "")),
    }
    curve = node_config.get("emulated-curve")
    if curve:  # only then: the profiles silos stored before curves existed keep their key
        machine["emulated-curve"] = str(curve)
    return machine


def _entry(folder: Path, label: str, model: str, machine: Mapping[str, Any]) -> Path:
    key = json.dumps([label, model, machine], sort_keys=True)
    return folder / f"profile-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def write_json_file(path: Path, value: Any) -> None:
    """`value` to `path` atomically (a silo and its server may share the folder), 0600."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(handle, "w") as out:  # mkstemp's file is 0600
            json.dump(value, out)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def save_profile(label: str, model: str, machine: Mapping[str, Any], profile: SiloProfile) -> None:
    """Store a silo's profile (atomically; a failure is said, never raised: a profile
    only saves time)."""
    folder = profile_cache_dir()
    if folder is None:
        return
    stored = {"label": label, "model": model, "hardware": machine, **asdict(profile)}
    try:
        write_json_file(_entry(folder, label, model, machine), stored)
    except OSError as error:
        log.warning("could not store this silo's speed profile in %s: %s", folder, error)


def record_round(
    label: str,
    model: str,
    machine: Mapping[str, Any],
    run_id: int,
    measured: SiloProfile,
    capped: bool = False,
) -> None:
    """Add a train round's measurement to the silo's profile: the mean over the rounds of
    the run it comes from (a new run starts the profile afresh). A `capped` round (the
    steps lever cut its steps) measured the speed, not the silo's own steps: the
    profile keeps those of the last round run in full (none yet: nothing is stored)."""
    before = load_profile(label, model, machine)
    if capped:
        if before is None:
            return
        measured = replace(measured, local_steps=before.local_steps)
    if before is None or before.run_id != run_id:
        save_profile(label, model, machine, replace(measured, rounds=1, run_id=run_id))
        return
    n = before.rounds
    save_profile(
        label,
        model,
        machine,
        replace(
            measured,
            speed=(before.speed * n + measured.speed) / (n + 1),
            overhead_s=(before.overhead_s * n + measured.overhead_s) / (n + 1),
            rounds=n + 1,
            run_id=run_id,
        ),
    )


def load_profile(label: str, model: str, machine: Mapping[str, Any]) -> SiloProfile | None:
    """The silo's profile for this model on this hardware; None if there is none, it is
    unreadable, not what a silo can measure (`SiloProfile.checked`, said once) or older
    than MAX_AGE_S. A damaged file (too large, too deep, not JSON, not a profile's
    fields) is set aside, said once: the silo goes on as if it had none."""
    folder = profile_cache_dir()
    if folder is None:
        return None
    path = _entry(folder, label, model, machine)
    then = "this silo's next train round measures it afresh"
    try:
        stored = read_json_object(path, max_bytes=MAX_PROFILE_BYTES)
    except FileNotFoundError:
        return None
    except StoredFileError as error:
        set_aside_damaged(path, error.reason, then)
        return None
    except OSError as error:
        _say_once(path, "ignoring the speed profile %s (%s): %s", path, _reason(error), then)
        return None
    fault = _shape_fault(stored)
    if fault is not None:
        set_aside_damaged(path, fault, then)
        return None
    try:
        profile = SiloProfile.checked(
            stored["speed"],
            stored["overhead_s"],
            stored["batch_size"],
            stored["local_steps"],
            stored["measured_at"],
            rounds=stored.get("rounds", 1),
            run_id=stored.get("run_id", 0),
        )
    except ValueError as error:  # figures, but none a silo measures: ignored, replaced
        _say_once(path, "ignoring the speed profile %s (%s): %s and replaces it", path, error, then)
        return None
    return profile if profile.age_s <= MAX_AGE_S else None


_SAID_DAMAGED: set[Path] = set()


_STORED = ("speed", "overhead_s", "batch_size", "local_steps", "measured_at")


def _shape_fault(stored: Mapping[str, Any]) -> str | None:
    """What makes a stored object no profile (a field missing, or not a number), or None."""
    missing = [key for key in _STORED if key not in stored]
    if missing:
        return f"no {', '.join(missing)}"
    for key in (*_STORED, "rounds", "run_id"):
        if key in stored and not is_finite_number(stored[key]):
            return f"{key} {stored[key]!r:.20}, not a number"
    return None


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def _say_once(path: Path, message: str, *args: Any) -> None:
    """A warning about `path`, once per process (a silo reads its profile every round)."""
    if path not in _SAID_DAMAGED:
        _SAID_DAMAGED.add(path)
        log.warning(message, *args)


def set_aside_damaged(path: Path, reason: str, then: str) -> None:
    """A damaged file of the profiles' folder renamed beside itself
    (security.set_aside), said once with its new name and `then` (what happens
    instead); one that cannot be renamed is said once and left."""
    try:
        moved = set_aside(path)
    except FileNotFoundError:  # another process (a silo and its server share the folder)
        return
    except OSError as error:
        _say_once(
            path,
            "ignoring the damaged %s (%s; it could not be set aside: %s): %s",
            path,
            reason,
            _reason(error),
            then,
        )
        return
    log.warning("set aside the damaged %s as %s (%s): %s", path, moved.name, reason, then)


def profile_reply(msg: Message, profile: SiloProfile | None, partition: int | None) -> Message:
    """The answer to a profile query: the profile's figures (none: no profile) and the
    silo's partition id (where it has one)."""
    metrics = MetricRecord()
    if profile is not None:
        metrics[PROFILE_SPEED] = profile.speed
        metrics[PROFILE_OVERHEAD] = profile.overhead_s
        metrics[PROFILE_BATCH] = profile.batch_size
        metrics[PROFILE_STEPS] = profile.local_steps
        metrics[PROFILE_AGE] = profile.age_s
        metrics[PROFILE_ROUNDS] = profile.rounds
    if partition is not None:  # with or without a profile: a restarted server needs it
        metrics[PROFILE_PARTITION] = partition
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


def profile_query(model: str) -> RecordDict:
    # server-round 0, as a train message carries one: mods outside the balancing mod may read it
    return RecordDict({"config": ConfigRecord({SERVER_ROUND: 0, PROFILE_OF: model})})


def read_profile(reply: Message) -> tuple[SiloProfile, int | None] | None:
    """A query reply's profile and partition id; None where it has none or is malformed."""
    if reply.has_error() or not reply.content.metric_records:
        return None
    values: dict[str, Any] = dict(next(iter(reply.content.metric_records.values())))
    sent = (PROFILE_SPEED, PROFILE_OVERHEAD, PROFILE_BATCH, PROFILE_STEPS, PROFILE_AGE)
    if not any(key in values for key in sent):
        return None  # the silo has no profile (perhaps its partition id alone)
    try:
        if missing := [key for key in sent if key not in values]:
            raise ValueError(f"no {', '.join(missing)}")
        age = values[PROFILE_AGE]
        if not is_finite_number(age) or not 0 <= age <= MAX_AGE_S:  # no silo sends one older
            raise ValueError(f"age {age!r:.20} s, not in [0, {MAX_AGE_S:g}]")
        profile = SiloProfile.checked(
            values[PROFILE_SPEED],
            values[PROFILE_OVERHEAD],
            values[PROFILE_BATCH],
            values[PROFILE_STEPS],
            measured_at=time.time() - age,
            rounds=values.get(PROFILE_ROUNDS, 1),
        )
    except ValueError as error:
        log.warning(
            "node %d sent a damaged speed profile (%s): ignored",
            reply.metadata.src_node_id,
            error,
        )
        return None
    profile = replace(profile, rounds=min(MOST_ROUNDS, profile.rounds))
    partition = numbers(values).get(PROFILE_PARTITION)
    return profile, None if partition is None or not partition.is_integer() else int(partition)


def seen_before(model: str) -> bool:
    """Whether this machine's server has balanced this model before (then its silos may
    have profiles: worth a query before round 1)."""
    folder = profile_cache_dir()
    if folder is None:
        return False
    path = folder / SEEN_FILE
    then = "round 1 runs at every silo's B0, and the file is written anew after it"
    try:
        return model in read_json_object(path, max_bytes=MAX_KEPT_BYTES)
    except FileNotFoundError:
        return False
    except StoredFileError as error:
        set_aside_damaged(path, error.reason, then)
        return False
    except OSError as error:
        log.warning("could not read %s (%s): %s", path, _reason(error), then)
        return False


def remember_model(model: str) -> None:
    store_entry(SEEN_FILE, model, time.time(), "note the model")


def store_entry(name: str, key: str, value: Any, what: str) -> None:
    """Set `key` to `value` in the JSON object of the profiles' folder's file `name`
    (a damaged file is set aside, said, and written anew); a failure is said ("could
    not `what` in FOLDER"), never raised: what is kept there only saves time."""
    folder = profile_cache_dir()
    if folder is None:
        return
    path = folder / name
    try:
        kept = read_json_object(path, max_bytes=MAX_KEPT_BYTES)
    except FileNotFoundError:
        kept = {}
    except StoredFileError as error:
        set_aside_damaged(path, error.reason, "written anew")
        kept = {}
    except OSError as error:  # unreadable, perhaps not unwritable: never written over
        log.warning("could not %s in %s: %s", what, folder, _reason(error))
        return
    kept[key] = value
    try:
        write_json_file(path, kept)
    except OSError as error:
        log.warning("could not %s in %s: %s", what, folder, error)


def ask_profiles(
    grid: Grid, nodes: Sequence[int], model: str, timeout: float = QUERY_TIMEOUT_S
) -> dict[int, tuple[SiloProfile, int | None]]:
    """Each node's stored profile for `model` (nodes without one, or that do not answer
    within `timeout` s, are left out)."""
    messages = [
        # a train message without a model: Flower runs mods only around handlers an app
        # registered, and every balanced app has a train handler
        Message(profile_query(model), message_type=MessageType.TRAIN, dst_node_id=node)
        for node in nodes
    ]
    found: dict[int, tuple[SiloProfile, int | None]] = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        answer = read_profile(reply)
        if answer is not None:
            found[reply.metadata.src_node_id] = answer
    return found


def ask_partitions(
    grid: Grid, nodes: Sequence[int], model: str, timeout: float = QUERY_TIMEOUT_S
) -> dict[int, int]:
    """Each node's partition id, asked with the profile query (which every balanced
    silo answers before its app runs); nodes that do not say are left out."""
    messages = [
        Message(profile_query(model), message_type=MessageType.TRAIN, dst_node_id=node)
        for node in nodes
    ]
    found: dict[int, int] = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        if reply.has_error() or not reply.content.metric_records:
            continue
        said = numbers(dict(next(iter(reply.content.metric_records.values()))))
        partition = said.get(PROFILE_PARTITION)
        if partition is not None and partition.is_integer() and partition >= 0:
            found[reply.metadata.src_node_id] = int(partition)
    return found


def profile_report(profile: SiloProfile, partition: int | None) -> SiloReport:
    """A profile as the report of a round run at its B0 (what round 1 would have shown)."""
    return SiloReport(
        batch_size=profile.batch_size,
        local_steps=profile.local_steps,
        compute_s=profile.local_steps * profile.batch_size / profile.speed,
        overhead_s=profile.overhead_s,
        partition_id=partition,
    )


def stale(profile: SiloProfile, report: SiloReport) -> float | None:
    """The measured speed's ratio to the profile's where it is off by more than STALE."""
    speed = report.samples_per_s()
    if speed is None:
        return None
    ratio = speed / profile.speed
    return ratio if abs(ratio - 1.0) > STALE else None
