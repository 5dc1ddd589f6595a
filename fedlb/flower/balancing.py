"""The balancer's side of the strategy: the silos' reports read for it each round; its
start, from the silos' first reports or in round 1 from their stored speed profiles (checked
against round 1's measurement after it); and what the run's summary says of it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING

from flwr.app import ArrayRecord, Message
from flwr.common import log as flwr_log
from flwr.serverapp import Grid

from fedlb.balance import BatchSizeManager, StabilityGuard, WorkerReport

from .membership import Membership, say
from .options import Balancer
from .profiles import (
    SiloProfile,
    ask_profiles,
    model_key,
    profile_report,
    remember_model,
    seen_before,
    stale,
)
from .protocol import SiloReport, numbers, only_metrics
from .replies import ReportCheck

# each sampled silo's stored profile and the report it stands for
Found = dict[int, tuple[SiloProfile, SiloReport]]


@dataclass
class RoundReports:
    """What the kept replies of a round said, by node."""

    said: dict[int, SiloReport] = field(default_factory=dict)  # the reports that passed
    reports: dict[int, WorkerReport] = field(default_factory=dict)  # the balancer's view
    app_numbers: dict[int, dict[str, float]] = field(default_factory=dict)  # every number
    rejected: list[str] = field(default_factory=list)  # "silo: why its report was dropped"


def read_reports(
    server_round: int,
    kept: list[Message],
    check: ReportCheck,
    sent: Mapping[int, tuple[int | None, int | None]],
    members: Membership,
    load_report: Callable[[int, SiloReport], WorkerReport],
) -> RoundReports:
    """Each kept reply's report, checked against what its silo was `sent`; a report that
    fails is dropped (and said) while its update is still used."""
    read = RoundReports()
    for msg in kept:
        node = msg.metadata.src_node_id
        metrics = only_metrics(msg)
        read.app_numbers[node] = numbers(metrics)
        report, why = check.read(node, metrics, sent.get(node, (0, 0)))
        if report is None:
            say(
                WARNING,
                "round %d: report of node %d dropped (its update is used): %s",
                server_round,
                node,
                why,
            )
            read.rejected.append(f"{members.label(node)}: {why}")
            continue
        members.name(node, report.partition_id)
        read.said[node] = report
        read.reports[node] = load_report(node, report)
    return read


def describe_balancing(
    batch_size: int | None, local_steps: int | None, balancer: object, guard: StabilityGuard | None
) -> None:
    """The balancing lines of the summary Flower logs when a run starts."""
    flwr_log(INFO, "\t└──> Load balancing (fedlb):")
    flwr_log(
        INFO,
        "\t\t├── B0: %s | τ: %s",
        batch_size or "each silo's own loader batch size",
        local_steps or "each silo's own step count (kept from its first round)",
    )
    flwr_log(INFO, "\t\t├── Balancer: %s", getattr(balancer, "__name__", balancer))
    flwr_log(
        INFO,
        "\t\t└── Stability guard: %s",
        "off (full balance)"
        if guard is None
        else (
            "round 2 at every silo's own batch size, the slow silos' steps cut (a look at "
            "the app's own growth), then "
            if guard.looking
            else ""
        )
        + f"no silo below {guard.floors[guard.level]:.0%} of the mean batch; blow-ups left out",
    )


def start_manager(
    balancer: Balancer,
    members: Membership,
    said: Mapping[int, SiloReport],
    initial_load: Callable[[SiloReport], int],
) -> tuple[BatchSizeManager, float]:
    """(the balancer made from the silos' first reports, the floor the user set on its
    tuner: the least the stability guard keeps)."""
    initial = {str(n): initial_load(r) for n, r in sorted(said.items())}
    manager = members.start_balancing(balancer, initial, said)
    return manager, float(getattr(manager.tuner, "min_share", 0.0))


class StoredProfiles:
    """Round 1 balanced from the silos' stored speed profiles, when this server has
    balanced the model before and every sampled silo has one; after round 1, the profiles
    the measurement contradicts are named."""

    def __init__(self) -> None:
        self.model: str | None = None  # the model's layout: what a profile is kept under
        self._used: dict[int, SiloProfile] = {}  # round 1's profiles, checked after it

    def ask(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        nodes: list[int],
        encrypted: bool,
        members: Membership,
    ) -> Found | None:
        """The sampled silos' stored profiles as their first reports (the silos named by
        them), or None where round 1 runs at every silo's B0."""
        model = self.layout(arrays, encrypted)
        if model is None or not seen_before(model):
            return None
        found = ask_profiles(grid, nodes, model)
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
            return None
        said = {n: (p, profile_report(p, partition)) for n, (p, partition) in found.items()}
        for node, (_, report) in said.items():
            members.name(node, report.partition_id)
        return said

    def layout(self, arrays: ArrayRecord, encrypted: bool) -> str | None:
        """The model's layout, what profiles are kept under (None: only a ciphertext
        seen, which has no plaintext layout)."""
        if self.model is None and not encrypted:
            self.model = model_key(arrays)
        return self.model

    def replay(
        self,
        manager: BatchSizeManager,
        found: Found,
        load_report: Callable[[int, SiloReport], WorkerReport],
    ) -> None:
        """Feed the profiles to the balancer as the rounds they were measured over."""
        # a profile is the mean of its rounds: as many reports (a single one would leave
        # silos within the tuner's noise prior pooled)
        for repeat in range(max(p.rounds for p, _ in found.values())):
            manager.step([load_report(n, r) for n, (p, r) in found.items() if p.rounds > repeat])
        self._used = {n: p for n, (p, _) in found.items()}

    def say_used(self, label: Callable[[int], str], sizes: dict[str, int]) -> None:
        say(
            INFO,
            "round 1 balanced from the silos' stored speed profiles (%s): sizes %s",
            ", ".join(
                f"{label(n)} {p.speed:.0f} samples/s, {p.age_s / 3600:.1f} h old"
                for n, p in sorted(self._used.items())
            ),
            sizes,
        )

    def check(
        self,
        said: Mapping[int, SiloReport],
        label: Callable[[int], str],
        keep: bool,
        note: Callable[[str], None] | None = None,
    ) -> None:
        """After round 1: say which stored profiles the measurement contradicts (the
        estimator follows the measurement from here, as after any change of speed), also
        to `note` (the round record's events); with `keep`, remember that this server
        balanced the model."""
        for node, profile in self._used.items():
            report = said.get(node)
            ratio = stale(profile, report) if report is not None else None
            if ratio is not None:
                text = (
                    f"{label(node)}'s stored speed profile was stale: it ran at {ratio:.2f}x "
                    f"the stored {profile.speed:.0f} samples/s; re-measured from now on"
                )
                say(WARNING, "%s", text)
                if note is not None:
                    note(text)
        self._used = {}
        if keep and self.model is not None:
            remember_model(self.model)
