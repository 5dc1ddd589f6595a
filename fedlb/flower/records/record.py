"""Per-round records of a federated run: a rich table on the console, JSON lines on disk."""

from __future__ import annotations

import itertools
import json
import logging
import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table

from fedlb._markup import plain
from fedlb.balance import StepCurve, WorkerReport, ideal_round_time
from fedlb.training import step_curve

from ..identity import node_label
from ..protocol import HE_S, TRAIN_LOSS_NAMES, SiloReport, first_number

# What a run writes to its out-dir (the checkpoint: checkpoint.py's RUN_FILES.checkpoint)
log = logging.getLogger("fedlb.flower")


@dataclass
class SiloRound:
    """One silo's round, in seconds it spent itself (framework time excluded)."""

    silo: str  # label: silo-<partition-id> when it reports one, else node-<id>
    node: int  # its Flower node id (new each time its SuperNode joins)
    batch_size: int  # B it ran this round (0: none reported)
    local_steps: int  # τ it ran this round
    compute_s: float  # seconds of its local steps: the part that scales with B
    fixed_s: float  # (de)serialisation, encryption: the part that does not scale with B
    round_s: float  # compute + fixed: the silo's busy time this round
    idle_s: float  # how long it waited for the slowest silo
    train_loss: float  # the app's training loss metric (NaN: none reported)
    num_examples: int  # its weight in the average: its pinned example count (claims.py)
    emulated_speed: float  # samples/s it was emulating (0: real hardware speed)
    next_batch_size: int  # B the balancer gives it next round
    accuracy: float | None = None  # federated evaluation on its held-out split
    loss: float | None = None  # its evaluation loss
    he_s: float = 0.0  # of fixed_s: CKKS decryption, encryption and serialisation
    update_norm: float | None = None  # ||w_i − w|| as the silo reported it
    start_s: float | None = None  # its ClientApp's start-up before training (its clock)
    wall_s: float | None = None  # the server's wall clock: train message pushed -> reply in
    emulated_curve: str = ""  # the step-time curve it emulated ('' : none)


@dataclass
class RoundRecord:
    """A round: its silos, how balanced it was, and what the model reached."""

    round: int  # the run's round number (a resumed run goes on counting)
    # "measured", "measured (emulated speeds)", "model"; with step-time curves, which:
    # "model (curves: silo-0 h200/cnn, silo-1 cpu1/cnn)"
    clock: str
    silos: list[SiloRound]  # one per silo whose update and report the round used
    round_s: float | None  # the slowest silo's busy time: what every silo waits for
    ideal_s: float | None  # T*: the best split of X for the speeds measured this round
    efficiency: float | None  # E = T* / round_s (None: no usable report this round)
    idle_fraction: float | None  # 1 − Σ busy / (silos × the slowest busy): time spent waiting
    wall_s: float  # wall-clock of the training phase, framework included
    eval_wall_s: float | None = None  # wall-clock of the federated evaluation phase
    rejected: list[str] = field(default_factory=list)  # reports dropped, with reasons
    failed: list[str] = field(default_factory=list)  # silos with no usable reply
    events: list[str] = field(default_factory=list)  # silos that left, joined, should leave
    accuracy: float | None = None  # federated evaluation, weighted by test-set size
    loss: float | None = None  # the same evaluation's loss
    server_accuracy: float | None = None  # centralised evaluation on the server's test set
    server_loss: float | None = None  # the same evaluation's loss
    server_s: float | None = None  # the strategy's own seconds (not waiting for silos)
    balancer_s: float | None = None  # of server_s: the balancer's step (estimators, tuner)
    server_rss_mb: float | None = None  # the server process's resident memory at round end
    # the stability guard after this round (None: no guard): the run's regime (undecided,
    # stable, edge, fixed), the floor (share of the mean batch) and, in the round that
    # decided the regime, the probe's dispersion
    guard: str | None = None
    guard_floor: float | None = None
    guard_probe: float | None = None
    # the look's or the probe's round: the silos' steps' growth since equal sizes; a round
    # of a stable verdict's trial: their steps over the round before's
    guard_growth: float | None = None
    # the noise exponent w the probe was read at (a quiet probe; None: as measured)
    guard_noise_exponent: float | None = None
    # in a run's round 1: the last run's verdict on this app that the guard took up
    # instead of probing (fedlb.flower.verdicts), in words
    guard_remembered: str | None = None

    @property
    def total_wall_s(self) -> float:
        """The round's whole wall time: its training phase and its evaluation phase."""
        return self.wall_s + (self.eval_wall_s or 0.0)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """`console.print(record)`: the round's table, then why silos sent nothing usable,
        reports dropped, and membership events (silos that left, joined, should leave)."""
        yield render_round(self)
        for line in self.failed:
            yield f"  [red]no update:[/] {plain(line)}"
        for reason in self.rejected:
            yield f"  [yellow]report dropped:[/] {plain(reason)}"
        for event in self.events:
            yield f"  [cyan]{plain(event)}[/]"

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
        # escaped whole: the clock names the curves silos said they emulated
        title=plain(title) + " — silos in seconds:",
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
            plain(s.silo),  # a cell is markup to rich: a label is the silo's to choose
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
    for reason in record.failed:  # the silo alone here (the reason, whole, follows)
        label = plain(reason.split(": ", 1)[0])
        table.add_row(f"[red]{label}[/]", "–", "–", "no update", *[""] * (len(columns) - 2))
    return table


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
        "stability": stability_of(records),
        # uniform sizes' E at the speeds each round measured: FedAvg's, for comparison
        "uniform_balance_efficiency": _mean(
            [uniform_efficiency(r) for r in records if r.round >= STEADY_FROM_ROUND]
        ),
    }


def uniform_efficiency(record: RoundRecord) -> float | None:
    """E that uniform sizes (X/n each: FedAvg) would have had at the speeds and fixed
    costs this round measured (None: no usable measurement, or silos on step-time
    curves, whose speed at another B this round did not measure)."""
    silos = [
        s
        for s in record.silos
        if s.compute_s > 0 and math.isfinite(s.compute_s) and math.isfinite(s.fixed_s)
    ]
    if not silos or record.ideal_s is None or not math.isfinite(record.ideal_s):
        return None
    if any(s.emulated_curve for s in silos):
        return None
    mean_batch = sum(s.batch_size for s in silos) / len(silos)
    uniform = max(s.fixed_s + s.compute_s * mean_batch / s.batch_size for s in silos)
    return record.ideal_s / uniform if uniform > 0 else None


def stability_of(records: list[RoundRecord]) -> dict[str, Any] | None:
    """The stability guard's verdict on the run (None: no guard): its regime at the end,
    the round that decided it (the look's, the probe's, or the one confirming it), the
    round a stable verdict was overturned in on trial (None: it held, or was never
    stable), the dispersion the probe read (None where the look decided), the growth
    first read (the look's, or the probe's), and the final floor."""
    guarded = [r for r in records if r.guard is not None]
    if not guarded:
        return None
    # the last round that read a dispersion: the probe, or the round confirming it
    probe = next((r for r in reversed(guarded) if r.guard_probe is not None), None)
    decided = next((r for r in guarded if r.guard in ("stable", "edge")), None)
    remembered = next((r.guard_remembered for r in guarded if r.guard_remembered), None)
    overturned = next(
        (
            r.round
            for before, r in itertools.pairwise(guarded)
            if before.guard == "stable" and r.guard == "edge"
        ),
        None,
    )
    return {
        "regime": guarded[-1].guard,
        # none where the verdict was taken up from the last run (no round judged it)
        "decided_in_round": None if decided is None or remembered else decided.round,
        "overturned_in_round": overturned,
        "probe_dispersion": None if probe is None else probe.guard_probe,
        "probe_growth": next((r.guard_growth for r in guarded if r.guard_growth is not None), None),
        "probe_noise_exponent": None if probe is None else probe.guard_noise_exponent,
        "final_floor": guarded[-1].guard_floor,
        # the verdict taken up from the last run of this app (then no probe ran)
        "remembered": remembered,
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
    curves = _curves(silo_reports)
    if reports:
        ideal = ideal_round_time(
            {str(n): r.speed for n, r in reports.items()},
            sum(r.batch_size for r in reports.values()),
            {str(n): r.iterations for n, r in reports.items()},
            {str(n): r.overhead_s for n, r in reports.items()},
            # a silo on a curve: T* over its curve, not the speed read at this round's B
            curves={str(n): c for n, c in curves.items() if n in reports},
        )
        efficiency = ideal / slowest
        idle = 1.0 - sum(busy.values()) / (len(busy) * slowest)
    clock = clock_of(silo_reports, labels)
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
                emulated_curve=said_by.emulated_curve if said_by else "",
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


def _curves(silo_reports: Mapping[int, SiloReport]) -> dict[int, StepCurve]:
    """The step-time curves silos said they emulated, where fedlb ships them (a name it
    does not know, from another version or a tampered reply, leaves that silo linear)."""
    curves = {}
    for node, said in silo_reports.items():
        if said.emulated_curve:
            try:
                curves[node] = step_curve(said.emulated_curve)
            except ValueError:
                log.warning("a silo emulated a step-time curve this server does not know")
    return curves


def clock_of(silo_reports: Mapping[int, SiloReport], labels: Mapping[int, str]) -> str:
    """The round's clock as its silos said: "model" (any on the model clock), "measured
    (emulated speeds)", "measured"; with the step-time curves they emulated, which:
    "measured (curves: silo-0 h200/cnn*20, silo-1 cpu1/cnn*20)"."""
    said = list(silo_reports.values())
    clock = "model" if any(s.model_clock for s in said) else "measured"
    what = []
    if clock == "measured" and any(s.emulated_speed > 0 for s in said):
        what.append("emulated speeds")
    curves = sorted(
        (labels.get(node, node_label(node)), s.emulated_curve)
        for node, s in silo_reports.items()
        if s.emulated_curve
    )
    if curves:
        what.append("curves: " + ", ".join(f"{label} {curve}" for label, curve in curves))
    return f"{clock} ({'; '.join(what)})" if what else clock


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
            table.add_row(plain(name), "0", *["–"] * 6)
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
            plain(name),  # a run's folder, as the operator named it
            str(len(records)),
            _fmt(statistics.median(r.total_wall_s for r in middle), 1),
            _fmt(statistics.median(r.round_s or 0.0 for r in middle), 1),
            _fmt(sum(r.total_wall_s for r in records), 1),
            _fmt(final),
            _fmt(reached, 1),
            speedup,
        )
    return table
