"""Per-round records of a federated run: a rich table on the console, JSON lines on disk."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeGuard

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.markup import escape
from rich.table import Table

from fedlb.balance import WorkerReport, ideal_round_time

from .identity import node_label
from .protocol import HE_S, TRAIN_LOSS_NAMES, SiloReport, first_number
from .run_files import RUN_FILES, json_kind, parse_json

# What a run writes to its out-dir (the checkpoint: checkpoint.py's RUN_FILES.checkpoint)
log = logging.getLogger("fedlb.flower")


@dataclass
class SiloRound:
    """One silo's round, in seconds it spent itself (framework time excluded)."""

    silo: str  # label: silo-<partition-id> when it reports one, else node-<id>
    node: int
    batch_size: int
    local_steps: int
    compute_s: float
    fixed_s: float  # (de)serialisation, encryption: the part that does not scale with B
    round_s: float  # compute + fixed: the silo's busy time this round
    idle_s: float  # how long it waited for the slowest silo
    train_loss: float
    num_examples: int
    emulated_speed: float  # samples/s it was emulating (0: real hardware speed)
    next_batch_size: int
    accuracy: float | None = None  # federated evaluation on its held-out split
    loss: float | None = None
    he_s: float = 0.0  # of fixed_s: CKKS decryption, encryption and serialisation
    update_norm: float | None = None  # ||w_i − w|| as the silo reported it
    start_s: float | None = None  # its ClientApp's start-up before training (its clock)
    wall_s: float | None = None  # the server's wall clock: train message pushed -> reply in


@dataclass
class RoundRecord:
    """A round: its silos, how balanced it was, and what the model reached."""

    round: int
    clock: str  # "measured" or "measured (emulated speeds)"
    silos: list[SiloRound]
    round_s: float | None  # the slowest silo's busy time: what every silo waits for
    ideal_s: float | None  # T*: the best split of X for the speeds measured this round
    efficiency: float | None  # E = T* / round_s (None: no usable report this round)
    idle_fraction: float | None
    wall_s: float  # wall-clock of the training phase, framework included
    eval_wall_s: float | None = None  # wall-clock of the federated evaluation phase
    rejected: list[str] = field(default_factory=list)  # reports dropped, with reasons
    failed: list[str] = field(default_factory=list)  # silos with no usable reply
    events: list[str] = field(default_factory=list)  # silos that left, joined, should leave
    accuracy: float | None = None  # federated evaluation, weighted by test-set size
    loss: float | None = None
    server_accuracy: float | None = None  # centralised evaluation on the server's test set
    server_loss: float | None = None
    server_s: float | None = None  # the strategy's own seconds (not waiting for silos)
    balancer_s: float | None = None  # of server_s: the balancer's step (estimators, tuner)
    server_rss_mb: float | None = None  # the server process's resident memory at round end

    @property
    def total_wall_s(self) -> float:
        """The round's whole wall time: its training phase and its evaluation phase."""
        return self.wall_s + (self.eval_wall_s or 0.0)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """`console.print(record)`: the round's table, then why silos sent nothing usable,
        reports dropped, and membership events (silos that left, joined, should leave)."""
        yield render_round(self)
        for line in self.failed:
            yield f"  [red]no update:[/] {escape(line)}"
        for reason in self.rejected:
            yield f"  [yellow]report dropped:[/] {escape(reason)}"
        for event in self.events:
            yield f"  [cyan]{escape(event)}[/]"

    def json_lines(self) -> list[str]:
        """One line per silo, each with the round's fields too (easy to load as a table);
        the silo's own accuracy and loss are silo_accuracy and silo_loss, and
        round_silos says how many lines the round has."""
        base = {k: _clean(v) for k, v in asdict(self).items() if k != "silos"}
        base["round_silos"] = len(self.silos)
        if not self.silos:  # no update: the round is still on record, with why
            return [json.dumps(base, allow_nan=False)]
        return [
            json.dumps(
                {
                    **base,
                    **{f"silo_{k}" if k in base else k: _clean(v) for k, v in asdict(s).items()},
                },
                allow_nan=False,
            )
            for s in self.silos
        ]


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
        values[name] = value
    return values


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


def record_to_dict(record: RoundRecord) -> dict[str, Any]:
    """A record as plain data (NaN kept: for fedlb's own files, not for JSON lines)."""
    return asdict(record)


def record_from_dict(values: dict[str, Any]) -> RoundRecord:
    """The inverse of `record_to_dict`."""
    silos = [SiloRound(**silo) for silo in values["silos"]]
    return RoundRecord(**{**{k: v for k, v in values.items() if k != "silos"}, "silos": silos})


def _clean(value: Any) -> Any:
    """NaN (a silo that did not report) becomes null: JSON has no NaN."""
    return None if isinstance(value, float) and math.isnan(value) else value


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}"


def render_round(record: RoundRecord) -> Table:
    """The per-round table, in seconds: silo, B, τ, compute, fixed, busy (compute + fixed),
    idle, start (its ClientApp's start-up), wall (push to reply on the server's clock), next
    B, accuracy; the title has the round's busy time, ideal, E and wall time."""
    idle = "–" if record.idle_fraction is None else f"{record.idle_fraction:.0%}"
    title = (
        f"round {record.round} — clock: {record.clock} — round {_fmt(record.round_s, 2)} s "
        f"(ideal {_fmt(record.ideal_s, 2)} s), E = {_fmt(record.efficiency)}, idle {idle}, "
        f"wall {record.wall_s:.1f} s"
    )
    if record.eval_wall_s is not None:
        title += f" (+{record.eval_wall_s:.1f} s evaluating)"
    if record.accuracy is not None:
        title += f", accuracy {record.accuracy:.3f}"
    if record.server_accuracy is not None:
        title += f" (server {record.server_accuracy:.3f})"
    table = Table(
        title=title + " — silos in seconds:",
        title_justify="left",
        box=box.SIMPLE_HEAD,  # light borders: eleven columns fit an 80-column terminal
        pad_edge=False,
    )
    # seconds, except B, τ and acc; narrow enough for an 80-column terminal
    columns = ("silo", "B", "τ", "compute", "fixed", "busy", "idle", "start", "wall")
    for name in (*columns, "next", "acc"):  # next: B next round
        table.add_column(name, justify="left" if name == "silo" else "right", min_width=len(name))
    for s in record.silos:
        table.add_row(
            s.silo,
            str(s.batch_size),
            str(s.local_steps),
            _fmt(s.compute_s, 2),
            _fmt(s.fixed_s, 2),
            _fmt(s.round_s, 2),
            _fmt(s.idle_s, 2),
            _fmt(s.start_s, 2),
            _fmt(s.wall_s, 2),
            str(s.next_batch_size),
            _fmt(s.accuracy),
        )
    for name in record.failed:
        table.add_row(f"[red]{name}[/]", "–", "–", "no reply", *[""] * 8)
    return table


@dataclass
class RoundLines:
    """rounds.jsonl as read: its whole lines, and a last line cut short."""

    path: Path
    rows: list[tuple[int, dict[str, Any], str]]  # (line number, its JSON, its text)
    torn: int | None = None  # the number of a last line cut short (None: none)
    torn_round: int | None = None  # the round that line belonged to


def read_round_lines(path: Path) -> RoundLines:
    """The lines of a run's rounds.jsonl (no file: none). A last line that is no record was
    cut short (the server stopped while writing it): it is reported, not returned; a line
    before the last that is no record is a RecordsError naming it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return RoundLines(path, [])
    numbered = [(n, raw) for n, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]
    read = RoundLines(path, [])
    for index, (number, raw) in enumerate(numbered):
        try:
            row = parse_round_line(raw)
        except ValueError as error:
            if index < len(numbered) - 1:
                raise RecordsError(_damaged(path, number, str(error))) from None
            read.torn, read.torn_round = number, _torn_round(raw, read)
            break
        read.rows.append((number, row, raw.decode().strip()))
    return read


def _torn_round(raw: bytes, read: RoundLines) -> int:
    """The round a line cut short belonged to: the number it starts with (a record's first
    field), else the last whole line's round if its lines are not all there, else the next."""
    match = re.match(rb'\s*\{\s*"round"\s*:\s*(\d+)\s*[,}]', raw)
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
    elsewhere, or a kept line that is no record, is a RecordsError naming it. Reads only."""
    read = read_round_lines(path)
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
        done, num_rounds: with keep_before, the checkpoint's round and the rounds the
            resumed run goes to: the line that says what was dropped also says which
            rounds are run again (`resume_round_lines`). A damaged line is a RecordsError
            naming it, and then nothing is written.
    """

    def __init__(
        self,
        out_dir: Path | str | None = None,
        console: Console | None = None,
        keep_before: int | None = None,
        *,
        done: int | None = None,
        num_rounds: int | None = None,
    ) -> None:
        self.out_dir = Path(out_dir) if out_dir else None
        self.console = console
        self.records: list[RoundRecord] = []
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
        if self.console is not None:
            self.console.print(record)

    def summary(self) -> dict[str, Any]:
        return summarise_rounds(self.records)


# Round 1 is uniform (nothing measured yet) and round 2 the first balanced one: the
# balance a run settles at is judged from round 3 on.
STEADY_FROM_ROUND = 3


def accuracy_of(record: RoundRecord) -> float | None:
    """A round's accuracy: the server's on its test set where it has one, else the silos'
    federated evaluation."""
    value = record.server_accuracy if record.server_accuracy is not None else record.accuracy
    return None if value is None else float(value)


def summarise_rounds(records: list[RoundRecord]) -> dict[str, Any]:
    """What a run's rounds add up to: the figures of every summary.json (a server's run,
    an experiment's policies)."""
    accuracies = [a for a in map(accuracy_of, records) if a is not None]
    federated = [r.accuracy for r in records if r.accuracy is not None]
    # each silo's own accuracy counted once, whatever its test set's size (FLamby's
    # "average over centres")
    per_silo = [
        statistics.fmean(own)
        for r in records
        if (own := [s.accuracy for s in r.silos if s.accuracy is not None])
    ]
    return {
        "clock": records[0].clock if records else None,
        "rounds": len(records),
        "mean_balance_efficiency": _mean([r.efficiency for r in records]),
        "steady_balance_efficiency": _mean(
            [r.efficiency for r in records if r.round >= STEADY_FROM_ROUND]
        ),
        "idle_fraction": _mean([r.idle_fraction for r in records]),
        "final_accuracy": accuracies[-1] if accuracies else None,
        "best_accuracy": max(accuracies) if accuracies else None,
        "final_federated_accuracy": federated[-1] if federated else None,
        "final_mean_silo_accuracy": per_silo[-1] if per_silo else None,
    }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def round_record(
    server_round: int,
    reports: dict[int, WorkerReport],
    silo_reports: dict[int, SiloReport],
    app_metrics: dict[int, dict[str, float]],
    labels: dict[int, str],
    next_sizes: dict[int, int],
    sent: dict[int, tuple[int | None, int | None]],
    wall_s: float,
    weighted_by_key: str,
    replied_s: Mapping[int, float] | None = None,
) -> RoundRecord:
    """A train round's record: every replying silo's sizes and seconds, the slowest busy
    time, the ideal T* for the speeds measured, E and the idle share.

    `reports` are the balancer's (only reports it accepted), `silo_reports` what each silo
    said it ran, `app_metrics` the app's own numbers per node (train loss, weight),
    `replied_s` each node's reply's arrival, in seconds after the round's push."""
    busy = {n: r.round_s for n, r in reports.items()}
    slowest = max(busy.values()) if busy else math.nan
    ideal = efficiency = idle = math.nan
    if reports:
        ideal = ideal_round_time(
            {str(n): r.speed for n, r in reports.items()},
            sum(r.batch_size for r in reports.values()),
            {str(n): r.iterations for n, r in reports.items()},
            {str(n): r.overhead_s for n, r in reports.items()},
        )
        efficiency = ideal / slowest
        idle = 1.0 - sum(busy.values()) / (len(busy) * slowest)
    said = list(silo_reports.values())
    clock = (
        "model"
        if any(s.model_clock for s in said)
        else "measured (emulated speeds)"
        if any(s.emulated_speed > 0 for s in said)
        else "measured"
    )
    silos = []
    for node, metrics in sorted(app_metrics.items(), key=lambda kv: labels.get(kv[0], "")):
        report = reports.get(node)
        said_by = silo_reports.get(node)
        loss = first_number(metrics, TRAIN_LOSS_NAMES)
        silos.append(
            SiloRound(
                silo=labels.get(node, node_label(node)),
                node=node,
                batch_size=said_by.batch_size if said_by else sent.get(node, (0, 0))[0] or 0,
                local_steps=said_by.local_steps if said_by else sent.get(node, (0, 0))[1] or 0,
                compute_s=report.compute_s if report else math.nan,
                fixed_s=report.overhead_s if report else math.nan,
                round_s=busy.get(node, math.nan),
                idle_s=slowest - busy[node] if node in busy else math.nan,
                train_loss=math.nan if loss is None else loss,
                num_examples=int(metrics.get(weighted_by_key, 0)),
                emulated_speed=said_by.emulated_speed if said_by else 0.0,
                next_batch_size=next_sizes.get(node, 0),
                he_s=metrics.get(HE_S, 0.0),
                update_norm=said_by.update_norm if said_by else None,
                start_s=said_by.start_s if said_by else None,
                wall_s=(replied_s or {}).get(node),
            )
        )
    return RoundRecord(
        round=server_round,
        clock=clock,
        silos=silos,
        round_s=_none_if_nan(slowest),
        ideal_s=_none_if_nan(ideal),
        efficiency=_none_if_nan(efficiency),
        idle_fraction=_none_if_nan(idle),
        wall_s=wall_s,
    )


def balance_line(record: RoundRecord) -> str:
    """The round in one log line: per silo B (and next), τ, compute + fixed seconds; the
    round and ideal time, E, idle."""
    sizes = ", ".join(
        f"{s.silo} B={s.batch_size}→{s.next_batch_size} τ={s.local_steps} "
        f"({_fmt(s.compute_s, 2)}+{_fmt(s.fixed_s, 2)} s)"
        for s in record.silos
    )
    idle = "–" if record.idle_fraction is None else f"{record.idle_fraction:.0%}"
    return (
        f"round {record.round} balance [{record.clock}]: {sizes or 'no reports'}; round "
        f"{_fmt(record.round_s, 2)} s (ideal {_fmt(record.ideal_s, 2)} s), "
        f"E = {_fmt(record.efficiency)}, idle {idle}"
    )


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


def middle_rounds(records: list[RoundRecord]) -> list[RoundRecord]:
    """Rounds 2..N-1 (else all): round 1 also pays the silos' first start, the last the
    final model's evaluation; what a run's typical round costs is in between."""
    return [r for r in records if 1 < r.round < records[-1].round] or records


def wall_to(records: list[RoundRecord], target: float) -> float | None:
    """Wall seconds from round 1's push to the end of the first round whose model reached
    `target` accuracy (`accuracy_of`); None if none did."""
    spent = 0.0
    for record in records:
        spent += record.total_wall_s
        accuracy = accuracy_of(record)
        if accuracy is not None and accuracy >= target:
            return spent
    return None


def compare_runs(runs: Mapping[str, list[RoundRecord]]) -> Table:
    """Runs of the same federation side by side on the wall clock: the median round wall
    (rounds 2..N-1, else all), the whole run's wall, the final accuracy, and the wall time
    to the accuracy all of them reached (the lowest of their best)."""
    ran = [rs for rs in runs.values() if rs]
    bests = [max(a) for rs in ran if (a := [x for x in map(accuracy_of, rs) if x is not None])]
    target = min(bests) if bests and len(bests) == len(ran) else None
    first = next(iter(runs.values()))
    title = (
        "side by side — clock: wall (the ServerApp's), seconds — the same accuracy: "
        + (f"{target:.3f}" if target is not None else "– (a run has none)")
        + "; sooner: than the first run"
    )
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    columns = ("run", "rounds", "round wall", "slowest busy", "run wall", "acc")
    for name in (*columns, "to that acc", "sooner"):
        table.add_column(name, justify="left" if name == "run" else "right")
    reached_first = wall_to(first, target) if target is not None else None
    for name, records in runs.items():
        if not records:
            table.add_row(name, "0", *["–"] * 6)
            continue
        middle = middle_rounds(records)
        reached = wall_to(records, target) if target is not None else None
        final = accuracy_of(records[-1])
        speedup = (
            f"{reached_first / reached:.2f}x"
            if reached and reached_first and records is not first
            else "–"
        )
        table.add_row(
            name,
            str(len(records)),
            _fmt(statistics.median(r.total_wall_s for r in middle), 1),
            _fmt(statistics.median(r.round_s or 0.0 for r in middle), 1),
            _fmt(sum(r.total_wall_s for r in records), 1),
            _fmt(final),
            _fmt(reached, 1),
            speedup,
        )
    return table
