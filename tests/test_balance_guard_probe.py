"""The StabilityGuard's probe: each silo's update at unequal sizes judged against its own
at equal sizes, read net of batch noise; calm, quiet and scattered probes, blow-ups while
probing or confirming, partial participation, renamed silos."""

from __future__ import annotations

import math

import pytest

from fedlb.balance import StabilityGuard
from tests.balance_guard_helpers import EQUAL, OWN, SCATTERED, UNEQUAL, judged, scaled


def test_the_default_probe_judges_each_silo_against_itself_at_equal_sizes():
    """Non-IID silos move the model by different amounts whatever their batch (here 2x
    and 0.5x silo a's): the probe divides that out, so rounds that scale every silo alike
    are calm; a calm probe is confirmed by the next round, still at the floor, and only
    then does the floor come off. (No look first: a caller without the steps lever.)"""
    stable = StabilityGuard(look=False)
    assert (stable.regime, stable.floor) == ("undecided", 0.5)
    verdict = stable.check(OWN, None, EQUAL)
    assert (verdict.probe, verdict.regime, verdict.floor) == (None, "undecided", 0.5)
    verdict = stable.check(scaled(OWN, 1.5), None, UNEQUAL)  # calm, but its steps grew
    assert verdict.probe == pytest.approx(0.0, abs=1e-12)
    assert verdict.growth == pytest.approx(1.5)
    assert (verdict.stage, verdict.look, verdict.regime, verdict.floor) == (
        "probe",
        "calm",
        "undecided",
        0.5,
    )
    verdict = stable.check(scaled(OWN, 1.4), None, UNEQUAL)
    # stable: a quarter of the mean batch at least (as far as the probe's verdict goes)
    assert (verdict.stage, verdict.regime, verdict.floor) == ("confirm", "stable", 0.25)
    assert StabilityGuard(stable_floor=0.0).stable_level == 0  # full balance, if asked
    assert stable.check({"a": 0.5, "b": 2.0, "c": 0.9}, None, UNEQUAL).probe is None  # done

    edge = StabilityGuard(look=False)
    verdict = judged(edge, [(OWN, EQUAL), (SCATTERED, UNEQUAL)])
    assert verdict.probe is not None
    assert verdict.probe > 0.15  # a 0.9x, c 2.7x, grown 1.7x
    assert (verdict.regime, verdict.floor) == ("edge", 1.0)  # uniform sizes from now on
    # decided once: calm rounds later do not take the floor off
    assert judged(edge, [(scaled(OWN, 0.8), UNEQUAL)] * 2).floor == 1.0
    assert edge.regime == "edge"
    # an edge floor a step above the probe's, if asked: from the verdict on
    raised = StabilityGuard(edge_floor=0.75, look=False)
    verdict = judged(raised, [(OWN, EQUAL), (SCATTERED, UNEQUAL)])
    assert (verdict.floor_before, verdict.regime, verdict.floor) == (0.5, "edge", 0.75)
    assert judged(raised, [(scaled(OWN, 0.8), UNEQUAL)] * 2).floor == 0.75
    assert StabilityGuard(edge_floor=0.0).edge_level == 2  # never below the start's
    assert (
        judged(
            StabilityGuard(edge_floor=0.75),
            [(OWN, EQUAL), (scaled(OWN, 1.5), UNEQUAL), ({"a": 0.4, "b": 1.6, "c": 0.6}, UNEQUAL)],
        ).floor
        == 0.75
    )  # a probe not confirmed


def test_a_calm_probe_that_the_next_round_does_not_confirm_keeps_the_floor():
    guard = StabilityGuard()
    verdict = judged(
        guard,
        [(OWN, EQUAL), (scaled(OWN, 1.5), UNEQUAL), ({"a": 0.4, "b": 1.6, "c": 0.6}, UNEQUAL)],
    )
    assert verdict.probe is not None
    assert verdict.probe >= 0.15
    assert (verdict.stage, verdict.look, verdict.regime, verdict.floor) == (
        "confirm",
        "scattered",
        "edge",
        1.0,
    )
    unconfirmed = StabilityGuard(confirm=0.0)  # no confirming round: off at once
    assert judged(unconfirmed, [(OWN, EQUAL), (scaled(OWN, 1.5), UNEQUAL)]).floor == 0.25
    assert unconfirmed.regime == "stable"


def test_a_clearly_calm_probe_needs_no_confirming_round():
    """Scatter under half the threshold and steps no larger than at equal sizes (within
    `clear`): neither mark of the edge, so the floor comes down at once."""
    guard = StabilityGuard(clear=1.2)  # the shortcut, off by default
    verdict = judged(guard, [(OWN, EQUAL), (scaled(OWN, 0.95), UNEQUAL)])
    assert verdict.growth == pytest.approx(0.95)
    assert (verdict.stage, verdict.look, verdict.regime, verdict.floor) == (
        "probe",
        "calm",
        "stable",
        0.25,
    )
    assert not guard.confirming
    # calm, but grown past `clear`, or scattered past half the threshold: confirm first
    assert judged(StabilityGuard(), [(OWN, EQUAL), (scaled(OWN, 1.25), UNEQUAL)]).regime == (
        "undecided"
    )
    scattered = {"a": 0.9, "b": 2.2, "c": 0.5}  # dispersion ~0.09: calm, not clearly
    verdict = judged(StabilityGuard(), [(OWN, EQUAL), (scattered, UNEQUAL)])
    assert 0.075 < verdict.probe < 0.15
    assert verdict.regime == "undecided"
    # without a yardstick (no growth known) a calm probe is always confirmed
    raw = StabilityGuard()
    assert raw.check({"a": 1.0, "b": 1.01, "c": 0.99}, None, UNEQUAL).regime == "undecided"
    # clear=0: always confirm
    always = StabilityGuard(clear=0.0)
    assert judged(always, [(OWN, EQUAL), (scaled(OWN, 0.95), UNEQUAL)]).regime == "undecided"


def test_steps_that_grew_several_fold_since_equal_sizes_mean_the_edge_however_calm():
    """At the edge a large η and momentum amplify each other as the model leaves its
    start: every silo's step grows alike, so the dispersion alone looks calm."""
    start = {"a": 0.06, "b": 0.065, "c": 0.062}
    grown = {"a": 0.6, "b": 0.62, "c": 0.6}  # ~9.6x
    verdict = judged(StabilityGuard(), [(start, EQUAL), (grown, UNEQUAL)])
    assert verdict.probe is not None
    assert verdict.probe < 0.15
    assert verdict.growth == pytest.approx(9.6, abs=0.2)
    assert (verdict.regime, verdict.floor) == ("edge", 1.0)
    lenient = StabilityGuard(growth=20.0)
    assert judged(lenient, [(start, EQUAL), (grown, UNEQUAL), (grown, UNEQUAL)]).regime == "stable"


def noisy(norms, sizes, base=32, growth=1.0):
    """Steps that are all gradient noise: each silo's grows as √(base / B)."""
    return {n: growth * v * math.sqrt(base / sizes[n]) for n, v in norms.items()}


def test_a_quiet_probe_is_read_net_of_batch_noise():
    """The main job's first run: at batches this small a step is mostly gradient noise,
    which goes as 1/√B, so unequal sizes alone scatter the silos' steps (here by 0.24).
    A probe whose steps did not grow (under `quiet`) divides that out, and so does the
    round confirming it; steps that grew are read as measured (every run at the edge
    measured grew 1.27x or more)."""
    assert noisy(OWN, UNEQUAL)["a"] == pytest.approx(math.sqrt(2))
    guard = StabilityGuard(clear=1.2)
    verdict = judged(guard, [(OWN, EQUAL), (noisy(OWN, UNEQUAL), UNEQUAL)])
    assert verdict.growth is not None
    assert verdict.growth < 1.2
    assert verdict.noise_exponent == 1.0
    assert verdict.probe == pytest.approx(0.0, abs=1e-9)
    assert (verdict.look, verdict.regime) == ("calm", "stable")  # clearly calm, net
    from fedlb.flower.stability import regime_text

    assert "net of batch noise (steps ∝ B^-0.50 divided out)" in regime_text(verdict, guard)
    # half noise, half gradient: calm net of it, not clearly; the confirming round is read
    # net of noise too, at its own exponent
    half = {n: v * (32 / UNEQUAL[n]) ** 0.25 * (1.25 if n == "b" else 1.0) for n, v in OWN.items()}
    guard = StabilityGuard()
    verdict = judged(guard, [(OWN, EQUAL), (half, UNEQUAL)])
    assert verdict.noise_exponent == 0.55
    assert 0.075 < verdict.probe < 0.15
    assert verdict.regime == "undecided"
    verdict = guard.check(noisy(OWN, UNEQUAL), None, UNEQUAL)
    assert (verdict.stage, verdict.noise_exponent, verdict.regime) == ("confirm", 1.0, "stable")
    # as measured, the same rounds are the edge
    measured = StabilityGuard(quiet=0.0)
    verdict = judged(measured, [(OWN, EQUAL), (noisy(OWN, UNEQUAL), UNEQUAL)])
    assert verdict.noise_exponent is None
    assert verdict.probe == pytest.approx(0.24, abs=0.01)
    assert verdict.regime == "edge"
    # steps that grew past `quiet`: the edge's mark, read as measured
    grown = StabilityGuard()
    verdict = judged(grown, [(OWN, EQUAL), (noisy(OWN, UNEQUAL, growth=1.3), UNEQUAL)])
    assert verdict.growth > 1.2
    assert (verdict.noise_exponent, verdict.regime) == (None, "edge")
    # scatter that runs against the sizes (the small batch's step smaller) is no noise
    against = {n: v * math.sqrt(UNEQUAL[n] / 32) for n, v in OWN.items()}
    guard = StabilityGuard()
    verdict = judged(guard, [(OWN, EQUAL), (against, UNEQUAL)])
    assert (verdict.noise_exponent, verdict.look, verdict.regime) == (0.0, "scattered", "undecided")
    verdict = guard.check(against, None, UNEQUAL)  # not grown: a second look, which decides
    assert (verdict.second_look, verdict.noise_exponent, verdict.regime) == (True, 0.0, "edge")


# The measured H200 federation's seed 1 (docs/results/gpu/federation-2026-11-27-h200,
# warm-default-s1): each silo's update per step (x 1000) in round 3 (all at 32, the
# yardstick), round 4 (the probe: the GPU silo's run spiked, 1.8x what B = 42 predicts)
# and round 5 (every silo's step as its batch predicts).
H200_SIZES = [{"gpu": 32, "cpu4": 32, "cpu1": 32}, {"gpu": 42, "cpu4": 32, "cpu1": 22}]
H200_SIZES.append({"gpu": 44, "cpu4": 31, "cpu1": 21})


H200_NORMS = [
    {"gpu": 4.394, "cpu4": 4.321, "cpu1": 4.098},
    {"gpu": 5.524, "cpu4": 3.052, "cpu1": 3.692},
    {"gpu": 2.389, "cpu4": 2.620, "cpu1": 3.169},
]


def test_a_scattered_probe_whose_steps_did_not_grow_gets_a_second_look():
    """One silo's local run can spike in any round; where the steps did not grow (no mark
    of the edge), the next round, still at the floor, decides. The real H200 run the probe
    alone called the edge is calm at its second look; a second look that scatters again
    is the edge, and without the second look the probe decides alone."""
    from fedlb.flower.stability import regime_text

    guard = StabilityGuard()
    rounds = list(zip(H200_NORMS, H200_SIZES, strict=True))
    verdict = judged(guard, rounds[:2])
    assert verdict.probe == pytest.approx(0.24, abs=0.01)
    assert verdict.growth == pytest.approx(0.95, abs=0.01)
    assert (verdict.look, verdict.regime, verdict.floor) == ("scattered", "undecided", 0.5)
    assert "did not grow" in regime_text(verdict, guard)
    restored = StabilityGuard()  # a resumed run keeps waiting for its second look
    restored.load_state_dict(guard.state_dict())
    for g in (guard, restored):
        verdict = g.check(H200_NORMS[2], None, H200_SIZES[2])
        assert verdict.probe < 0.05  # net of batch noise, as the probe was read
        assert (verdict.stage, verdict.second_look) == ("confirm", True)
        assert (verdict.regime, verdict.floor) == ("stable", 0.25)
    assert regime_text(verdict, guard).startswith("the stability guard's second look: calm")

    again = StabilityGuard()
    spiked = {"gpu": 2.389, "cpu4": 2.620, "cpu1": 9.0}
    verdict = judged(again, [*rounds[:2], (spiked, H200_SIZES[2])])
    assert (verdict.second_look, verdict.look, verdict.regime) == (True, "scattered", "edge")
    assert "scattered again" in regime_text(verdict, again)

    alone = StabilityGuard(second_look=False)
    assert judged(alone, rounds[:2]).regime == "edge"


def test_a_silo_without_a_size_gets_a_yardstick_but_no_size():
    guard = StabilityGuard()
    guard.check({"a": 1.0, "b": 1.1, "c": 0.9}, None, {"a": 32, "b": 32})  # c's size unsaid
    assert guard.baseline_sizes == {"a": 32, "b": 32}
    assert set(guard.baseline) == {"a", "b", "c"}


def test_net_dispersion_divides_out_the_noise_exponent_that_leaves_least():
    from fedlb.balance.dispersion import dispersion, net_dispersion

    ratios, shrunk = [1.0, 1.2, 0.9], [1.0, 1.0, 1.0]  # sizes unchanged: as measured
    assert net_dispersion(ratios, shrunk) == (dispersion(ratios), 0.0)
    shrunk = [0.25, 1.0, 4.0]  # pure noise: 2x, 1x, 0.5x
    found, w = net_dispersion([2.0, 1.0, 0.5], shrunk)
    assert (found, w) == (pytest.approx(0.0, abs=1e-12), 1.0)
    assert net_dispersion([0.0, 0.0], [0.5, 2.0]) == (None, None)


def test_a_blow_up_while_confirming_means_the_edge():
    even = {"a": 1.0, "b": 1.1, "c": 0.9}
    guard = StabilityGuard()
    verdict = judged(
        guard,
        [(even, EQUAL), (scaled(even, 1.5), UNEQUAL), ({"a": 9.0, "b": 1.1, "c": 0.9}, UNEQUAL)],
    )  # a: the silo whose batch shrank (32 -> 16)
    assert (verdict.look, verdict.regime) == ("diverged", "edge")
    assert verdict.floor == 1.0  # the edge: uniform sizes


def test_a_blow_up_before_the_probe_means_the_edge():
    guard = StabilityGuard()
    verdict = guard.check({"a": 1.0, "b": 1.1, "c": 9.0}, None, {"a": 32, "b": 32, "c": 20})
    assert set(verdict.diverged) == {"c"}  # c's batch below the mean: not its own fault
    assert (verdict.regime, verdict.floor) == ("edge", 1.0)
    assert guard.check({"a": 1.0, "b": 1.0, "c": 1.0}, None, UNEQUAL).floor == 1.0
    # an edge floor of 0.75, if asked: a blow-up raises the floor a step
    raised = StabilityGuard(edge_floor=0.75)
    two = raised.check({"a": math.inf, "b": 1.1, "c": math.nan}, None, EQUAL)  # two: the app's
    assert (two.lone, two.floor) == (None, 0.75)


def test_a_blow_up_of_one_silo_alone_leaves_it_out_and_moves_nothing():
    """Its batch no smaller than at equal sizes, its peers calm: that silo's own run (the
    probe found two NaN rounds from one silo raising everyone's floor to 0.75, E 1.0 ->
    0.57). At the app's edge the small batches blow up, or every step grows: the floor.
    (No look first: a caller without the steps lever.)"""
    guard = StabilityGuard(look=False)
    for _ in range(2):  # twice at equal sizes, as the probe did it
        verdict = guard.check({"a": 1.0, "b": 1.1, "c": math.nan}, None, EQUAL)
        assert (verdict.look, verdict.lone, set(verdict.diverged)) == ("lone", "c", {"c"})
        assert (verdict.regime, verdict.floor) == ("undecided", 0.5)
    # at the probe, c (54, more than its 32) blows up alone: not judged; the next round is
    even = {"a": 1.0, "b": 1.05, "c": 0.95}
    guard.check(even, None, EQUAL)
    verdict = guard.check({"a": 1.0, "b": 1.05, "c": 20.0}, None, UNEQUAL)
    assert (verdict.lone, verdict.probe, verdict.floor) == ("c", None, 0.5)
    assert guard.check(even, None, UNEQUAL).look == "calm"  # the probe, a round later
    # a's batch shrank (32 -> 16): the edge, as before
    shrank = StabilityGuard()
    shrank.check(even, None, EQUAL)
    verdict = shrank.check({"a": 20.0, "b": 1.05, "c": 0.95}, None, UNEQUAL)
    assert (verdict.lone, verdict.regime, verdict.floor) == (None, "edge", 1.0)
    # the peers' steps grew 4x with it: the app's edge, not one silo's run
    grown = StabilityGuard()
    grown.check(even, None, EQUAL)
    verdict = grown.check({"a": 4.0, "b": 4.2, "c": 80.0}, None, UNEQUAL)
    assert (verdict.lone, verdict.regime) == (None, "edge")


def test_without_a_round_at_equal_sizes_the_probe_reads_the_raw_norms():
    """Silos with different own batch sizes are unequal from round 1."""
    guard = StabilityGuard()
    verdict = guard.check({"a": 1.0, "b": 1.02, "c": 0.98}, None, UNEQUAL)
    assert verdict.probe == pytest.approx(0.0163, abs=1e-3)
    assert not verdict.own
    verdict = guard.check({"a": 0.9, "b": 0.92, "c": 0.88}, None, UNEQUAL)
    assert verdict.regime == "stable"


def test_with_partial_participation_the_probe_waits_for_two_silos_it_can_compare():
    guard = StabilityGuard()
    guard.check({"a": 1.0, "b": 1.1}, None, {"a": 32, "b": 32})  # c not sampled
    # a newcomer beside one silo with a yardstick: nothing to compare yet
    verdict = guard.check({"a": 1.0, "c": 5.0}, None, {"a": 20, "c": 32})
    assert (verdict.probe, verdict.regime) == (None, "undecided")
    verdict = guard.check({"a": 0.9, "b": 0.99}, None, {"a": 20, "b": 44})
    assert verdict.probe == pytest.approx(0.0, abs=1e-12)
    # confirming: a pair with a newcomer is not comparable; the next pair is
    assert guard.check({"a": 0.9, "c": 5.0}, None, {"a": 20, "c": 44}).probe is None
    assert guard.check({"a": 0.8, "b": 0.88}, None, {"a": 20, "b": 44}).regime == "stable"


def test_renamed_silos_keep_their_yardsticks():
    guard = StabilityGuard()
    guard.check({"a": 1.0, "b": 1.1, "c": 0.9}, None, EQUAL)
    guard.rename_workers({"a": "x", "b": "y", "c": "z"})
    sizes = {"x": 16, "y": 26, "z": 54}
    verdict = judged(guard, [({"x": 0.8, "y": 0.88, "z": 0.72}, sizes)] * 2)
    assert verdict.regime == "stable"


def test_a_silo_is_also_judged_against_its_own_recent_updates():
    guard = StabilityGuard()
    for _ in range(3):
        guard.check({"a": 4.0, "b": 1.0})  # a's updates are large, and always were
    assert not guard.check({"a": 6.0, "b": 1.0}).diverged  # 1.5x its own: not a blow-up
    assert guard.check({"a": 25.0, "b": 1.0}).diverged  # 6x its own


def test_the_look_reads_the_apps_own_growth_before_any_smaller_batch():
    """With the steps lever, the round after the first at equal sizes runs every silo at
    its own batch size (the floor is all of the mean batch while the look is due) and
    reads growth alone, over the silos that ran all their steps (a cut silo's momentum
    never built up: its step per step says nothing). Grown 3x or more: the edge, no
    smaller batch ever tried."""
    guard = StabilityGuard()
    assert (guard.looking, guard.floor) == (True, 1.0)
    assert guard.check(OWN, None, EQUAL).floor == 1.0  # round 1: the yardstick
    grown = {"a": 4.0, "b": 7.0, "c": 0.6}  # a and b ran all their steps; c was cut
    verdict = guard.check(grown, None, EQUAL, cut={"c"})
    assert (verdict.stage, verdict.look, verdict.regime) == ("look", "grown", "edge")
    assert verdict.growth == pytest.approx(3.75)  # (4/1 + 7/2) / 2: c's 1.2x not counted
    assert (verdict.probe, verdict.floor, guard.looking) == (None, 1.0, False)


def test_a_calm_look_is_followed_by_the_probe_judged_on_dispersion_alone():
    """Calm by growth, the probe follows at the start floor, against each silo's step at
    equal sizes in round 1 (the look's round, with cut silos, is no yardstick), and
    growth is not judged there again: two rounds on, steps grow 2-6.8x at a stable η. A
    calm probe then decides at once: the look was the first round of evidence."""
    guard = StabilityGuard()
    guard.check(OWN, None, EQUAL)
    verdict = guard.check(scaled(OWN, 1.5), None, EQUAL, cut={"c"})
    assert (verdict.stage, verdict.look, verdict.regime) == ("look", "calm", "undecided")
    assert (verdict.floor, guard.baseline) == (0.5, OWN)
    verdict = guard.check(scaled(OWN, 5.0), None, UNEQUAL)  # grown 5x, calm: stable
    assert (verdict.stage, verdict.look, verdict.regime, verdict.floor) == (
        "probe",
        "calm",
        "stable",
        0.25,
    )
    scattered = StabilityGuard()
    judged(scattered, [(OWN, EQUAL), (OWN, EQUAL)])
    assert scattered.check(SCATTERED, None, UNEQUAL).regime == "edge"
    state = guard.state_dict()
    again = StabilityGuard()
    again.load_state_dict(state)
    assert (again.looked, again.looking, again.regime) == (True, False, "stable")


def test_a_blow_up_in_the_look_is_the_edge_and_a_remembered_verdict_needs_no_look():
    guard = StabilityGuard()
    guard.check(OWN, None, EQUAL)
    alone = guard.check({"a": math.nan, "b": 2.0, "c": 0.5}, None, EQUAL)
    # its own run's fault: left out, the look read from the others (calm)
    assert (alone.lone, alone.stage, alone.regime, guard.looking) == (
        "a",
        "look",
        "undecided",
        False,
    )
    two = StabilityGuard()
    two.check(OWN, None, EQUAL)
    verdict = two.check({"a": math.nan, "b": math.inf, "c": 0.5}, None, EQUAL)
    assert (verdict.regime, two.looking) == ("edge", False)
    remembered = StabilityGuard()
    remembered.adopt("stable")
    assert (remembered.looking, remembered.floor) == (False, 0.25)


def stable_after_a_look(**settings):
    """A guard that looked calm and probed calm: stable, its verdict on trial."""
    guard = StabilityGuard(**settings)
    guard.check(OWN, None, EQUAL)
    guard.check(scaled(OWN, 1.5), None, EQUAL, cut={"c"})
    assert guard.check(scaled(OWN, 5.0), None, UNEQUAL).regime == "stable"
    return guard


BALANCED = {"a": 8, "b": 27, "c": 61}


def test_a_stable_verdict_whose_steps_collapse_on_trial_turns_to_the_edge():
    """The quickstart at η = 0.1 over 5 silos 1..8: a calm look and probe, then the first
    balanced round blew every silo's step up ~4x (no one silo's blow-up: all together)
    and the next fell to ~0.1x, the model thrown back toward its start. A fall to
    1/growth or less within `trial` rounds of the verdict puts the run at the edge."""
    guard = stable_after_a_look()
    grown = guard.check(scaled(OWN, 20.0), None, BALANCED)  # 4x the probe's, all together
    assert (grown.stage, grown.regime, grown.look) == ("trial", "stable", "steady")
    assert grown.growth == pytest.approx(4.0)
    fell = guard.check(scaled(OWN, 2.0), None, BALANCED)  # 0.1x the round before
    assert (fell.stage, fell.look, fell.regime, fell.floor) == ("trial", "collapsed", "edge", 1.0)
    assert fell.growth == pytest.approx(0.1)
    assert guard.check(scaled(OWN, 0.1), None, EQUAL).regime == "edge"  # for good


def test_a_stable_run_whose_steps_shrink_as_it_learns_stays_stable():
    """A stable η's steps shrink round by round as the loss falls (0.64x the round
    before at the least in every stable run recorded), and after the trial rounds a
    fall of any size (a learning-rate schedule's step) is the app's, not the edge."""
    guard = stable_after_a_look()
    norms = scaled(OWN, 5.0)
    for _ in range(5):  # the trial's rounds: steps 0.6x the round before each
        norms = scaled(norms, 0.6)
        verdict = guard.check(norms, None, BALANCED)
        assert (verdict.stage, verdict.regime) == ("trial", "stable")
    after = guard.check(scaled(norms, 0.1), None, BALANCED)  # an lr decay by 10x
    assert (after.stage, after.regime) == ("", "stable")


def test_with_no_trial_a_stable_verdict_holds_and_the_trial_survives_a_resume():
    held = stable_after_a_look(trial=0)
    held.check(scaled(OWN, 20.0), None, BALANCED)
    assert held.check(scaled(OWN, 2.0), None, BALANCED).regime == "stable"
    guard = stable_after_a_look()
    guard.check(scaled(OWN, 20.0), None, BALANCED)
    again = StabilityGuard()
    again.load_state_dict(guard.state_dict())
    assert again.on_trial == guard.on_trial == 4
    assert again.check(scaled(OWN, 2.0), None, BALANCED).regime == "edge"
    remembered = StabilityGuard()
    remembered.adopt("stable")  # a verdict taken up from the last run is on trial too
    assert remembered.on_trial == 5
    with pytest.raises(ValueError, match="trial"):
        StabilityGuard(trial=-1)


def test_a_fall_while_the_loss_goes_on_falling_is_a_schedules_not_the_edge():
    """Flower's advanced-pytorch halves its learning rate in round 5: a stable run's steps
    then fall (to 0.25x the round before's in one run of ten) while its training loss
    goes on falling. A fall counts only where the loss is no lower than at the verdict:
    the model fallen back toward its start."""
    losses = {"a": 1.0, "b": 1.0, "c": 1.0}
    guard = StabilityGuard()
    guard.check(OWN, losses, EQUAL)
    guard.check(scaled(OWN, 1.5), losses, EQUAL, cut={"c"})
    assert guard.check(scaled(OWN, 5.0), losses, UNEQUAL).regime == "stable"
    assert guard.judged_loss == pytest.approx(1.0)  # the loss the verdict was taken at
    guard.check(scaled(OWN, 5.0), scaled(losses, 0.9), BALANCED)
    halved = guard.check(scaled(OWN, 1.0), scaled(losses, 0.8), BALANCED)  # 0.2x, learning
    assert (halved.stage, halved.look, halved.regime) == ("trial", "steady", "stable")
    thrown_back = guard.check(scaled(OWN, 0.1), scaled(losses, 1.05), BALANCED)
    assert (thrown_back.look, thrown_back.regime, thrown_back.loss) == (
        "collapsed",
        "edge",
        pytest.approx(1.05),
    )
