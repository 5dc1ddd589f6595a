"""The stability guard's verdict kept for the next run of the same app
(fedlb.flower.verdicts): the guard taking one up, the store, and Flower's quickstart run
twice."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from fedlb.balance import StabilityGuard, Verdict
from fedlb.cli import app as cli
from fedlb.cli.common import console
from fedlb.flower.verdicts import (
    VERDICTS_FILE,
    Remembered,
    VerdictMemory,
    keep,
    recall,
    verdict_key,
)
from fedlb.flower.verdicts import listed as kept_verdicts
from tests.apps.adopt import adopt
from tests.balance_guard_helpers import EQUAL, UNEQUAL
from tests.test_flower_profiles import run_quickstart

runner = CliRunner()


def test_a_guard_that_takes_up_a_stable_verdict_balances_fully_and_still_watches():
    guard = StabilityGuard()
    guard.adopt("stable")
    assert (guard.regime, guard.floor) == ("stable", 0.25)
    # no probe: the rounds after are not judged again, however scattered ...
    verdict = guard.check({"a": 1.0, "b": 2.0, "c": 0.5}, None, UNEQUAL)
    assert (verdict.probe, verdict.regime, verdict.floor) == (None, "stable", 0.25)
    # ... but a blow-up at a small batch still raises the floor (one at a large batch,
    # its peers calm, is that silo's own: left out, nothing moves)
    verdict = guard.check({"a": 1.0, "b": 1.1, "c": 9.0}, None, UNEQUAL)
    assert (verdict.look, verdict.floor) == ("lone", 0.25)
    verdict = guard.check({"a": 9.0, "b": 1.1, "c": 1.0}, None, UNEQUAL)
    assert (verdict.look, verdict.floor) == ("diverged", 0.5)


def test_a_guard_that_takes_up_the_edge_runs_uniform_sizes_without_a_probe():
    guard = StabilityGuard()
    guard.adopt("edge")
    calm = {"a": 1.0, "b": 1.0, "c": 1.0}
    for _ in range(3):  # a calm round that would have been a probe changes nothing
        verdict = guard.check(calm, None, UNEQUAL)
        assert (verdict.probe, verdict.regime, verdict.floor) == (None, "edge", 1.0)
    fixed = StabilityGuard(probe=0.0)  # a fixed floor takes nothing up
    fixed.adopt("stable")
    assert (fixed.regime, fixed.floor) == ("fixed", 0.5)
    with pytest.raises(ValueError, match="'stable' or 'edge'"):
        guard.adopt("undecided")


def test_a_verdict_is_kept_per_model_train_config_and_app(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    app = {"fab": "abc", "overrides": {}}
    key = verdict_key("model-a", {"lr": 0.1, "server-round": 3}, app)
    assert key == verdict_key("model-a", {"server-round": 1, "lr": 0.1}, app)  # round: no
    others = [
        verdict_key("model-b", {"lr": 0.1}, app),
        verdict_key("model-a", {"lr": 0.03}, app),
        verdict_key("model-a", {"lr": 0.1}, {"fab": "edited", "overrides": {}}),
        verdict_key("model-a", {"lr": 0.1}, {**app, "overrides": {"batch-size": "64"}}),
    ]
    assert len({key, *others}) == 5
    assert recall(key) is None
    keep(key, Remembered("stable", time.time(), "round 2's probe: dispersion 0.05"))
    found = recall(key)
    assert found is not None
    assert found.regime == "stable"
    assert "round 2's probe" in found.said()
    assert "0.0 h ago" in found.said()
    assert all(recall(other) is None for other in others)
    path = tmp_path / "profiles" / VERDICTS_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    keep(key, Remembered("edge", time.time() - 40 * 24 * 3600, "old"))
    assert recall(key) is None  # older than a profile may be: ignored


def test_a_damaged_store_is_ignored_and_said(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    path = tmp_path / "profiles" / VERDICTS_FILE
    path.parent.mkdir()
    path.write_text("{half a file")
    assert recall("k") is None
    assert f"set aside the damaged {path} as {VERDICTS_FILE}.damaged-" in caplog.text
    assert not path.exists()  # so said once: the run goes on as if there were none
    keep("k", Remembered("edge", time.time(), "x"))  # written anew
    assert recall("k").regime == "edge"
    path.write_text(json.dumps({"k": {"regime": "calm", "at": time.time()}}))
    assert recall("k") is None
    path.write_text(json.dumps({"k": {"regime": "stable", "at": float("nan")}}))
    assert recall("k") is None  # NaN is no JSON number: the file is damaged, set aside
    assert caplog.text.count("set aside the damaged") == 2
    path.write_text(json.dumps({"k": "stable"}))
    assert recall("k") is None
    assert caplog.text.count("ignoring a damaged verdict") == 2
    monkeypatch.setenv("FEDLB_PROFILE_DIR", "off")
    keep("k", Remembered("stable", time.time(), "x"))  # off: nothing kept, no error
    assert recall("k") is None


def test_the_memory_keeps_decided_verdicts_only(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    memory = VerdictMemory()
    memory.key = "k"
    guard = StabilityGuard()
    even = {"a": 1.0, "b": 1.05, "c": 0.95}
    memory.after(guard.check(even, None, EQUAL), 1)
    assert recall("k") is None  # undecided
    calm = guard.check({"a": 1.3, "b": 1.3, "c": 1.4}, None, UNEQUAL)  # calm, not clearly
    assert (calm.look, calm.regime) == ("calm", "undecided")
    memory.after(calm, 2)
    assert recall("k") is None  # awaiting its confirming round
    memory.after(guard.check({"a": 1.3, "b": 1.35, "c": 1.4}, None, UNEQUAL), 3)
    found = recall("k")
    assert found is not None
    assert found.regime == "stable"
    assert found.why.startswith("round 3's confirming round: dispersion")
    memory.after(guard.check({"a": 1.3, "b": 1.35, "c": 1.4}, None, UNEQUAL), 4)
    assert recall("k").why == found.why  # later rounds judge nothing
    memory.after(guard.check({"a": 1.3, "b": 1.35, "c": 19.0}, None, UNEQUAL), 5)
    assert (recall("k").regime, recall("k").why) == ("edge", "an update blew up in round 5")
    memory.key = None  # no key (no model layout, profiles off): nothing kept
    memory.after(Verdict(regime="stable", stage="probe", probe=0.01), 2)


@pytest.mark.slow  # trains the quickstart 4 times: ~17 s on 2 busy cores
@pytest.mark.usefixtures("task_identity")
def test_a_second_run_of_a_stable_app_balances_fully_from_round_1(tmp_path, monkeypatch, caplog):
    """Flower's quickstart at η = 0.03 (stable there on every seed measured): the first
    run probes and keeps its verdict; the second starts from the stored profiles and takes
    it up, at full balance in round 1. At η = 0.1 (the edge on every seed measured) a
    first run looks again (found at the edge by its steps' growth, no probe); the next
    takes up the edge and runs the steps lever from round 1, from the stored profiles:
    every silo at its own B0, the slow silos' steps cut, no look, no probe."""
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO")
    app, _ = adopt("quickstart_pytorch", tmp_path)

    first, log = run_quickstart(app, 3, caplog, overrides={"learning-rate": 0.03})
    assert "the stability guard's probe" in log
    kept = json.loads((tmp_path / "profiles" / VERDICTS_FILE).read_text())
    ((_, verdict),) = kept.items()
    assert verdict["regime"] == "stable", log
    floor_sizes = {silo: after for silo, (_, after, _) in first[1].items()}  # at the floor

    second, log = run_quickstart(app, 1, caplog, overrides={"learning-rate": 0.03})
    assert "takes up the last run's verdict on this app: stable" in log
    assert "the stability guard's probe" not in log
    sizes = {silo: b for silo, (b, _, _) in second[1].items()}
    slowest = min(sizes, key=sizes.__getitem__)
    assert sizes[slowest] < floor_sizes[slowest]  # below the floor: full balance

    third, log = run_quickstart(app, 2, caplog, overrides={"learning-rate": 0.1})
    assert "takes up the last run's verdict" not in log  # another app setting: judged anew
    assert {b for b, _, _ in third[1].values()} == {32}  # round 1 at B0, as a first run's
    assert "the stability guard's look: at the edge of stability" in log
    assert "the stability guard's probe" not in log  # no smaller batch tried

    fourth, log = run_quickstart(app, 2, caplog, overrides={"learning-rate": 0.1})
    assert "takes up the last run's verdict on this app: edge" in log
    assert "the stability guard's probe" not in log
    assert "the stability guard's look" not in log
    assert "round 1 balanced from the silos' stored speed profiles" in log
    assert {b for b, _, _ in fourth[1].values()} == {32}  # at the edge: round 1 at B0 ...
    assert fourth[1]["silo-2"][2] < fourth[1]["silo-0"][2]  # ... the slow silo's steps cut
    assert {b for b, _, _ in fourth[2].values()} == {32}  # ... and so in every round

    # the user's view: both verdicts listed with the app in words; forgetting the edge's
    # makes the next run at η = 0.1 probe again
    monkeypatch.setattr(console, "width", 300)
    kept = json.loads((tmp_path / "profiles" / VERDICTS_FILE).read_text())
    assert sorted(v["regime"] for v in kept.values()) == ["edge", "stable"]
    assert sorted(v["app"].rsplit("; ", 1)[-1] for v in kept.values()) == [
        "sends lr=0.03",
        "sends lr=0.1",
    ]
    listed = runner.invoke(cli, ["verdicts"])
    assert listed.exit_code == 0, listed.output
    assert all(key in listed.output for key in kept)
    (edge,) = [k for k, v in kept.items() if v["regime"] == "edge"]
    assert f"fedlb verdicts --forget {edge}" in log  # the log says how
    forgotten = runner.invoke(cli, ["verdicts", "--forget", edge])
    assert forgotten.exit_code == 0, forgotten.output
    _, log = run_quickstart(app, 2, caplog, overrides={"learning-rate": 0.1})
    assert "takes up the last run's verdict" not in log
    assert "the stability guard's look" in log  # judged anew


def test_a_verdict_found_with_another_number_of_silos_is_not_taken_up(
    tmp_path, monkeypatch, caplog
):
    """A federation that gained or lost silos is another federation: its guard probes."""
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    caplog.set_level("INFO")
    memory = VerdictMemory()
    memory.key = "k"
    memory.after(Verdict(regime="stable", stage="probe", probe=0.03), 2, silos=3)
    assert recall("k").silos == 3
    events: list[str] = []
    guard = StabilityGuard()
    assert memory.adopt(guard, events.append, silos=5) is None
    assert guard.regime == "undecided"  # a first run's: B0, then the probe
    assert "found with 3 silos a round, this run has 5" in events[0]
    assert memory.adopt(guard, events.append, silos=3).regime == "stable"
    assert guard.regime == "stable"
    keep("old", Remembered("edge", time.time(), "x"))  # kept before silos were: any count
    memory.key = "old"
    assert memory.adopt(StabilityGuard(), None, silos=7).regime == "edge"


def test_the_verdicts_command_lists_forgets_and_says_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.setattr(console, "width", 300)  # a wide terminal: each row on one line
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    assert "No verdicts kept" in runner.invoke(cli, ["verdicts"]).output
    keep("k1", Remembered("stable", time.time() - 7200, "round 2's probe: dispersion 0.05", "a"))
    keep("k2", Remembered("edge", time.time() - 40 * 24 * 3600, "an update blew up", "b"))
    listed = runner.invoke(cli, ["verdicts"])
    assert listed.exit_code == 0, listed.output
    assert "2.0 h ago" in listed.output
    assert "too old: ignored" in listed.output
    missing = runner.invoke(cli, ["verdicts", "--forget", "k9"])
    assert missing.exit_code == 2
    assert "no verdict is kept under k9" in missing.output
    assert runner.invoke(cli, ["verdicts", "--forget", "k1", "--forget-all"]).exit_code == 2
    assert runner.invoke(cli, ["verdicts", "--forget", "k1"]).exit_code == 0
    assert recall("k1") is None
    found, damaged = kept_verdicts()
    assert set(found) | set(damaged) == {"k2"}
    path = tmp_path / "profiles" / VERDICTS_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    path.write_text("{half")
    damaged = runner.invoke(cli, ["verdicts"])
    assert damaged.exit_code == 2  # as every damaged file (issue 56, item 5)
    assert "--forget-all" in damaged.output
    assert runner.invoke(cli, ["verdicts", "--forget-all"]).exit_code == 0  # set aside
    assert not path.exists()
    path.write_text(json.dumps({"k3": "stable"}))
    assert "damaged verdict k3 (not an object)" in runner.invoke(cli, ["verdicts"]).output
    assert runner.invoke(cli, ["verdicts", "--forget-all"]).exit_code == 0
    assert kept_verdicts() == ({}, {})
    monkeypatch.setenv("FEDLB_PROFILE_DIR", "off")
    assert "off" in runner.invoke(cli, ["verdicts"]).output


def test_fedlbs_own_runs_keep_a_verdict_across_out_dirs_and_seeds():
    """fedlb's ServerApp keys its verdicts on the settings that decide how silos train:
    the next run of the same federation (a new out-dir, another seed, more rounds) takes
    the verdict up; another learning rate or batch size does not."""
    from fedlb.deploy import RunConfig

    def key(**settings):
        memory = VerdictMemory()
        memory.app = RunConfig(**settings).training_settings()
        memory.know("model-a", {"learning-rate": 0.05}, grid=None)  # type: ignore[arg-type]
        return memory.key

    first = key(out_dir="runs/a", seed=0, num_rounds=8)
    assert first == key(out_dir="runs/b", seed=3, num_rounds=20, tensorboard=0, profiles=1)
    assert first != key(out_dir="runs/a", learning_rate=0.1)
    assert first != key(out_dir="runs/a", batch_size=64)
    assert first != key(out_dir="runs/a", partition="dirichlet:0.5")


def test_a_process_is_pointed_at_a_profiles_folder_without_touching_its_environment(
    tmp_path, monkeypatch
):
    """An experiment points each reused process at its run's folder; the environment is
    left alone (setenv in a running process races its other threads' getenv)."""
    import os

    from fedlb.data import cache, profile_cache_dir, use_profile_dir

    monkeypatch.setattr(cache, "_profile_dir", None)  # restored after the test
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "env"))
    assert profile_cache_dir() == tmp_path / "env"
    use_profile_dir(str(tmp_path / "run"))
    assert profile_cache_dir() == tmp_path / "run"
    assert os.environ["FEDLB_PROFILE_DIR"] == str(tmp_path / "env")
    keep("k", Remembered("stable", time.time(), "x"))
    assert (tmp_path / "run" / VERDICTS_FILE).exists()
    use_profile_dir("")  # none: nothing stored or read
    assert profile_cache_dir() is None
    assert recall("k") is None


DEEP = "[" * 200_000 + "]" * 200_000  # the probe's: the ServerApp exited 201, the run failed


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (DEEP, "nested deeper than 32 levels"),
        ('{"k": ' + "[" * 30_000 + "]" * 30_000 + "}", "nested deeper than 32 levels"),
        ('{"k": {"regime": "stable", "at": 1e999}}', "not a finite number"),
        ("[]", "not a JSON object"),
    ],
    ids=["200k-deep", "30k-deep", "1e999", "array"],
)
def test_a_damaged_verdicts_file_is_set_aside_and_the_run_probes(
    tmp_path, monkeypatch, caplog, text, reason
):
    """Issue 51, item 4: the server's round 1 reads the verdicts file; a damaged one is
    renamed beside itself, said once with its new name, and the guard probes as if there
    were none; the next verdict is written to a new file."""
    folder = tmp_path / "profiles"
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(folder))
    folder.mkdir()
    path = folder / VERDICTS_FILE
    path.write_text(text)
    caplog.set_level("WARNING")
    assert recall("k") is None
    assert recall("k") is None
    (moved,) = folder.glob(f"{VERDICTS_FILE}.damaged-*")
    assert moved.read_text() == text  # nothing lost
    (line,) = caplog.messages
    assert f"set aside the damaged {path} as {moved.name} (" in line
    assert reason in line
    assert "the guard probes this run" in line
    keep("k", Remembered("stable", time.time(), "round 2's probe"))
    assert recall("k").regime == "stable"


def test_a_verdict_found_at_no_time_is_a_damaged_entry(tmp_path, monkeypatch, caplog):
    """`at` is time.time() when the verdict was reached: 1e308 and -1e18 made `fedlb
    verdicts` fail (a traceback; "Value too large for defined data type"), and one far
    ahead would never grow old. Each is a damaged entry: ignored, the others kept."""
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    keep("good", Remembered("stable", time.time() - 60, "round 2's probe"))
    path = tmp_path / "profiles" / VERDICTS_FILE
    kept = json.loads(path.read_text())
    for key, at in {"big": 1e308, "negative": -1e18, "ahead": time.time() + 3 * 24 * 3600}.items():
        kept[key] = {**kept["good"], "at": at}
    path.write_text(json.dumps(kept))
    caplog.set_level("WARNING")
    for key in ("big", "negative", "ahead"):
        assert recall(key) is None
    assert caplog.text.count("ignoring a damaged verdict") == 3
    assert "not a time" in caplog.text
    assert recall("good").regime == "stable"
    assert path.exists()  # the file is sound: its damaged entries stay, listed as such


def test_fedlb_verdicts_lists_what_it_can_and_says_what_is_damaged(tmp_path, monkeypatch):
    """`fedlb verdicts` on damaged entries (at 1e308, -1e18, a key and an app holding
    rich markup): the sound ones listed, each damaged one in one line, no traceback."""
    monkeypatch.setattr(console, "width", 300)
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    markup = "[/x][bold]k"
    keep(markup, Remembered("stable", time.time() - 7200, "dispersion [/x]", "app [red]"))
    path = tmp_path / "profiles" / VERDICTS_FILE
    kept = json.loads(path.read_text())
    kept["big"] = {**kept[markup], "at": 1e308}
    kept["negative [/x]"] = {**kept[markup], "at": -1e18}
    path.write_text(json.dumps(kept))
    listed = runner.invoke(cli, ["verdicts"])
    assert listed.exit_code == 0, listed.output
    assert listed.exception is None
    assert markup in listed.output  # the key, literally: it can be copied into --forget
    assert "dispersion [/x]" in listed.output
    assert "app [red]" in listed.output
    lines = [line for line in listed.output.splitlines() if "damaged verdict" in line]
    assert lines == [
        "damaged verdict big (found at 1e+308, not a time (from 1970 to a day ahead)): "
        "ignored, the next run of its app probes",
        "damaged verdict negative [/x] (found at -1e+18, not a time (from 1970 to a day "
        "ahead)): ignored, the next run of its app probes",
    ]
    forgotten = runner.invoke(cli, ["verdicts", "--forget", markup, "--forget", "big"])
    assert forgotten.exit_code == 0, forgotten.output
    assert set(json.loads(path.read_text())) == {"negative [/x]"}


@pytest.mark.parametrize(
    "text", [DEEP, "{half", '{"k": {"at": 1e999}}'], ids=["deep", "half", "inf"]
)
def test_fedlb_verdicts_on_a_damaged_file_says_so_and_forget_all_sets_it_aside(
    tmp_path, monkeypatch, text
):
    """The probe: `fedlb verdicts` gave a traceback on 200 k `[`; on a damaged file its
    error advised --forget-all, which refused with the same error. The listing says in one
    line that the file is damaged; --forget KEY cannot read it, and says to use
    --forget-all; --forget-all sets it aside and says where."""
    monkeypatch.setattr(console, "width", 300)
    folder = tmp_path / "profiles"
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(folder))
    folder.mkdir()
    path = folder / VERDICTS_FILE
    path.write_text(text)
    for args in (["verdicts"], ["verdicts", "--forget", "k"]):
        said = runner.invoke(cli, args)
        assert said.exit_code == 2  # a damaged file (issue 56, item 5)
        assert said.exception is None or isinstance(said.exception, SystemExit)
        (line,) = said.output.strip().splitlines()
        assert line.startswith(f"{path} is damaged (")
        assert "`fedlb verdicts --forget-all` sets it aside" in line
    done = runner.invoke(cli, ["verdicts", "--forget-all"])
    assert done.exit_code == 0, done.output
    (moved,) = folder.glob(f"{VERDICTS_FILE}.damaged-*")
    assert not path.exists()
    assert moved.read_text() == text
    said = " ".join(done.output.split())
    assert f"{path} was damaged (" in said
    assert f"set aside as {moved.name}; the next run of each app probes again" in said
    assert "No verdicts kept" in runner.invoke(cli, ["verdicts"]).output
