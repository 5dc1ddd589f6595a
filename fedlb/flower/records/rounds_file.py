"""rounds.jsonl, the one reader: a run's round records read back (a resumed run, an
experiment's results, the live watcher), each damaged line named with what to do, and a
resumed run's lines kept, dropped or said incomplete by its checkpoint's round; and
`RoundReporter`, which writes them."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeGuard

from rich.console import Console

from fedlb.security import StoredFileError, read_lines

from .files import RUN_FILES, json_kind, parse_json
from .record import RoundRecord, SiloRound, summarise_rounds
from .tensorboard import EXTRA, RoundScalars, tensorboard_installed

log = logging.getLogger("fedlb.flower")


class RecordsError(ValueError):
    """A line of rounds.jsonl fedlb cannot read: the message names the file, the line and
    what to do."""


def records_from_json_lines(
    lines: list[str], complete_only: bool = False, *, source: Path | str | None = None
) -> list[RoundRecord]:
    """Rebuild RoundRecords from `rounds.jsonl` lines (one line per silo and round);
    with complete_only, rounds whose lines have not all arrived are left out. A line that
    is no round record is a RecordsError naming it: as `source`'s line (when the lines
    are that file's, in order), else by its place among `lines`."""
    rows = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                rows.append((number, parse_round_line(line)))
            except ValueError as error:
                raise RecordsError(_damaged(source, number, str(error))) from None
    return _records(rows, source, complete_only)


def parse_round_line(line: str | bytes) -> dict[str, Any]:
    """One line of rounds.jsonl as a JSON object with a round number (ValueError: why it
    is not one). Its other fields are checked when a record is built from it."""
    row = parse_json(line)
    if not isinstance(row, dict):
        raise ValueError(f"{json_kind(row)}, not an object")
    number = row.get("round")
    if "round" not in row:
        raise ValueError("no round")
    if not _is_int(number) or number < 1:
        raise ValueError(f"round is {_shown(number)}, not a round number")
    silos = row.get("round_silos")
    if silos is not None and (not _is_int(silos) or silos < 0):
        raise ValueError(f"round_silos is {_shown(silos)}, not a count of silos")
    return row


def _records(
    rows: list[tuple[int, dict[str, Any]]], source: Path | str | None, complete_only: bool = False
) -> list[RoundRecord]:
    """RoundRecords from parsed lines (numbered as in `source`); a line whose fields do not
    make a record is a RecordsError naming it."""
    silo_fields = {f.name: f for f in fields(SiloRound)}
    round_fields = {f.name: f for f in fields(RoundRecord) if f.name != "silos"}
    rounds: dict[int, RoundRecord] = {}
    expected: dict[int, int | None] = {}
    for number, row in rows:
        try:
            round_number = row["round"]
            expected[round_number] = row.get("round_silos")
            round_values = _values(row, round_fields, "")  # each line has them all
            if round_number not in rounds:
                rounds[round_number] = RoundRecord(silos=[], **round_values)
            if expected[round_number] == 0:
                continue  # a round without updates: its one line has no silo
            # a silo's field named like a round's is written silo_<name>
            silo = _values(row, silo_fields, "silo_", frozenset(round_fields))
            rounds[round_number].silos.append(SiloRound(**silo))
        except ValueError as error:
            raise RecordsError(_damaged(source, number, str(error))) from None
    return [
        rounds[k]
        for k in sorted(rounds)
        if not complete_only or expected[k] in (None, len(rounds[k].silos))
    ]


def _values(
    row: Mapping[str, Any],
    wanted: Mapping[str, Any],
    prefix: str,
    prefixed: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The dataclass fields `wanted` from a line, each checked against its type (ValueError:
    one missing or of another type). A field written under `prefix` (always for names in
    `prefixed`) is read there; null where a number belongs was NaN; a field added since the
    file was written (it has a default) takes its default."""
    values: dict[str, Any] = {}
    for name, spec in wanted.items():
        key = f"{prefix}{name}" if name in prefixed or f"{prefix}{name}" in row else name
        if key not in row:
            if spec.default is MISSING and spec.default_factory is MISSING:
                raise ValueError(f"no {key}")
            continue
        value, kind = row[key], str(spec.type)
        optional = kind.endswith("| None")
        kind = kind.removesuffix("| None").strip()
        if value is None and not optional and kind == "float":
            value = math.nan  # a silo that did not report
        elif value is None and optional:
            pass
        elif not _of_type(value, kind):
            raise ValueError(f"{key} is {_shown(value)}, not {_KINDS.get(kind, kind)}")
        elif (why := _out_of_bounds(name, value)) is not None:
            raise ValueError(f"{key} is {_shown(value)}, {why}")
        values[name] = value
    return values


# What a record's numbers can be (a line outside them was not written by fedlb). A size
# or step count of 0 is what a record says of a silo that was sent and said none.
_SECONDS = (0.0, 1e9)  # 30 years
BOUNDS: dict[str, tuple[float, float]] = {
    **dict.fromkeys(("batch_size", "local_steps", "next_batch_size"), (0, 2**40)),
    **dict.fromkeys(("node", "num_examples"), (0, 2**64)),  # Flower's node ids: uint64
    **dict.fromkeys(
        ("compute_s", "fixed_s", "round_s", "idle_s", "he_s", "start_s", "wall_s"), _SECONDS
    ),
    **dict.fromkeys(("ideal_s", "eval_wall_s", "server_s", "balancer_s"), _SECONDS),
    "emulated_speed": (0.0, 1e15),
    "update_norm": (0.0, math.inf),
    "server_rss_mb": (0.0, 1e9),
    "efficiency": (0.0, math.inf),
    "idle_fraction": (0.0, 1.0),
    "guard_floor": (0.0, math.inf),
}


def _out_of_bounds(name: str, value: Any) -> str | None:
    """Why a field's number is not one fedlb writes (None: it is, or it is no number)."""
    if name not in BOUNDS or value is None or value != value:  # NaN: a silo that did not report
        return None
    low, high = BOUNDS[name]
    if value < low:
        return f"below {low:g}"
    return f"above {high:g}" if value > high else None


_KINDS = {"float": "a number", "int": "a whole number", "str": "text", "list[str]": "a list"}


def _of_type(value: Any, kind: str) -> bool:
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        return _is_int(value)
    if kind == "str":
        return isinstance(value, str)
    if kind == "list[str]":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return True


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value for a message: short (a damaged file may hold anything)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _damaged(source: Path | str | None, number: int, why: str, fix: str = "") -> str:
    """A damaged line's one line: the file and line (`source` None: the line's place
    among those read), what is wrong, what to do."""
    where = f"{source} line {number}" if source else f"line {number} of the {RUN_FILES.rounds} read"
    lost = "that silo's part of its round's record is then lost"
    fix = fix or (f"delete line {number} ({lost})" if source else f"delete that line ({lost})")
    return (
        f"{where} is not a round record ({why}): the file is damaged; restore it from a "
        f"copy, or {fix}, and try again"
    )


@dataclass
class RoundLines:
    """rounds.jsonl as read: its whole lines, and a last line cut short."""

    path: Path
    rows: list[tuple[int, dict[str, Any], str]]  # (line number, its JSON, its text)
    torn: int | None = None  # the number of a last line cut short (None: none)
    torn_round: int | None = None  # the round that line belonged to
    torn_named: bool = False  # whether that line says its round (else torn_round is a guess)


def read_round_lines(path: Path) -> RoundLines:
    """The lines of a run's rounds.jsonl (no file: none), read a line at a time within
    fedlb.security.stored's bounds. A last line cut short (the server stopped while
    writing it: no newline after it, and it begins as fedlb's lines do) is reported, not
    returned; any other line that is no record is a RecordsError naming it."""
    read = RoundLines(path, [])
    unread: tuple[int, bytes, str] | None = None  # no record: damage unless the last
    try:
        for number, raw in read_lines(path):
            if unread is not None:
                raise RecordsError(_damaged(path, unread[0], unread[2]))
            try:
                read.rows.append((number, parse_round_line(raw), raw.decode().strip()))
            except ValueError as error:
                unread = (number, raw, str(error))
    except FileNotFoundError:
        return read
    except StoredFileError as error:  # too large, or a line too long
        if error.line is not None:
            raise RecordsError(_damaged(path, error.line, error.reason)) from None
        raise RecordsError(
            f"{path} is not a run's rounds.jsonl ({error.reason}): restore it from a copy, "
            "and try again"
        ) from None
    if unread is not None:
        number, raw, why = unread
        if not _cut_short(raw):
            raise RecordsError(_damaged(path, number, why))
        read.torn, read.torn_round = number, _torn_round(raw, read)
        read.torn_named = _TORN_ROUND.match(raw) is not None
    return read


_LINE_START = b'{"round": '  # how every line fedlb writes begins (json.dumps, round first)


def _cut_short(raw: bytes) -> bool:
    """Whether a line that is no record can be one cut short as fedlb wrote it: each
    record's lines go out in one write, newline last, so a cut one has none."""
    return not raw.endswith(b"\n") and (raw.startswith(_LINE_START) or _LINE_START.startswith(raw))


_TORN_ROUND = re.compile(rb'\s*\{\s*"round"\s*:\s*(\d{1,18})\s*[,}]')


def _torn_round(raw: bytes, read: RoundLines) -> int:
    """The round a line cut short belonged to: the number it starts with (a record's first
    field), else the last whole line's round if its lines are not all there, else the next."""
    match = _TORN_ROUND.match(raw)
    if match:
        return int(match.group(1))
    if not read.rows:
        return 1
    last = read.rows[-1][1]
    expected = last.get("round_silos")
    lines = sum(1 for _, row, _ in read.rows if row["round"] == last["round"])
    incomplete = expected is not None and lines < expected
    return int(last["round"]) if incomplete else int(last["round"]) + 1


@dataclass
class ResumedLines:
    """What a resumed run keeps of rounds.jsonl, and the line that says what it changes."""

    lines: list[str]  # the whole lines of the rounds before the first unpublished one
    records: list[RoundRecord]  # those lines' records
    note: str | None  # what was dropped or found short, what is run again; None: nothing
    incomplete: list[int] = field(default_factory=list)  # kept rounds short of lines
    missing: list[int] = field(default_factory=list)  # earlier rounds without a line

    def holds(self) -> str:
        """What rounds.jsonl holds once resumed, in a few words (as the run's story says)."""
        present = [r.round for r in self.records]
        if not present:
            return "rounds.jsonl holds none of them"
        said = f"rounds.jsonl holds {_rounds(present)}"
        if self.incomplete:
            said += f" ({_rounds(self.incomplete)} in part)"
        return said + (f", not {_rounds(self.missing)}" if self.missing else "")


def resume_round_lines(
    path: Path, keep_before: int, done: int | None = None, num_rounds: int | None = None
) -> ResumedLines:
    """rounds.jsonl of a run resumed from its checkpoint after round `done`, whose first
    unpublished round is `keep_before` (done, or done + 1), going on to `num_rounds`.

    Lines of rounds from keep_before on were written after the checkpoint: dropped (the
    rounds after `done` are run again; round `done`'s record, if among them, is written
    again from the checkpoint). A last line cut short is dropped with them when its round
    is one of those; when it is of an earlier round, that round is not run again (the
    checkpoint holds its model), so its record stays short of the lines it lost, and the
    note says so, as it says which earlier rounds have no line at all. A damaged line
    elsewhere, or a kept line that is no record, is a RecordsError naming it, as is a line
    that explains nothing: rounds out of order, or a round later than a stopped server
    can have written after its checkpoint (done + 1; keep_before + 1 where `done` is not
    given). Reads only."""
    read = read_round_lines(path)
    _check_order(read, (done if done is not None else keep_before) + 1)
    kept = [(n, row, text) for n, row, text in read.rows if row["round"] < keep_before]
    records = _records([(n, row) for n, row, _ in kept], path)
    counts: Counter[int] = Counter()
    expected: dict[int, int] = {}
    for number, row, _ in kept:
        counts[row["round"]] += 1
        if row.get("round_silos") is not None:
            expected[row["round"]] = row["round_silos"]
        if counts[row["round"]] > max(expected.get(row["round"], counts[row["round"]]), 1):
            round_, silos = row["round"], expected[row["round"]]
            why = f"a line more than round {round_}'s {silos} silos (its round_silos)"
            fix = f"delete the line of round {round_} that is there twice"
            raise RecordsError(_damaged(path, number, why, fix))
    after = Counter(row["round"] for _, row, _ in read.rows if row["round"] >= keep_before)
    rerun = set(after)
    if read.torn_round is not None and read.torn_round >= keep_before:
        rerun.add(read.torn_round)
    said: list[str] = []
    dropped = []
    if read.torn is not None:
        said.append(
            f"its last line (line {read.torn}, of round {read.torn_round}) is half-written: "
            "the server stopped while writing it"
        )
        dropped.append("it")
    if after:
        lines = sum(after.values())
        dropped.append(
            f"the {lines} line{'s' if lines > 1 else ''} of {_rounds(sorted(after))}"
            f"{' before it' if read.torn is not None else ''}, written after the checkpoint"
        )
    if dropped:
        said.append("dropped " + " and ".join(dropped))
    if done is None and rerun:  # where the checkpoint stands is not known here
        said.append(f"{_rounds(sorted(rerun))} {_is(sorted(rerun))} written again")
    if done is not None and done in rerun:
        said.append(f"round {done}'s record is written again from the checkpoint")
    if done is not None and (again := sorted(r for r in rerun if r > done)):
        said.append(f"{_rounds(again)} {_is(again)} run again")
    incomplete = [r for r in sorted(counts) if counts[r] < expected.get(r, 0)]
    for number in incomplete:
        said.append(
            f"round {number}'s record stays incomplete ({counts[number]} of "
            f"{expected[number]} silos' lines) and round {number} is not run again: the "
            "checkpoint includes it"
        )
    missing = sorted(set(range(1, keep_before)) - set(counts))
    if missing:
        one = len(missing) == 1
        said.append(
            f"{_rounds(missing)} {'has' if one else 'have'} no record in it and {_is(missing)} "
            f"not run again: the checkpoint includes {'it' if one else 'them'}"
        )
    note = None
    if said and done is not None:
        goes_on = f"the run goes on from its checkpoint after round {done}"
        if num_rounds is not None and num_rounds > done:
            goes_on += f" with {_rounds(list(range(done + 1, num_rounds + 1)))}"
        said.append(goes_on)
    if said:
        note = f"{path}: " + "; ".join(said)
    return ResumedLines([text for _, _, text in kept], records, note, incomplete, missing)


def _check_order(read: RoundLines, last: int) -> None:
    """A RecordsError naming the first line of `read` whose round comes before the line's
    above it (fedlb writes rounds in order, a resumed run appending after the rounds it
    kept), or is later than `last`: no stopped server wrote it, so no resume may drop
    it as written after its checkpoint, nor keep it."""
    above: tuple[int, int] | None = None  # (line, round) of the last line read
    # a line cut short counts where it says its round (else its round is a guess)
    lines: list[tuple[int, int]] = [(n, row["round"]) for n, row, _ in read.rows]
    if read.torn_named and read.torn is not None and read.torn_round is not None:
        lines.append((read.torn, read.torn_round))
    for number, round_ in lines:
        if above is not None and round_ < above[1]:
            raise RecordsError(
                f"{read.path} line {number} is of round {round_}, after line {above[0]} of "
                f"round {above[1]}: fedlb writes rounds in order, so one of the two is "
                "damaged; restore the file from a copy, or correct the wrong one, and try again"
            )
        if round_ > last:
            raise RecordsError(
                f"{read.path} line {number} is of round {round_}, later than any a stopped "
                f"server writes after its checkpoint (round {last} at most): the line is "
                "damaged; restore the file from a copy, or delete that line, and try again"
            )
        above = (number, round_)


def _rounds(numbers: list[int]) -> str:
    """[2] -> 'round 2'; [4, 5, 6] -> 'rounds 4-6'; [2, 5, 6] -> 'rounds 2, 5-6'."""
    spans: list[list[int]] = []
    for number in numbers:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"round {text}" if len(numbers) == 1 else f"rounds {text}"


def _is(numbers: list[int]) -> str:
    return "is" if len(numbers) == 1 else "are"


class RoundReporter:
    """Shows each finished round on a console and appends it to `out_dir/rounds.jsonl`.

    Args:
        out_dir: the run's output folder (created); None writes nothing.
        console: where tables go; None prints nothing (the records are still kept).
        keep_before: a resumed run's first unpublished round: the rounds before it in an
            existing rounds.jsonl are kept (and loaded into `records`), later ones (written
            after the checkpoint) dropped. Default None: rounds.jsonl starts empty.
        done: with keep_before, the checkpoint's round: the line that says what was
            dropped also says which rounds are run again (`resume_round_lines`). A
            damaged line is a RecordsError naming it, and then nothing is written.
        num_rounds: with keep_before, the rounds the resumed run goes to.
        tensorboard: also write each round's scalars as TensorBoard event files in
            `out_dir/tensorboard` (fedlb.flower.tensorboard); where the package is not
            installed, that is said once (INFO) and the run goes on without them.
    """

    def __init__(
        self,
        out_dir: Path | str | None = None,
        console: Console | None = None,
        keep_before: int | None = None,
        *,
        done: int | None = None,
        num_rounds: int | None = None,
        tensorboard: bool = False,
    ) -> None:
        self.out_dir = Path(out_dir) if out_dir else None
        self.console = console
        self.records: list[RoundRecord] = []
        self.scalars: RoundScalars | None = None
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / RUN_FILES.rounds
            kept: list[str] = []
            if keep_before is not None:
                resumed = resume_round_lines(path, keep_before, done, num_rounds)
                kept, self.records = resumed.lines, resumed.records
                if resumed.note is not None:
                    log.warning("%s", resumed.note)
            temporary = path.with_suffix(".tmp")
            temporary.write_text("".join(line + "\n" for line in kept))
            temporary.replace(path)
            if tensorboard and tensorboard_installed():
                first = keep_before if keep_before is not None else 1
                self.scalars = RoundScalars(self.out_dir / RUN_FILES.tensorboard, first)
            elif tensorboard:
                # on by default, an extra: its absence is a fact, not a fault
                log.info("no TensorBoard event files: tensorboard is not installed (%s)", EXTRA)

    @property
    def rounds_path(self) -> Path | None:
        return None if self.out_dir is None else self.out_dir / RUN_FILES.rounds

    def publish(self, record: RoundRecord) -> None:
        self.records.append(record)
        if self.rounds_path is not None:
            with self.rounds_path.open("a") as handle:
                handle.write("".join(line + "\n" for line in record.json_lines()))
                # on disk before the round's checkpoint is: a power cut cannot leave a
                # checkpoint after a round whose record was lost
                handle.flush()
                os.fsync(handle.fileno())
        if self.scalars is not None:
            self.scalars.write(record)
        if self.console is not None:
            self.console.print(record)

    def progress(self, server_round: int, sent: list[str], replied: dict[str, float]) -> None:
        """The round under way as its replies arrive (`replied`: silo -> seconds after the
        push), in `out_dir/round-progress.json`, replaced whole each time: what a live
        page shows before the round's record exists. A failed write loses only that."""
        if self.out_dir is None:
            return
        path = self.out_dir / RUN_FILES.progress
        temporary = path.with_suffix(".tmp")
        try:
            temporary.write_text(
                json.dumps(
                    {"round": server_round, "sent": sent, "replied": replied, "time": time.time()}
                )
            )
            temporary.replace(path)
        except OSError as error:
            log.debug("round progress not written: %s", error)

    def close(self) -> None:
        """Close the event files (rounds.jsonl is closed after every round)."""
        if self.scalars is not None:
            self.scalars.close()

    def summary(self) -> dict[str, Any]:
        return summarise_rounds(self.records)
