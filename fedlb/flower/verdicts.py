"""The stability guard's verdict, remembered for the next run of the same app.

A run that starts balanced from stored speed profiles has no round at equal sizes to probe
against: its guard would judge the raw update norms of its first unequal rounds, at the
floor meanwhile (at 100 silos ~1.1x the floor where full balance from round 1 gives 1.41x;
docs/experiments.md, "A second run"), and at the edge the floor from round 1 costs
networks (the quickstart at η = 0.1 over 1:2:4: 7 of 60 dead, stock 3). The regime is the
app's more than the run's (its model, data, learning rate and batch sizes decide it), so
the server keeps the verdict its guard reached, with the evidence, and the next run of the
same app takes it up before round 1 instead of probing again: a stable app starts from the
profiles at full balance; an app at the edge runs round 1 at every silo's B0, as a first
run does, then the floor, with no probe that could call it calm by chance; an app not
judged yet runs as a first run (B0, then the probe). A blow-up (an update left out as
diverged) in a stable run replaces the verdict with the edge.

"The same app": the model's layout, the train config the server sends (its learning rate,
for Flower's templates), and the app itself: for fedlb's own ServerApp its run settings but
those that do not change how silos train (fedlb.deploy.run_config.NOT_TRAINING: the rounds
planned, the seed, where results go); for any other app, as Flower knows it (its FAB's
hash, so an edited app is judged anew, and the run's --run-config overrides). Kept in the
profiles' folder (fedlb.flower.profiles: FEDLB_PROFILE_DIR=off turns both off), 0600; a verdict
older than the profiles' MAX_AGE_S is ignored. A damaged file (too large, too deep, not
JSON) is set aside, said once with its new name, and the run goes on as if there were
none; a damaged entry (a regime not judged, a time that is none: 1e308, -1e18, a day
ahead) is ignored, and that app's next run probes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from logging import INFO
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlb.balance import StabilityGuard, Verdict
from fedlb.data import profile_cache_dir
from fedlb.security import StoredFileError, read_json_object, set_aside

from .membership import say
from .profiles import (
    MAX_AGE_S,
    MAX_KEPT_BYTES,
    is_finite_number,
    set_aside_damaged,
    store_entry,
    write_json_file,
)
from .protocol import SERVER_ROUND

if TYPE_CHECKING:
    from flwr.serverapp import Grid

log = logging.getLogger("fedlb.flower")

VERDICTS_FILE = "verdicts.json"  # the server's: key -> the last verdict its guard reached
JUDGED = ("stable", "edge")  # the regimes worth remembering (not undecided, not fixed)
# `at` is time.time() when the verdict was reached: from 1970 to this machine's clock,
# a day's leeway for another machine's sharing the folder (one further ahead would never
# grow old; 1e308 or -1e18 is no time, and no calendar date shows it)
AHEAD_S = 24 * 3600.0
MOST_SILOS = 2**31


@dataclass(frozen=True)
class Remembered:
    """A verdict a run reached: its regime, when, on what evidence, and of which app."""

    regime: str
    at: float  # time.time() when it was reached
    why: str  # the evidence, in words (the probe's dispersion, or the blow-up)
    app: str = ""  # the app, in words (the key is a hash): for `fedlb verdicts`
    silos: int | None = None  # how many silos trained in the round that decided it

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.at)

    @property
    def expired(self) -> bool:
        """Older than the profiles' MAX_AGE_S: hardware and software drift, so ignored."""
        return self.age_s > MAX_AGE_S

    def said(self) -> str:
        return f"{self.regime}, found {self.age_s / 3600:.1f} h ago ({self.why})"


def app_identity(grid: Grid) -> dict[str, Any]:
    """The app as Flower knows it: its FAB's hash (id and version where there is none)
    and the run's config overrides; empty where the grid has no run (a test's)."""
    try:
        run = grid.run
    except (NotImplementedError, AttributeError, RuntimeError):
        return {}
    overrides = {k: str(v) for k, v in sorted(run.override_config.items())}
    return {"fab": run.fab_hash or f"{run.fab_id}@{run.fab_version}", "overrides": overrides}


def describe_app(train_config: Mapping[str, Any], app: Mapping[str, Any]) -> str:
    """The app a verdict is of, in words: Flower's name of it (or fedlb's own settings)
    and the train config it sends, less the round number."""
    sent = ", ".join(f"{k}={v}" for k, v in sorted(train_config.items()) if k != SERVER_ROUND)
    if "settings" in app:
        settings = ", ".join(f"{k}={v}" for k, v in sorted(dict(app["settings"]).items()))
        named = f"fedlb's ServerApp ({settings})"
    else:
        overrides = dict(app.get("overrides", {}))
        named = str(app.get("fab") or "an app the grid did not name") + (
            " with " + ", ".join(f"{k}={v}" for k, v in overrides.items()) if overrides else ""
        )
    return named + (f"; sends {sent}" if sent else "")


def verdict_key(model: str, train_config: Mapping[str, Any], app: Mapping[str, Any]) -> str:
    """What a verdict is kept under: the model's layout, the train config (less the
    round number) and the app."""
    config = {k: str(v) for k, v in sorted(train_config.items()) if k != SERVER_ROUND}
    text = json.dumps([model, config, dict(app)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _kept(path: Path) -> dict[str, Any]:
    """The verdicts file's object ({} where there is none yet); StoredFileError where it
    is damaged, other OSErrors as they come."""
    try:
        return read_json_object(path, max_bytes=MAX_KEPT_BYTES)
    except FileNotFoundError:
        return {}


def _read(entry: Any) -> Remembered:
    """One kept entry; ValueError saying what is wrong where it is damaged."""
    if not isinstance(entry, dict):
        raise ValueError("not an object")
    regime, why = entry.get("regime"), entry.get("why")
    at: Any = entry.get("at")  # a JSON value: checked below
    silos: Any = entry.get("silos")
    if regime not in JUDGED:
        raise ValueError(f"regime {regime!r:.30}, not {' or '.join(JUDGED)}")
    if not is_finite_number(at) or not 0 <= at <= time.time() + AHEAD_S:
        raise ValueError(f"found at {at!r:.30}, not a time (from 1970 to a day ahead)")
    counted = is_finite_number(silos) and float(silos).is_integer() and 0 < silos <= MOST_SILOS
    return Remembered(
        str(regime),
        float(at),
        str(why or ""),
        str(entry.get("app") or ""),
        int(silos) if counted else None,
    )


def recall(key: str) -> Remembered | None:
    """The verdict kept under `key`, if one is there, readable and young enough (a
    damaged file is set aside, said once: the guard probes)."""
    path = verdicts_file()
    if path is None:
        return None
    try:
        entry = _kept(path).get(key)
    except StoredFileError as error:
        set_aside_damaged(path, error.reason, "the guard probes this run")
        return None
    except OSError as error:
        log.warning("could not read %s (%s): the guard probes this run", path, error)
        return None
    if entry is None:
        return None
    try:
        found = _read(entry)
    except ValueError as error:
        log.warning("ignoring a damaged verdict in %s (%s): the guard probes this run", path, error)
        return None
    return None if found.expired else found


def keep(key: str, found: Remembered) -> None:
    """Store `found` under `key` (atomically; a failure is said, never raised: a verdict
    only saves rounds)."""
    store_entry(VERDICTS_FILE, key, asdict(found), "keep the guard's verdict")


def verdicts_file() -> Path | None:
    """Where the verdicts are kept (None: profiles, and so verdicts, are off)."""
    folder = profile_cache_dir()
    return None if folder is None else folder / VERDICTS_FILE


def listed() -> tuple[dict[str, Remembered], dict[str, str]]:
    """Every kept verdict by key, those past the profiles' MAX_AGE_S included
    (`Remembered.expired`), and the damaged entries by key with what is wrong (the next
    run of their app probes). Raises StoredFileError where the file is damaged, other
    OSErrors where it cannot be read."""
    path = verdicts_file()
    found: dict[str, Remembered] = {}
    damaged: dict[str, str] = {}
    for key, entry in ({} if path is None else _kept(path)).items():
        try:
            found[key] = _read(entry)
        except ValueError as error:
            damaged[key] = str(error)
    return found, damaged


@dataclass(frozen=True)
class Forgotten:
    """What `forget` did: the keys dropped, or where the damaged file went."""

    keys: list[str]
    moved_to: Path | None = None  # a damaged file, renamed beside itself (forget all)
    why: str = ""  # what was wrong with it


def forget(keys: Collection[str] | None = None) -> Forgotten:
    """Drop the verdicts kept under `keys` (None: every one), so the next run of each app
    probes anew. Forgetting every one of a damaged file sets the file aside. Raises
    KeyError naming a key that is not kept, StoredFileError where the file is damaged
    and `keys` are named, and other OSErrors where it cannot be read or written."""
    path = verdicts_file()
    if path is None:
        return Forgotten([])
    try:
        kept = _kept(path)
    except StoredFileError as error:
        if keys is not None:
            raise
        return Forgotten([], set_aside(path), error.reason)
    unknown = sorted(set(keys or ()) - set(kept))
    if unknown:
        raise KeyError(", ".join(unknown))
    dropped = sorted(kept) if keys is None else sorted(set(keys))
    write_json_file(path, {k: v for k, v in kept.items() if k not in dropped})
    return Forgotten(dropped)


class VerdictMemory:
    """The strategy's side: the key of this run's app, the verdict taken up in round 1,
    and each verdict the guard reaches, kept for the next run."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.described = ""  # the app, in words, kept beside its verdict
        self.adopted: Remembered | None = None
        # the app's settings that decide how its silos train, where the ServerApp knows
        # them (fedlb's own: its run settings less where results go); else, Flower's
        # identity of the app (app_identity)
        self.app: Mapping[str, Any] | None = None

    def know(self, model: str | None, train_config: Mapping[str, Any], grid: Grid) -> None:
        """This run's key (once, before round 1; no key without the model's layout)."""
        if self.key is None and model is not None:
            app = app_identity(grid) if self.app is None else {"settings": dict(self.app)}
            self.key = verdict_key(model, train_config, app)
            self.described = describe_app(train_config, app)

    def adopt(
        self,
        guard: StabilityGuard,
        note: Callable[[str], None] | None = None,
        silos: int | None = None,
        steps_lever: bool = False,
    ) -> Remembered | None:
        """Round 1 from profiles: the guard takes up the last verdict for this app, if
        any, said in the log and to `note` (the round record's events). A verdict found
        with another number of silos a round than this run's `silos` is not taken up:
        another federation, judged anew. `steps_lever`: an app at the edge runs the steps
        lever (`Balancing(edge="steps")`), from round 1 where the silos have profiles."""
        found = None if self.key is None or guard.probe <= 0 else recall(self.key)
        if found is None:
            return None
        if found.silos is not None and silos is not None and found.silos != silos:
            text = (
                f"the stability guard does not take up the last run's verdict on this app "
                f"({found.said()}): it was found with {found.silos} silos a round, this run "
                f"has {silos}; it probes anew"
            )
            say(INFO, "%s", text)
            if note is not None:
                note(text)
            return None
        guard.adopt(found.regime)
        self.adopted = found
        if found.regime == "stable":
            then = (
                " from round 1, balanced from the stored speed profiles (an update that blows "
                "up still raises it)"
            )
        elif steps_lever:
            then = (
                ", no probe: every silo at its own batch size, the slow silos' steps cut from "
                "round 1 where every silo has a stored speed profile (else from round 2)"
            )
        else:
            then = (
                " once balancing starts, and round 1 at every silo's B0 as in a first run "
                "(no probe)"
            )
        text = (
            f"the stability guard takes up the last run's verdict on this app: "
            f"{found.said()}; every silo at least {100 * guard.floor:.0f}% of the mean "
            f"batch{then}"
        )
        # the log says how to judge the app anew; the round's table only what was taken up
        say(INFO, "%s (to probe it anew: fedlb verdicts --forget %s)", text, self.key)
        if note is not None:
            note(text)
        return found

    def after(self, verdict: Verdict, server_round: int, silos: int | None = None) -> None:
        """Keep what this round's verdict decided: the look's edge, the probe's regime,
        or the edge after a blow-up in a stable run or a collapse on trial; `silos`: how
        many trained this round."""
        if self.key is None:
            return
        if verdict.diverged and verdict.regime in JUDGED:  # before its verdict, or after
            keep(
                self.key,
                Remembered(
                    "edge",
                    time.time(),
                    f"an update blew up in round {server_round}",
                    self.described,
                    silos,
                ),
            )
        elif verdict.look == "collapsed":  # a stable verdict overturned on trial
            keep(
                self.key,
                Remembered(
                    "edge",
                    time.time(),
                    f"round {server_round}: steps fell to {verdict.growth or 0:.2f}x "
                    "after the stable verdict",
                    self.described,
                    silos,
                ),
            )
        elif verdict.stage == "look" and verdict.regime in JUDGED:  # grown: the edge
            keep(
                self.key,
                Remembered(
                    verdict.regime,
                    time.time(),
                    f"round {server_round}'s look: steps grown {verdict.growth or 0:.1f}x",
                    self.described,
                    silos,
                ),
            )
        elif verdict.stage and verdict.probe is not None and verdict.regime in JUDGED:
            # (a calm probe awaiting its confirming round is still undecided)
            how = (
                "second look"
                if verdict.second_look
                else "confirming round"
                if verdict.stage == "confirm"
                else "probe"
            )
            keep(
                self.key,
                Remembered(
                    verdict.regime,
                    time.time(),
                    f"round {server_round}'s {how}: dispersion {verdict.probe:.2f}",
                    self.described,
                    silos,
                ),
            )
