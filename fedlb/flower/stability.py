"""The stability guard's part of a round: which updates diverged (left out of the average)
and where the silos' floor goes, read from the round's reports. Kept beside the strategy so
its hooks only ask for the verdict."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from logging import INFO, WARNING
from typing import Any

from fedlb.balance import BatchSizeManager, StabilityGuard, Verdict

from .identity import by_node, node_of, worker_name
from .membership import say
from .protocol import TRAIN_LOSS_NAMES, SiloReport, first_number


def least_share(guard: StabilityGuard, user_floor: float) -> float:
    """The share of the mean batch no silo goes below: the guard's floor, never under the
    one the user set on the tuner."""
    return max(guard.floor, user_floor)


def guard_round(
    guard: StabilityGuard,
    manager: BatchSizeManager | None,
    user_floor: float,
    server_round: int,
    said: Mapping[int, SiloReport],
    app_numbers: Mapping[int, Mapping[str, float]],
    blown_up: list[int],
    label: Callable[[int], str],
    note: Callable[[str], None] | None = None,
    sent: Mapping[int, tuple[int | None, int | None]] | None = None,
    cut: Collection[int] = (),
) -> tuple[dict[int, str], Verdict]:
    """The guard's verdict on the round, and the diverged updates (node -> why) to leave
    out; the manager's floor moved (and the sizes with it) when the verdict says so.
    `note` also gets each verdict said, for the round record's events (the live page
    shows them). `sent`: the (B, τ) each silo was sent, for the sizes of updates that
    came back NaN (no report read from them). `cut`: the silos whose steps the steps
    lever cut this round."""
    tell = note or (lambda text: None)
    # Per local step: a silo with more steps (a bigger dataset, τ = len(its loader))
    # moves the model further without diverging.
    norms = {
        worker_name(n): r.update_norm / r.local_steps
        for n, r in said.items()
        if r.update_norm is not None
    }
    # updates rejected for NaN or infinity: left out already, and a blow-up all the same
    norms.update({worker_name(n): math.inf for n in blown_up})
    losses = {
        worker_name(n): loss
        for n in said
        if (loss := first_number(app_numbers.get(n, {}), TRAIN_LOSS_NAMES)) is not None
    }
    sizes = {worker_name(n): r.batch_size for n, r in said.items()}
    # an update that came back NaN left no report: its size is the one it was sent, or,
    # given none (its own loader's, round 1), the round's mean: not one fedlb shrank
    mean = round(sum(sizes.values()) / len(sizes)) if sizes else None
    for node in blown_up:
        ordered = (sent or {}).get(node, (None, None))[0]
        if (size := ordered or mean) is not None:
            sizes[worker_name(node)] = size
    verdict = guard.check(norms, losses, sizes, cut={worker_name(n) for n in cut})
    found = {n: why for n, why in by_node(verdict.diverged).items() if n not in blown_up}
    for node, why in found.items():
        text = f"{label(node)}'s update diverged and is left out of the average: {why}"
        say(WARNING, "round %d: %s", server_round, text)
        tell(text)
    if verdict.lone is not None:
        text = (
            f"the stability guard: {label(node_of(verdict.lone))}'s update "
            "blew up alone (its batch no smaller than at equal sizes, its peers calm): its "
            "own run's fault, not this learning rate's edge; left out of the average, "
            "the floor and everyone's sizes stay"
        )
        say(WARNING, "round %d: %s", server_round, text)
        tell(text)
    if verdict.probe is not None or verdict.stage == "look":  # the regime judged: say why
        text = look_text(verdict, guard) if verdict.stage == "look" else regime_text(verdict, guard)
        say(INFO, "round %d: %s", server_round, text)
        tell(text)
    if verdict.look == "collapsed":  # a stable verdict overturned on trial
        text = collapse_text(verdict, guard)
        say(WARNING, "round %d: %s", server_round, text)
        tell(text)
    if manager is not None:
        floor = least_share(guard, user_floor)
        if getattr(manager.tuner, "min_share", floor) != floor:
            manager.set_min_share(floor)
            # said above, with why; or the look's uniform round, said when it is planned
            if (
                verdict.probe is not None
                or verdict.stage == "look"
                or verdict.look == "collapsed"
                or guard.looking
            ):
                return found, verdict
            dispersion = "–" if verdict.dispersion is None else f"{verdict.dispersion:.2f}"
            text = (
                f"the stability guard: {verdict.look} round (dispersion of the silos' "
                f"updates {dispersion}): every silo gets at least {100 * floor:.0f}% of the "
                "mean batch from now on"
            )
            say(
                WARNING if floor > verdict.floor_before else INFO,
                "round %d: %s",
                server_round,
                text,
            )
            tell(text)
    return found, verdict


def look_text(verdict: Verdict, guard: StabilityGuard) -> str:
    """The look's verdict in words: the app's own growth, `guard`'s threshold, what follows."""
    grown = (
        "could not be measured (no silo ran all its steps in both rounds)"
        if verdict.growth is None
        else f"grew {verdict.growth:.1f}x since the round before "
        f"(the edge from {guard.growth:.1f}x)"
    )
    evidence = (
        "with every silo at its own batch size, the update per step of the silos that ran "
        f"all their steps {grown}"
    )
    if verdict.regime == "edge":
        return (
            f"the stability guard's look: at the edge of stability: {evidence}, the app's "
            "own learning rate and momentum amplifying each other as the model leaves its "
            "start; no smaller batch is tried: every silo keeps its own batch size from now "
            "on (the steps lever: the slow silos run fewer steps)"
        )
    return (
        f"the stability guard's look: calm: {evidence}; the next round probes unequal batch "
        f"sizes (every silo at least {100 * verdict.floor:.0f}% of the mean batch)"
    )


def collapse_text(verdict: Verdict, guard: StabilityGuard) -> str:
    """A stable verdict overturned in its trial rounds, in words."""
    loss = (
        ""
        if verdict.loss is None or guard.judged_loss is None
        else f" and their training loss is {verdict.loss:.3g} ({guard.judged_loss:.3g} when "
        "found stable)"
    )
    return (
        "the stability guard: at the edge of stability after all: the silos' update per "
        f"step fell to {verdict.growth or 0:.2f}x their own in the round before (the edge "
        f"from 1/{guard.growth:.1f}){loss}, the model thrown off and fallen back toward its "
        "start at these balanced sizes; every silo keeps its own batch size from now on "
        "(the steps lever: the slow silos run fewer steps)"
    )


def regime_text(verdict: Verdict, guard: StabilityGuard) -> str:
    """The probe's verdict in words: the evidence, `guard`'s thresholds and what follows."""
    threshold = guard.probe if verdict.stage == "probe" else guard.confirm
    against = (
        "each against its own at equal sizes"
        if verdict.own
        else "as they are (no round at equal sizes to compare with)"
    )
    net = (
        ""
        if verdict.noise_exponent is None
        else f" net of batch noise (steps ∝ B^-{verdict.noise_exponent / 2:.2f} divided out)"
    )
    evidence = (
        f"the silos' update per step, {against},{net} varies by {verdict.probe:.2f} "
        f"(coefficient of variation; threshold {threshold:.2f})"
    )
    if verdict.growth is not None and guard.looked:  # growth was the look's to judge
        evidence += f" and grew {verdict.growth:.1f}x since round 1"
    elif verdict.growth is not None:
        evidence += f" and grew {verdict.growth:.1f}x (the edge from {guard.growth:.1f}x)"
    if verdict.stage == "probe" and verdict.regime == "stable" and guard.looked:
        return (
            f"the stability guard's probe after a calm look: stable at this learning rate: "
            f"{evidence}; the look's growth and this probe's dispersion decide it (no "
            f"confirming round); every silo at least {100 * verdict.floor:.0f}% of the mean "
            "batch from now on, full balance wherever none needs less (an update that "
            "blows up still raises the floor)"
        )
    if verdict.stage == "probe" and verdict.regime == "stable":
        return (
            f"the stability guard's probe: clearly calm: stable at this learning rate: "
            f"{evidence}; under half the threshold and grown less than {guard.clear:.1f}x, so no "
            f"confirming round; every silo at least {100 * verdict.floor:.0f}% of the mean "
            "batch from now on, full balance wherever none needs less (an update that "
            "blows up still raises the floor)"
        )
    if verdict.second_look:
        outcome = (
            f"calm: stable at this learning rate: {evidence}; every silo at least "
            f"{100 * verdict.floor:.0f}% of the mean batch from now on, full balance wherever "
            "none needs less (an update that blows up still raises the floor)"
            if verdict.regime == "stable"
            else f"scattered again: at the edge of stability: {evidence}; {edge_sizes(verdict)}"
        )
        return f"the stability guard's second look: {outcome}"
    if verdict.stage == "confirm" and verdict.regime == "stable":
        return (
            f"the stability guard's probe, confirmed: stable at this learning rate: "
            f"{evidence}; every silo at least {100 * verdict.floor:.0f}% of the mean batch "
            "from now on, full balance wherever none needs less (an update that blows up "
            "still raises the floor)"
        )
    if verdict.stage == "confirm":
        return (
            f"the stability guard's probe, not confirmed: at the edge of stability: "
            f"{evidence}; {edge_sizes(verdict)}"
        )
    if verdict.look == "scattered":  # a probe looked at again next round
        return (
            f"the stability guard's probe: scattered, though the silos' steps did not grow: "
            f"{evidence}; one silo's run can spike in any round, so the floor stays one "
            "more round, which decides"
        )
    if verdict.look == "calm":
        return (
            f"the stability guard's probe: calm: {evidence}; the floor stays one more "
            "round, which must confirm it"
        )
    return (
        f"the stability guard's probe: at the edge of stability: {evidence}; {edge_sizes(verdict)}"
    )


def edge_sizes(verdict: Verdict) -> str:
    """What a run at the edge runs from its verdict on, in words."""
    if verdict.floor >= 1.0:
        return (
            "the app's own batch sizes from now on (uniform): smaller batches at this "
            "learning rate would cost the model accuracy; at a lower one fedlb balances"
        )
    return f"every silo keeps at least {100 * verdict.floor:.0f}% of the mean batch"


def fixed_rounds_advice(summary: Mapping[str, Any], num_rounds: int) -> str | None:
    """What a user who plans a fixed number of rounds should know at the end of a
    balanced run: its rounds were shorter than FedAvg's, and smaller batches at the app's
    learning rate can cost accuracy per round, so N rounds in FedAvg's time, or a floor,
    is how to end at stock's accuracy (measured: docs/experiments.md). None where the run
    gained too little for it to matter (under 1.2x per round)."""
    balanced, uniform = (
        summary.get("steady_balance_efficiency"),
        summary.get("uniform_balance_efficiency"),
    )
    if not balanced or not uniform or balanced / uniform < 1.2:
        return None
    gain = balanced / uniform
    return (
        f"this run's rounds took about 1/{gain:.1f} of FedAvg's at the speeds measured (E "
        f"{balanced:.2f} against uniform sizes' {uniform:.2f}). Smaller batches at the app's "
        "learning rate can cost some accuracy per round: to end at stock FedAvg's accuracy "
        f"in its time, run about {max(num_rounds, round(num_rounds * gain))} rounds instead "
        f"of {num_rounds}, or keep every silo near the mean batch (guard-probe = 0, "
        'StabilityGuard(probe=0), or min-share); docs/experiments.md, "A fixed number of '
        "rounds that must end at stock's accuracy\""
    )
