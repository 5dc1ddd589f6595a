"""StabilityGuard: balancing must never cost a user their model.

Unequal batch sizes at the app's own learning rate can tip an app that runs near the edge
of stability: the silo given the smallest batch takes the noisiest steps (its SGD noise
grows as η/B with η and τ kept), and a network that dies in one round stays dead (every
silo starts from the dead model; FedAvg cannot leave it). Measured on Flower's quickstart
at its own η = 0.1 (SGD, momentum 0.9), speeds 1:2:4, 60 seeds, 8 rounds
(docs/experiments.md, "The default's guard"): fully balanced sizes (14/27/55) end at
0.53 ± 0.26 with 10 dead networks, stock FedAvg 0.74 ± 0.22 with 3; a floor of half the
mean batch (16/26/54) 0.62 ± 0.21 with 4. At that edge the outcome is chaotic: one
sample more or less in one silo's batch re-rolls a run, so only distributions over many
seeds say anything.

So every silo starts at ≥ half the mean batch (`floors[start]`), and an update that
*diverged* (its norm per step not finite, or more than `ratio` times the larger of its
peers' median and its own recent median; or a non-finite training loss) is left out of the
round's average and the floor goes up one step (0.75, then uniform sizes). Guards that
moved the floor with the training did no better at the edge (any change of sizes re-rolls
the dice there), but one round tells a stable run apart: the first at unequal sizes, early
in training, where a step follows the gradient more than its noise. At a stable learning
rate each silo then moves the model by about as much per step as it did in round 1 at
equal sizes, whatever its new batch; at the edge the silos' local runs scatter (the big
batches' momentum running away from the small ones', or the small ones' noise blowing up).
The probe measures that scatter as the coefficient of variation, over the silos, of each
silo's update norm per step in that round divided by its own in the last round at equal
sizes: dividing by its own removes what non-IID data does to one silo's updates whatever
its batch (on classes:2 the raw norms differ by 0.5 between silos at equal sizes). Below
`probe`, and with the silos' steps grown less than `growth` times their size at equal
sizes, the run is *stable* and the floor comes down to `stable_floor` (a quarter of the
mean batch: full balance, as LB-BSP publishes it, wherever no silo needs less); otherwise
it is at the *edge* and goes back to uniform sizes (`edge_floor`): at the edge any floor
below 1 cost the model at equal rounds (below). The growth is the edge's other mark:
there a large η and momentum amplify each other as soon as the model leaves its start
(the quickstart's steps grow 3.4-15x from round 1 to 2 at η = 0.1 on IID data, 2-6x on
Dirichlet 0.5), where at a stable η they grow 1.1-2.6x (η = 0.03), and fedlb's MLP runs
barely move (0.9-1.1x). The next round, still at the floor,
must confirm it (the same dispersion below `confirm`) before the floor comes down, unless
the probe was clearly calm (under half the threshold, steps grown less than `clear`
times: every run at the edge measured had grown 1.27x or more): one calm
round among three silos is weak evidence, and a first version that confirmed at full
balance, going back to the floor when the confirmation failed, re-rolled runs at the edge
(any change of sizes does there) and lost networks the floor kept. Later
rounds do not move the verdict: once gradient noise dominates a step (a step then scales
as 1/√B), the dispersion grows with unequal sizes at every learning rate. Chosen on
Flower's quickstart (docs/experiments.md, "The adaptive default": 20-60 seeds each of
IID, Dirichlet 0.5 and classes:2 at η = 0.1 and 0.03), the defaults find stable 20 of 20,
16 of 20 and 8 of 20 runs at η = 0.03, and 0 of 60, 0 of 20 and 0 of 20 at η = 0.1; on
5 silos 1..8 at η = 0.1, where round 2 looks calm more often, 8 of 60.

A probe whose steps did not grow (less than `quiet` times) is read net of batch noise, and
so is the round confirming it. At small batches a step is largely gradient noise, whose size
goes as 1/√B, so unequal sizes alone scatter the silos' steps: the main job's first run (MLP,
B0 = 16) had its silo at 8 samples take steps 1.17-1.39x its own at 16, and was read as
the edge. Each ratio is multiplied back by (B/B0)^(w/2) at the w in
[0, 1] that leaves the least dispersion. No run at the edge measured is read differently:
of the quickstart's, those calm by dispersion had all grown 1.43x or more, and the 14 whose
steps did not grow scatter by 0.16-0.73 even net of noise (13 of them classes:2 at η = 0.1;
docs/experiments.md, "A false alarm on a real deployment").

A probe that is scattered though its steps did not grow gets a second look: the next round,
still at the floor and read as the probe was, decides. One silo's local run can spike in
any round (on a real H200 beside two CPU silos the GPU silo's step in the probe round was
1.8x what its batch predicts, and followed 1/√B in every round after), and the probe alone
called that run the edge; every run at the edge measured whose steps did not grow scatters
again in the next round.

The look comes first, where the caller can run it (fedlb's strategies with the steps lever:
`Balancing(edge="steps")`, plaintext). A probe at unequal sizes is itself a risk at the
edge: its smallest batch takes the noisiest steps, and at the quickstart's η = 0.1 the
probe round cost fedlb a round's progress (paired by seed, 0.8 in a median 15.4 s with it,
11.8 s without; docs/benchmarks/edge-levers.md). So the round after the first at equal
sizes keeps every silo at its own batch size, the slow silos' steps cut so that all
finish together (the floor is all of the mean batch while the look is due), and reads
only growth: the edge's mark that belongs to the app, not to the balance (stock runs at
equal sizes grow as much). Growth is read over the silos that ran all their steps: a cut
silo's momentum never built up, its step per step is smaller whatever the app (the
quickstart's slowest silo at 5 of 12 steps: 2-3.5x where its peers grew 4.9-14x). Grown
`growth` times or more, the run is at the edge with no smaller batch ever tried (10 of 10
quickstart runs at η = 0.1, 4.9-11.7x); calm (η = 0.03: 1.1-1.6x in 20 of 20), the
probe follows in the next round, against each silo's step in round 1 (the look's round,
with its cut silos, is no yardstick), growth not judged again there (by round 3 steps
grow 2-6.8x at η = 0.03), and it decides alone: the look and the probe are two rounds of
evidence, as a probe and its confirmation were (η = 0.03: 20 of 20 stable, the probes'
dispersion 0.004-0.094; Dirichlet 0.5 at η = 0.1: 5 runs at the edge by the look, 5 by
the probe, none taken for stable). `look=False` (a caller without the lever): the probe
in round 2, confirmed as above.

A stable verdict is on trial for `trial` rounds: a round whose silos' steps fell to
1/`growth` of their own in the round before or less, its training loss no lower than at
the verdict, puts the run at the edge after all.
Two rounds early in training can look calm where a balanced round then tips the app: on
the quickstart at η = 0.1 over 5 silos 1..8, 3 of 10 runs looked and probed calm, then
fell to 0.08-0.19x within two rounds, the model thrown back toward its start, and ended
below stock; no run found stable in fedlb's recorded runs fell below 0.64x in those
rounds (docs/benchmarks/edge-levers.md). Growth is no sign there: a stable η's first
balanced round grows 2-3.4x. The loss tells a collapse from a learning-rate schedule's
step, which shrinks the steps while the loss goes on falling.

A deployment's next run of the same app takes up the verdict its last run reached
(`adopt`; fedlb.flower.verdicts) instead of probing again: stable, it starts balanced from
the silos' stored speed profiles; at the edge, it runs uniform sizes with no probe.

Why uniform at the edge. On the quickstart at its own η = 0.1 over 3 silos 4 : 2 : 1, every
run judged the edge, and at equal rounds (the user's own `num-server-rounds`) the final
accuracy against stock's was, by the floor kept after the verdict (10 seeds, 10 rounds;
20 seeds, 3 rounds; docs/experiments.md, "Uniform at the edge"): 0.5, -0.22 (10 rounds)
and -0.06 (3 rounds); 0.75, -0.15 and +0.01; 0.9, -0.14 and -0.06; uniform, -0.004 and
+0.003. A fixed floor of 0.5 from round 2 (`probe=0`) costs what 0.5 costs. Before, an
edge run kept the probe's 0.5, which reached moderate targets sooner on the wall clock but
ended every run short of stock's accuracy in as many rounds.

The silos report their update norm (`balance_mod`) and their loss (the app's own metric);
both travel in the clear, so the guard works under HE too.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .dispersion import dispersion, mean_ratio, net_dispersion

HISTORY = 5  # a silo's own recent update norms kept for its reference
PROBE = 0.15  # the default probe threshold (docs/experiments.md, "The adaptive default")
CONFIRM = 0.15  # the round after a calm probe, still at the floor, must stay below this
GROWTH = 3.0  # a probe whose steps grew more than this since equal sizes: the edge
CLEAR = 1.2  # a probe calm by half its threshold, its steps grown less: stable at once
QUIET = 1.2  # a probe whose steps grew less than this is read net of batch noise
STABLE_FLOOR = 0.25  # a stable run's floor: as far below the probe's 0.5 as its verdict goes
EDGE_FLOOR = 1.0  # an edge run's floor: uniform sizes (docs/experiments.md, "Uniform at the edge")
TRIAL = 5  # rounds after a stable verdict in which the silos' steps collapsing means the edge
REGIMES = ("undecided", "stable", "edge", "fixed")  # fixed: probe 0, the floor kept


@dataclass
class Verdict:
    """What the guard made of one round."""

    diverged: dict[str, str] = field(default_factory=dict)  # silo -> why
    dispersion: float | None = None  # coefficient of variation of the norms per step
    # calm, scattered (a calm probe not confirmed), steady, diverged, grown (the look),
    # collapsed (a stable verdict overturned on trial)
    look: str = "steady"
    probe: float | None = None  # the dispersion, in a round that judged the regime
    # which judgement: "look" (the app's own growth, every silo at its own batch size),
    # "probe" or "confirm" (the round after a calm probe), "trial" (a round after a
    # stable verdict, still watched)
    stage: str = ""
    # the probe: the silos' mean step now over at equal sizes; a trial round: over their
    # own in the round before
    growth: float | None = None
    # read net of batch noise (a quiet probe, and the round confirming it): the exponent w
    # of the B^(-w/2) that, divided out, left the least dispersion; None: read as measured
    noise_exponent: float | None = None
    own: bool = True  # judged against each silo's own step at equal sizes (else the raw)
    # the confirming round of a probe that was scattered though its steps did not grow
    # (a second look), not of a calm one
    second_look: bool = False
    regime: str = "undecided"  # the run's after this round: one of REGIMES
    # the one silo whose update blew up while its batch had not shrunk and its peers were
    # calm: its own run's fault, not the learning rate's edge (left out, nothing moves)
    lone: str | None = None
    floor_before: float = 0.0
    floor: float = 0.0  # the floor from now on
    loss: float | None = None  # the silos' mean training loss this round (None: unknown)


class StabilityGuard:
    """A floor on every silo's share of the mean batch, raised when an update diverges.

    Args:
        floors: the floor's steps, each a share of the mean batch, rising. Default
            (0.0, 0.25, 0.5, 0.75, 1.0): from full balance to uniform sizes.
        start: the step a run starts at. Default 2 (0.5).
        probe: the first round at unequal sizes whose dispersion (above) is below
            `probe` lowers the floor to `floors[0]` (the run is stable); one at or above
            it puts the run at the edge (`edge_floor`). Default `PROBE` (0.15). 0.0: never, a fixed
            floor that rises only when an update diverges.
        stable_floor: the floor a stable run keeps (the lowest step at or above it).
            Default `STABLE_FLOOR` (0.25): the probe tried the app at the floor of 0.5,
            and a verdict on that is taken no further than half of it. It binds only
            where a silo would get under a quarter of the mean batch (a CPU beside a GPU
            on measured curves: without it, batches of 2-3 and a model that learned
            less, docs/experiments.md); spreads up to 1..8 need no less than 0.3.
        edge_floor: the floor a run judged at the edge keeps from its verdict on (the
            lowest step at or above it, never below `start`'s). Default `EDGE_FLOOR`
            (1.0: uniform sizes, the app's own; every lower floor measured cost accuracy
            at equal rounds, above). 0.5 (the probe's, fedlb's default before) reaches
            moderate targets sooner on the wall clock at the edge and ends short of
            stock's accuracy in as many rounds (docs/experiments.md, "An edge floor of
            0.75" and "Uniform at the edge").
        growth: a probe whose silos' mean step grew `growth` times or more since equal
            sizes is the edge, however calm. Default `GROWTH` (3.0).
        confirm: the round after a calm probe, still at the floor, must show a dispersion
            below `confirm` too, or the run is at the edge. Default `CONFIRM` (0.15).
            0.0: no confirming round (a calm probe lowers the floor at once).
        clear: a probe that is clearly calm needs no confirming round: its dispersion
            under half of `probe` and its silos' steps grown less than `clear` times since
            equal sizes (no sign of either mark of the edge). Default `CLEAR` (1.2): every
            run at the edge measured grew 1.27x or more by its probe (docs/experiments.md,
            "The adaptive default"), fedlb's MLP runs and the measured curves 0.9-1.05x.
            0.0: always confirm (on Dirichlet 0.5 at η = 0.1 one run of ten taken stable
            at once died balanced, its probe before the model had left its start;
            clear=0.0 put it at the edge: docs/benchmarks/edge-levers.md).
        quiet: a probe whose silos' steps grew less than `quiet` times since equal sizes
            (no sign of the edge's growth) is read net of batch noise, and so is the round
            confirming it: a step of B samples is partly gradient noise, whose size goes as
            1/√B, so at small batches unequal sizes alone scatter the silos' steps (the
            main job's first run: a silo at 8 samples took steps 1.17-1.39x its own at 16;
            √2 = 1.41). Each silo's ratio is multiplied by (B/B0)^(w/2), B0 its size at
            equal sizes, and the dispersion taken at the w in [0, 1] that leaves the least
            (w = 0: no noise, w = 1: all noise). Default `QUIET` (1.2, as `clear`: none
            of the quickstart's runs at the edge is read differently; those calm by
            dispersion had grown 1.43x or more, those that did not grow scatter by
            0.16-0.73 net of noise). 0.0: always as measured.
        second_look: a probe that is scattered though its silos' steps did not grow (less
            than `quiet` times: no sign of the edge's growth) is looked at again in the
            next round, still at the floor and read as it was, and that round decides
            (below `confirm`: stable) instead of the probe alone. One silo's local run can
            spike in any round, equal sizes or not: on a real H200 beside two CPU silos
            the GPU silo's step in the probe round was 1.8x what its batch predicts and
            followed 1/√B in every round after (FedAvg's runs on that machine show such
            spikes at equal sizes, 1.8-3.7x their peers'), and the probe alone called the
            run the edge. Replayed on the recorded runs (docs/experiments.md, "A false
            alarm on a real GPU federation"): that false alarm, 1 of 10 quickstart runs
            at η = 0.03 and 1 of 6 of advanced-pytorch's become stable; no quickstart
            run at η = 0.1 changes (their next round scatters too). Default True.
        look: the round after the first at equal sizes is the look (above): the caller
            runs every silo at its own batch size, the slow silos' steps cut (`check`'s
            `cut`), and growth alone is read; the probe follows a calm look and decides
            alone. Default True; fedlb's strategies turn it off where they cannot cut
            steps (`Balancing(edge="uniform")`, HE). False: the probe in round 2.
        trial: the rounds after a stable verdict in which the run can still be found at
            the edge: a round whose silos' steps fell, on average, to 1/`growth` of their
            own in the round before or less, its training loss no lower than when the run
            was found stable (the model thrown off and fallen back toward its start, where
            the gradients are flat), puts the run at the edge from then on. (A learning-
            rate schedule's step shrinks the steps too, but the loss goes on falling:
            Flower's advanced-pytorch halves its rate in round 5, and one run of ten fell
            to 0.25x there.) Without a loss metric the steps alone are read. A look and
            a probe are a few rounds early in training; a balanced round can still tip an
            app near its edge (the quickstart at η = 0.1 over 5 silos 1..8: 3 runs of 10
            whose look and probe were calm fell to 0.08-0.19x within two rounds of their
            verdict, their loss back above the verdict's, and ended below stock), where
            no run found stable in fedlb's recorded runs (the quickstart at η = 0.03, the
            MLP scenarios, the measured curves, a real GPU federation) fell below 0.64x in
            those rounds. Growth is no sign there: a stable η's first balanced round grows
            2-3.4x. Default `TRIAL` (5). 0: a stable verdict holds (bar a blow-up, above).
        ratio: an update diverged when its norm per local step exceeds `ratio` times its
            reference (the larger of its peers' median this round and its own recent
            median). Default 5.0: balanced silos' updates run up to ~2x their peers'
            (docs/experiments.md); leaving an update out perturbs the run as well, so only
            a blow-up counts.
    """

    DEFAULT_PROBE: ClassVar[float] = PROBE  # the run settings' default

    def __init__(
        self,
        floors: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
        start: int = 2,
        ratio: float = 5.0,
        probe: float = PROBE,
        confirm: float = CONFIRM,
        growth: float = GROWTH,
        clear: float = CLEAR,
        quiet: float = QUIET,
        stable_floor: float = STABLE_FLOOR,
        edge_floor: float = EDGE_FLOOR,
        second_look: bool = True,
        look: bool = True,
        trial: int = TRIAL,
    ) -> None:
        if not floors or any(not 0.0 <= f <= 1.0 for f in floors):
            raise ValueError(f"floors must lie within [0, 1], got {list(floors)}")
        if list(floors) != sorted(floors):
            raise ValueError(f"floors must rise, got {list(floors)}")
        if not 0 <= start < len(floors):
            raise ValueError(f"start must index floors (0..{len(floors) - 1}), got {start}")
        if not 0.0 <= probe < 1.0:
            raise ValueError(f"probe must lie within [0, 1), got {probe}")
        if not 0.0 <= confirm < 1.0:
            raise ValueError(f"confirm must lie within [0, 1), got {confirm}")
        if not (math.isfinite(growth) and growth > 1.0):
            raise ValueError(f"growth must be a finite number > 1, got {growth}")
        if not (math.isfinite(clear) and 0.0 <= clear <= growth):
            raise ValueError(f"clear must lie within [0, growth ({growth})], got {clear}")
        if not (math.isfinite(quiet) and 0.0 <= quiet <= growth):
            raise ValueError(f"quiet must lie within [0, growth ({growth})], got {quiet}")
        for name, share in (("stable_floor", stable_floor), ("edge_floor", edge_floor)):
            if not (math.isfinite(share) and 0.0 <= share <= 1.0):
                raise ValueError(
                    f"{name} must lie within [0, 1] (a share of the mean batch), got {share}"
                )
        if isinstance(trial, bool) or not isinstance(trial, int) or trial < 0:
            raise ValueError(f"trial must be a whole number of rounds >= 0, got {trial!r}")
        if not (math.isfinite(ratio) and ratio > 1.0):
            raise ValueError(f"ratio must be a finite number > 1, got {ratio}")
        self.floors = list(floors)
        self.level = start
        self.ratio = ratio
        self.probe = probe
        self.confirm = confirm
        self.growth = growth
        self.clear = clear
        self.quiet = quiet
        self.second_look = second_look
        self.look = look
        self.trial = trial
        self.on_trial = 0  # rounds left in which a stable verdict can still turn
        self.judged_loss: float | None = None  # the mean training loss when found stable
        self.looked = False  # the look has read the app's own growth (calm: the probe next)
        self.start = start
        self.stable_level = self._step_at(stable_floor)
        self.edge_level = max(self._step_at(edge_floor), start)
        self.probed = False  # the first round at unequal sizes has been judged
        self.confirming = False  # a calm probe waits for the next round to confirm it
        self.looking_again = False  # ... or a scattered one that did not grow, to decide
        self.net_of_noise = False  # the probe was quiet: its confirmation is read so too
        self.regime = "undecided" if probe > 0 else "fixed"
        self.norms: dict[str, list[float]] = {}
        # each silo's update norm per step in the last round at equal sizes, and its size
        # then: the probe's yardstick for that silo
        self.baseline: dict[str, float] = {}
        self.baseline_sizes: dict[str, int] = {}

    @property
    def floor(self) -> float:
        """The share of the mean batch every silo gets at least now (all of it while the
        look is due: that round runs every silo at its own batch size)."""
        return 1.0 if self.looking else self.floors[self.level]

    @property
    def looking(self) -> bool:
        """Whether the look is still due: the run undecided, no probe run yet."""
        return self.look and self.probe > 0 and not (self.looked or self.probed)

    def check(
        self,
        norms: Mapping[str, float],
        losses: Mapping[str, float] | None = None,
        sizes: Mapping[str, int] | None = None,
        cut: Collection[str] = (),
    ) -> Verdict:
        """One round's update norms per local step, training losses and batch sizes, by
        silo: the diverged updates, how the round looked, and the floor from now on.
        `cut`: the silos whose local steps were cut this round (the steps lever): a
        momentum step grows over a round's first steps, so their norm per step is no
        yardstick and says nothing of growth."""
        before = {n: h[-1] for n, h in self.norms.items() if h}  # the last round's steps
        verdict = Verdict(diverged=self._diverged(norms), floor_before=self.floor)
        for name, loss in (losses or {}).items():
            if not math.isfinite(loss):
                verdict.diverged.setdefault(name, f"its training loss is {loss}")
        kept = {n: v for n, v in norms.items() if n not in verdict.diverged}
        verdict.dispersion = dispersion(list(kept.values()))
        sizes = dict(sizes or {})
        looking = self.looking and bool(self.baseline) and len(set(sizes.values())) == 1
        probing = not self.probed and self.probe > 0 and not looking
        confirming = self.confirming
        # a lone blow-up (its own run's fault) does not hold the look up: read the rest
        lone = self._lone(verdict.diverged, kept, sizes) if looking else None
        if looking and (not verdict.diverged or lone is not None):
            self._look(verdict, {n: v for n, v in kept.items() if n not in cut} or kept)
        elif (probing or confirming) and not verdict.diverged:
            growth = self._growth(kept)  # the edge's mark (judged at the probe only)
            net = growth is not None and growth < self.quiet if probing else self.net_of_noise
            verdict.probe, verdict.noise_exponent = self._probe(
                kept, sizes, need_unequal=probing, net_of_noise=net
            )
            verdict.stage = "probe" if probing else "confirm"
            verdict.second_look = self.looking_again  # only ever set while confirming
            verdict.own = bool(self.baseline)
            if verdict.probe is not None:
                verdict.growth = growth
            if probing and verdict.probe is not None:
                self.net_of_noise = verdict.noise_exponent is not None
        if len(set(sizes.values())) == 1 and not looking:  # the yardstick for a later probe
            # (not the look's round: the probe compares every silo with one round)
            whole = {n: v for n, v in kept.items() if v > 0 and n not in cut}
            self.baseline.update(whole)
            self.baseline_sizes.update({n: sizes[n] for n in whole if n in sizes})
        verdict.lone = self._lone(verdict.diverged, kept, sizes)
        trial = self.regime == "stable" and self.on_trial > 0 and not verdict.diverged
        finite = [v for v in (losses or {}).values() if math.isfinite(v)]
        verdict.loss = statistics.fmean(finite) if finite else None
        if trial:
            self.on_trial -= 1
        if trial and (fell := mean_ratio(kept, before)) is not None:
            verdict.stage, verdict.growth = "trial", fell
            # a model no better than when it was found stable (a learning-rate schedule's
            # step shrinks the steps too, while the loss goes on falling)
            no_better = (
                verdict.loss is None or self.judged_loss is None or verdict.loss >= self.judged_loss
            )
            if fell <= 1 / self.growth and no_better:
                verdict.look = "collapsed"
                self.on_trial = 0
                self._decide(stable=False)
        elif verdict.lone is not None:
            verdict.look = "lone"  # neither a verdict nor a floor: the next round goes on
        elif verdict.diverged:
            verdict.look = "diverged"
            self.level = min(self.level + 1, len(self.floors) - 1)
            if looking or probing or confirming:  # a blow-up before the verdict: the edge
                self.probed, self.confirming, self.looking_again = True, False, False
                self._decide(stable=False)
        elif verdict.probe is not None and probing:
            self.probed = True
            # after a look, growth was judged there: by the probe's round (the third)
            # steps grow 2-6.8x from equal sizes at a stable η too
            steady = self.looked or verdict.growth is None or verdict.growth < self.growth
            clear = (
                verdict.probe < self.probe / 2
                and verdict.growth is not None
                and verdict.growth < self.clear
            )
            if verdict.probe < self.probe and steady:
                verdict.look = "calm"
                # the next round, at the floor, confirms; after a calm look the probe is
                # the second round of evidence already, as its confirmation was
                if self.confirm > 0 and not clear and not self.looked:
                    self.confirming = True
                else:
                    self._decide(stable=True)
            elif (
                self.second_look
                and self.confirm > 0
                and verdict.growth is not None
                and verdict.growth < self.quiet
            ):  # scattered, not grown: a spike in one silo's run? the next round decides
                verdict.look = "scattered"
                self.confirming = self.looking_again = True
            else:
                self._decide(stable=False)
        elif verdict.probe is not None:  # the round after the probe, at the floor
            self.confirming = self.looking_again = False
            # growth is not read here: by this round steps grow 2-5.6x at a stable η too
            calm = verdict.probe < self.confirm
            verdict.look = "calm" if calm else "scattered"
            self._decide(stable=calm)
        if self.regime == "stable" and self.judged_loss is None:
            # the loss the verdict was taken at (or, taken up from the last run, the
            # first one known after it): what a collapse on trial is read against
            self.judged_loss = verdict.loss
        verdict.regime = self.regime
        verdict.floor = self.floor
        return verdict

    def _look(self, verdict: Verdict, whole: Mapping[str, float]) -> None:
        """The look: every silo at its own batch size, only the app's own growth read
        (the silos' steps against their own in the round before). Grown `growth` times
        or more, the run is at the edge with no smaller batch ever tried; else the probe
        follows in the next round."""
        verdict.stage = "look"
        verdict.growth = self._growth(whole)
        self.looked = True
        if verdict.growth is not None and verdict.growth >= self.growth:
            verdict.look = "grown"
            self.probed = True
            self._decide(stable=False)
        else:
            verdict.look = "calm"

    def _lone(
        self, diverged: Mapping[str, str], kept: Mapping[str, float], sizes: Mapping[str, int]
    ) -> str | None:
        """The silo whose blow-up was its own: the only one, its batch no smaller than
        its own at equal sizes (or, with none yet, than the round's mean), at least one
        peer, and the peers calm (their steps grown less than `growth` since equal
        sizes, where measured). At the edge the small batches blow up, or the peers'
        steps grow with them: that still raises the floor."""
        if len(diverged) != 1 or not kept:
            return None
        name = next(iter(diverged))
        if name not in sizes:
            return None
        own = self.baseline_sizes.get(name, statistics.fmean(sizes.values()))
        if sizes[name] < own:
            return None
        growth = self._growth(kept)
        if growth is not None and growth >= self.growth:
            return None
        return name

    def _decide(self, stable: bool) -> None:
        """The run's regime, and its floor from now on: a stable run's, or at the edge
        the edge floor (or higher, where a blow-up raised it already). A stable verdict
        is on trial for `trial` rounds."""
        if stable:
            if self.regime != "stable":  # newly stable: on trial (a repeat changes nothing)
                self.on_trial = self.trial
            self.regime, self.level = "stable", self.stable_level
        else:
            self.regime, self.level = "edge", max(self.level, self.edge_level)

    def _probe(
        self,
        norms: Mapping[str, float],
        sizes: Mapping[str, int],
        need_unequal: bool,
        net_of_noise: bool,
    ) -> tuple[float | None, float | None]:
        """(the probe's dispersion if this round can be judged, else None; the noise
        exponent it was read at, None if as measured). It needs at least two silos with
        a yardstick (a norm from an earlier round at equal sizes) that ran unequal sizes
        (`need_unequal`: the probe; the confirming round only needs two), and reads those
        silos' norms each divided by its yardstick, net of batch noise if `net_of_noise`
        (see `quiet`). A run whose first rounds were all unequal (silos with different
        own batch sizes) has no yardstick: it is judged on the raw norms."""
        measured = {n: v for n, v in norms.items() if n in sizes}
        distinct = (lambda names: len({sizes[n] for n in names})) if need_unequal else len
        if len(measured) < 2 or distinct(measured) < 2:
            return None, None
        with_yardstick = [n for n in measured if n in self.baseline]
        if len(with_yardstick) >= 2 and distinct(with_yardstick) >= 2:
            ratios = [measured[n] / self.baseline[n] for n in with_yardstick]
            if not net_of_noise:
                return dispersion(ratios), None
            shrunk = [sizes[n] / self.baseline_sizes.get(n, sizes[n]) for n in with_yardstick]
            return net_dispersion(ratios, shrunk)
        if self.baseline:  # some silos have one: wait for a round that compares them
            return None, None
        return dispersion(list(measured.values())), None

    def _growth(self, norms: Mapping[str, float]) -> float | None:
        """The silos' mean update per step over their own at equal sizes (None: no
        yardstick)."""
        return mean_ratio(norms, self.baseline)

    def _diverged(self, norms: Mapping[str, float]) -> dict[str, str]:
        diverged: dict[str, str] = {}
        for name, norm in norms.items():
            if not math.isfinite(norm):
                diverged[name] = f"its update is not finite ({norm})"
                continue
            references = []
            others = [v for n, v in norms.items() if n != name and math.isfinite(v)]
            if others:
                references.append(statistics.median(others))
            if self.norms.get(name):
                references.append(statistics.median(self.norms[name]))
            reference = max(references, default=0.0)
            if reference > 0 and norm > self.ratio * reference:
                diverged[name] = (
                    f"its update per step is {norm / reference:.1f}x its reference "
                    f"({norm:.3g} against {reference:.3g}: the larger of its peers' median "
                    "and its own recent one)"
                )
        for name, norm in norms.items():
            if name not in diverged:
                self.norms[name] = [*self.norms.get(name, []), norm][-HISTORY:]
        return diverged

    def adopt(self, regime: str) -> None:
        """Start judged, at the regime the last run of the same app found ("stable" or
        "edge"; fedlb.flower.verdicts): no probe. A stable run starts at its floor; a
        blow-up still raises it, as in any stable run."""
        if regime not in ("stable", "edge"):
            raise ValueError(f"a remembered regime is 'stable' or 'edge', got {regime!r}")
        if self.probe <= 0:  # a fixed floor judges nothing, remembered or not
            return
        self.probed, self.confirming, self.looking_again = True, False, False
        self.looked = True
        self._decide(stable=regime == "stable")

    def resume_at(self, share: float) -> None:
        """Go on from a restored run's floor: the lowest step at or above `share` (past
        the look: it ran before any floor)."""
        self.level = self._step_at(share)
        self.looked = True

    def _step_at(self, share: float) -> int:
        """The lowest step of `floors` at or above `share` (the top if none is)."""
        return next(
            (i for i, f in enumerate(self.floors) if f >= share - 1e-9), len(self.floors) - 1
        )

    def rename_workers(self, names: Mapping[str, str]) -> None:
        """Silos that rejoined under new names (a resumed run) keep their history."""
        self.norms = {names.get(n, n): h for n, h in self.norms.items()}
        self.baseline = {names.get(n, n): v for n, v in self.baseline.items()}
        self.baseline_sizes = {names.get(n, n): b for n, b in self.baseline_sizes.items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "norms": {n: list(h) for n, h in self.norms.items()},
            "probed": self.probed,
            "looked": self.looked,
            "confirming": self.confirming,
            "looking_again": self.looking_again,
            "net_of_noise": self.net_of_noise,
            "regime": self.regime,
            "on_trial": self.on_trial,
            "judged_loss": self.judged_loss,
            "baseline": dict(self.baseline),
            "baseline_sizes": dict(self.baseline_sizes),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.level = min(int(state["level"]), len(self.floors) - 1)
        self.norms = {n: [float(v) for v in h] for n, h in state["norms"].items()}
        self.probed = bool(state.get("probed", False))
        self.looked = bool(state.get("looked", self.probed))
        self.confirming = bool(state.get("confirming", False))
        self.looking_again = bool(state.get("looking_again", False))
        self.net_of_noise = bool(state.get("net_of_noise", False))
        regime = state.get("regime", self.regime)
        self.regime = regime if regime in REGIMES else self.regime
        self.on_trial = max(0, int(state.get("on_trial", 0)))
        judged = state.get("judged_loss")
        self.judged_loss = None if judged is None else float(judged)
        self.baseline = {n: float(v) for n, v in state.get("baseline", {}).items()}
        self.baseline_sizes = {n: int(b) for n, b in state.get("baseline_sizes", {}).items()}
