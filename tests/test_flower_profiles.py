"""Round 1 balanced from the silos' stored speed profiles (fedlb.flower.profiles): the
store, the query, and Flower's quickstart run twice."""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import replace

import pytest
import torch
from flwr.app import Context, RecordDict

from fedlb.data import profile_cache_dir
from fedlb.flower import Balancing, LoadBalancedFedAvg
from fedlb.flower.profiles import (
    MAX_AGE_S,
    SiloProfile,
    load_profile,
    read_profile,
    save_profile,
    seen_before,
)
from tests.apps.adopt import adopt, app_config, imported
from tests.dropin_helpers import balance_lines
from tests.flower_fakes import InProcessGrid

MACHINE = {"cpu": "x", "cores": 2, "threads": 1, "device": "auto", "emulated-speed": 100.0}


def profile(**changes) -> SiloProfile:
    values = {
        "speed": 100.0,
        "overhead_s": 0.1,
        "batch_size": 32,
        "local_steps": 12,
        "measured_at": time.time(),
    }
    return SiloProfile(**{**values, **changes})


def test_a_profile_is_found_only_for_the_same_silo_model_and_hardware(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    save_profile("silo-0", "model-a", MACHINE, profile())
    assert load_profile("silo-0", "model-a", MACHINE) == profile(
        measured_at=load_profile("silo-0", "model-a", MACHINE).measured_at
    )
    assert load_profile("silo-1", "model-a", MACHINE) is None
    assert load_profile("silo-0", "model-b", MACHINE) is None
    assert load_profile("silo-0", "model-a", {**MACHINE, "threads": 2}) is None
    (stored,) = (tmp_path / "profiles").glob("profile-*.json")
    assert stored.stat().st_mode & 0o777 == 0o600  # a silo's own figures
    save_profile("silo-0", "model-a", MACHINE, profile(measured_at=time.time() - MAX_AGE_S - 1))
    assert load_profile("silo-0", "model-a", MACHINE) is None  # too old to trust
    stored.write_text("{half a profile")
    assert load_profile("silo-0", "model-a", MACHINE) is None  # unreadable: ignored
    monkeypatch.setenv("FEDLB_PROFILE_DIR", "off")
    assert profile_cache_dir() is None
    save_profile("silo-0", "model-a", MACHINE, profile())  # off: nothing stored, no error
    assert load_profile("silo-0", "model-a", MACHINE) is None


def test_a_profile_of_a_run_whose_id_is_above_2_to_the_63_loads(tmp_path, monkeypatch):
    """Flower's run ids are unsigned 64-bit: half of them are above 2**63 (a demo's
    profile was once ignored as damaged for it)."""
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    save_profile("silo-0", "model-a", MACHINE, profile(run_id=17_224_456_789_012_345_678))
    assert load_profile("silo-0", "model-a", MACHINE).run_id == 17_224_456_789_012_345_678
    with pytest.raises(ValueError, match="run id"):
        SiloProfile.checked(100.0, 0.1, 32, 12, time.time(), run_id=2**64)


@pytest.mark.usefixtures("task_identity")
def test_a_malformed_answer_is_no_profile():
    from flwr.app import Message, MessageType, MetricRecord

    from fedlb.flower.profiles import profile_query, profile_reply

    query = Message(profile_query("m"), message_type=MessageType.TRAIN, dst_node_id=1)
    answer = read_profile(profile_reply(query, profile(), 2))
    assert answer is not None
    found, partition = answer
    assert (found.speed, found.batch_size, found.local_steps, partition) == (100.0, 32, 12, 2)
    assert found.age_s < 5
    assert read_profile(profile_reply(query, None, 2)) is None  # no profile
    for bad in ({"fedlb.profile-speed": -1.0}, {"fedlb.profile-batch": 0}):
        reply = profile_reply(query, profile(), 2)
        metrics: MetricRecord = reply.content["metrics"]  # type: ignore[assignment]
        metrics.update(bad)
        assert read_profile(reply) is None


def run_quickstart(app, rounds, caplog, profiles=True, overrides=None, guard=True):
    """Flower's quickstart on 3 silos of speeds 400:200:100 (model clock), its run config
    `overrides` set; its balance lines."""
    nodes = {
        10 + i: {
            "partition-id": i,
            "num-partitions": 3,
            "emulated-speed": speed,
            "emulated-clock": "model",
        }
        for i, speed in enumerate((400.0, 200.0, 100.0))
    }
    config = app_config(
        app, **{"num-server-rounds": rounds, "fraction-evaluate": 0.0, **(overrides or {})}
    )
    init = LoadBalancedFedAvg.__init__

    def with_profiles(self, *args, **kwargs):
        balancing = replace(kwargs.get("balancing", Balancing()), profiles=profiles)
        balancing = balancing if guard else replace(balancing, guard=False)
        init(self, *args, **{**kwargs, "balancing": balancing})

    caplog.clear()
    LoadBalancedFedAvg.__init__ = with_profiles  # type: ignore[method-assign]
    try:
        with imported(app) as modules:
            grid = InProcessGrid(nodes, config, modules["client_app"].app)
            torch.manual_seed(0)
            modules["server_app"].main(grid, Context(1, 0, {}, RecordDict(), config))
    finally:
        LoadBalancedFedAvg.__init__ = init  # type: ignore[method-assign]
    return balance_lines(caplog.text), caplog.text


@pytest.mark.slow  # trains the quickstart 4 times: ~30 s on 2 busy cores
@pytest.mark.usefixtures("task_identity")
def test_a_federation_that_ran_before_starts_balanced(tmp_path, monkeypatch, caplog):
    """Flower's quickstart with the drop-in, unguarded (with a guard, round 1 starts from
    profiles only where the app was found stable: test_flower_verdicts): the first run's
    round 1 at B0; a second run asks its silos for their profiles and runs round 1 at the
    sizes round 2 had; a profile the measurement contradicts is said to be stale; without
    profiles, B0 again."""
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO")
    app, _ = adopt("quickstart_pytorch", tmp_path)

    first, _ = run_quickstart(app, 2, caplog, guard=False)
    assert {b for b, _, _ in first[1].values()} == {32}  # nothing known yet: every B0
    balanced = {silo: after for silo, (_, after, _) in first[1].items()}
    assert len(set(balanced.values())) == 3
    assert len(list((tmp_path / "profiles").glob("profile-*.json"))) == 3

    second, log = run_quickstart(app, 1, caplog, guard=False)
    assert "round 1 balanced from the silos' stored speed profiles" in log
    assert {silo: b for silo, (b, _, _) in second[1].items()} == balanced
    assert "stale" not in log

    for path in (tmp_path / "profiles").glob("profile-*.json"):  # the silos got 3x faster
        stored = json.loads(path.read_text())
        path.write_text(json.dumps({**stored, "speed": stored["speed"] / 3}))
    _, log = run_quickstart(app, 1, caplog, guard=False)
    assert log.count("stored speed profile was stale") == 3

    third, log = run_quickstart(app, 1, caplog, profiles=False, guard=False)
    assert {b for b, _, _ in third[1].values()} == {32}
    assert seen_before(next(iter(json.loads((tmp_path / "profiles/models-seen.json").read_text()))))


ABSURD = {"speed": 1e300, "inf": float("inf"), "nan": float("nan"), "negative": -5.0, "zero": 0.0}


@pytest.mark.parametrize("speed", ABSURD.values(), ids=list(ABSURD))
def test_an_absurd_stored_speed_is_a_damaged_profile_said_once(
    tmp_path, monkeypatch, caplog, speed
):
    """A stored speed no silo can have (1e300, negative, 0 samples/s) is ignored, with one
    line naming the file and the figure, written short (never 300 digits); one JSON cannot
    hold as a number (inf, NaN) makes the file damaged, set aside; the silo's next round's
    measurement replaces either."""
    from fedlb.flower import profiles

    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    monkeypatch.setattr(profiles, "_SAID_DAMAGED", set())
    save_profile("silo-0", "model-a", MACHINE, profile())
    (path,) = (tmp_path / "profiles").glob("profile-*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "speed": speed}))
    caplog.set_level("WARNING")
    assert load_profile("silo-0", "model-a", MACHINE) is None
    assert load_profile("silo-0", "model-a", MACHINE) is None  # read every round, said once
    (line,) = caplog.messages
    if math.isfinite(speed):
        assert f"ignoring the speed profile {path} (speed" in line
        assert "samples/s" in line
        assert path.exists()
    else:
        assert f"set aside the damaged {path} as {path.name}.damaged-" in line
        assert "not a finite number" in line
        assert not path.exists()
    assert max(map(len, re.findall(r"\d+", line))) < 25  # no giant number
    profiles.record_round("silo-0", "model-a", MACHINE, 1, profile())  # replaced
    assert load_profile("silo-0", "model-a", MACHINE).speed == 100.0


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("speed", ABSURD.values(), ids=list(ABSURD))
def test_an_absurd_speed_a_silo_sends_is_no_profile(speed, caplog):
    from flwr.app import Message, MessageType, MetricRecord

    from fedlb.flower.profiles import profile_query, profile_reply

    query = Message(profile_query("m"), message_type=MessageType.TRAIN, dst_node_id=1)
    reply = profile_reply(query, profile(), 2)
    metrics: MetricRecord = reply.content["metrics"]  # type: ignore[assignment]
    metrics["fedlb.profile-speed"] = speed
    caplog.set_level("WARNING")
    assert read_profile(reply) is None
    (line,) = caplog.messages
    assert "sent a damaged speed profile (speed" in line
    assert max(map(len, re.findall(r"\d+", line))) < 25


@pytest.mark.usefixtures("task_identity")
def test_a_run_with_a_damaged_profile_starts_at_b0_and_says_so(tmp_path, monkeypatch, caplog):
    """One silo's stored speed reads 1e300 samples/s: round 1 is not 'balanced from
    stored profiles'; it runs at every silo's B0, as the log says, and the damaged file
    is named and then replaced by the round's measurement."""
    from fedlb.flower import profiles

    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    monkeypatch.setattr(profiles, "_SAID_DAMAGED", set())
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO")
    app, _ = adopt("quickstart_pytorch", tmp_path)
    run_quickstart(app, 2, caplog, guard=False)
    damaged = sorted((tmp_path / "profiles").glob("profile-*.json"))[0]
    damaged.write_text(json.dumps({**json.loads(damaged.read_text()), "speed": 1e300}))

    sizes, log = run_quickstart(app, 1, caplog, guard=False)
    assert {b for b, _, _ in sizes[1].values()} == {32}  # every silo's B0, as said:
    assert "round 1 at every silo's B0: 1 of 3 silos have no usable stored speed" in log
    assert f"ignoring the speed profile {damaged} (speed 1e+300 samples/s" in log
    assert "balanced from the silos' stored speed profiles" not in log
    assert "stale" not in log
    assert max(map(len, re.findall(r"\d+", log))) < 25  # no 300-digit number anywhere
    assert 0 < json.loads(damaged.read_text())["speed"] < 1e9  # measured afresh


HUGE = 2**24  # the probe's B0 and τ: round 1 sent sizes of 1.4 M and 14 M


@pytest.mark.parametrize(
    ("figures", "reason"),
    [
        ({"batch_size": HUGE, "local_steps": HUGE}, "batch size 1.68e+07, not in [1, 65536]"),
        ({"local_steps": HUGE}, "local steps 1.68e+07, not in [1, 65536]"),
        ({"batch_size": 2**16, "local_steps": 2**16}, "more than 1.67772e+07"),  # B0·τ
        ({"speed": 1e-4}, "3.84e+06 s of compute, more than 1e+06"),  # 384 samples
        ({"batch_size": 32.5}, "batch size 32.5, not a whole number"),
    ],
    ids=["2^24", "steps", "samples", "slow", "fraction"],
)
@pytest.mark.usefixtures("task_identity")
def test_a_profile_beyond_what_a_silo_runs_is_ignored_with_its_reason(
    tmp_path, monkeypatch, caplog, figures, reason
):
    """Issue 51, item 2: a stored or replied profile of B0 = τ = 2^24 was taken, round 1
    sent sizes of 1.4 M and 14 M and every silo missed its timeout. A profile's figures
    are bounded (MAX_BATCH, MAX_STEPS, B0·τ ≤ MAX_SAMPLES, its compute at its speed ≤
    MOST_SECONDS of compute): beyond them it is ignored, with one line saying why."""
    from flwr.app import Message, MessageType, MetricRecord

    from fedlb.flower import profiles
    from fedlb.flower.profiles import profile_query, profile_reply

    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(tmp_path / "profiles"))
    monkeypatch.setattr(profiles, "_SAID_DAMAGED", set())
    caplog.set_level("WARNING")
    save_profile("silo-0", "model-a", MACHINE, profile())
    (path,) = (tmp_path / "profiles").glob("profile-*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), **figures}))
    assert load_profile("silo-0", "model-a", MACHINE) is None
    (line,) = caplog.messages
    assert f"ignoring the speed profile {path} (" in line
    assert reason in line
    assert path.exists()  # figures, not damage: the silo's next round replaces them

    caplog.clear()  # the same figures in a silo's answer to the server's query
    query = Message(profile_query("m"), message_type=MessageType.TRAIN, dst_node_id=1)
    reply = profile_reply(query, profile(), 2)
    metrics: MetricRecord = reply.content["metrics"]  # type: ignore[assignment]
    sent = {"speed": "fedlb.profile-speed", "batch_size": "fedlb.profile-batch"}
    for name, value in figures.items():
        metrics[sent.get(name, "fedlb.profile-steps")] = value
    assert read_profile(reply) is None
    (line,) = caplog.messages
    assert "sent a damaged speed profile (" in line
    assert reason in line


def test_the_largest_profile_a_silo_runs_is_taken():
    taken = SiloProfile.checked(1e6, 0.1, 2**16, 2**8, time.time())
    assert (taken.batch_size, taken.local_steps) == (2**16, 2**8)


def set_aside_files(folder):
    return sorted(p.name for p in folder.glob("*.damaged-*"))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[" * 200_000 + "]" * 200_000, "400000 bytes, more than the 65536"),
        ("[" * 30_000 + "]" * 30_000, "nested deeper than 32 levels"),
        ("{half a profile", "not JSON"),
        ('{"speed": "fast"}', "no overhead_s, batch_size, local_steps, measured_at"),
        (None, "speed 'fast', not a number"),  # every field, one of them text
        ("[1, 2]", "not a JSON object"),
    ],
    ids=["200k-deep", "30k-deep", "half", "missing", "text", "array"],
)
def test_a_damaged_profile_is_set_aside_once_and_the_silo_goes_on_without(
    tmp_path, monkeypatch, caplog, text, reason
):
    """Issue 51, item 4: a profile of 200 k `[` made its silo fail every round with
    RecursionError, for good. A damaged profile file is renamed beside itself, said once
    with its new name; the silo has no profile, and its next round stores a new one."""
    from fedlb.flower import profiles

    folder = tmp_path / "profiles"
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(folder))
    monkeypatch.setattr(profiles, "_SAID_DAMAGED", set())
    caplog.set_level("WARNING")
    save_profile("silo-0", "model-a", MACHINE, profile())
    (path,) = folder.glob("profile-*.json")
    if text is None:
        text = json.dumps({**json.loads(path.read_text()), "speed": "fast"})
    path.write_text(text)
    assert load_profile("silo-0", "model-a", MACHINE) is None
    assert load_profile("silo-0", "model-a", MACHINE) is None  # every round: said once
    (moved,) = set_aside_files(folder)
    assert moved.startswith(f"{path.name}.damaged-")
    assert (folder / moved).read_text() == text  # nothing lost
    (line,) = caplog.messages
    assert f"set aside the damaged {path} as {moved} (" in line
    assert reason in line
    assert "next train round measures it afresh" in line
    profiles.record_round("silo-0", "model-a", MACHINE, 1, profile())
    assert load_profile("silo-0", "model-a", MACHINE).speed == 100.0


def test_a_huge_profile_is_refused_without_reading_it(tmp_path, monkeypatch, caplog):
    """Issue 51, item 4: a 1 GB profile cost 2.4 GB of memory to read. Its size alone
    refuses it (a sparse file here: no disk spent), before it is opened."""
    from pathlib import Path

    from fedlb.flower import profiles

    folder = tmp_path / "profiles"
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(folder))
    monkeypatch.setattr(profiles, "_SAID_DAMAGED", set())
    caplog.set_level("WARNING")
    save_profile("silo-0", "model-a", MACHINE, profile())
    (path,) = folder.glob("profile-*.json")
    with path.open("r+b") as file:
        file.truncate(2**30)
    opened = []
    real_open = Path.open

    def watched(self, *args, **kwargs):
        opened.append(self)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", watched)
    assert load_profile("silo-0", "model-a", MACHINE) is None
    assert path not in opened
    (moved,) = set_aside_files(folder)
    assert (folder / moved).stat().st_size == 2**30
    (line,) = caplog.messages
    assert f"({2**30} bytes, more than the {profiles.MAX_PROFILE_BYTES}" in line


def test_the_servers_damaged_files_are_set_aside_and_written_anew(tmp_path, monkeypatch, caplog):
    """models-seen.json (and the verdicts, kept the same way) damaged: set aside once,
    said with the new name; the server goes on as if it were absent and writes it anew."""
    from fedlb.flower.profiles import SEEN_FILE, remember_model

    folder = tmp_path / "profiles"
    monkeypatch.setenv("FEDLB_PROFILE_DIR", str(folder))
    caplog.set_level("WARNING")
    folder.mkdir()
    (folder / SEEN_FILE).write_text("[" * 200_000)
    assert not seen_before("model-a")
    (moved,) = set_aside_files(folder)
    assert f"set aside the damaged {folder / SEEN_FILE} as {moved}" in caplog.text
    assert "round 1 runs at every silo's B0" in caplog.text
    remember_model("model-a")
    assert seen_before("model-a")
    (folder / SEEN_FILE).write_text('{"model-a": 1e999}')
    remember_model("model-b")  # the damaged file set aside, the new one holds model-b
    assert len(set_aside_files(folder)) == 2
    assert seen_before("model-b")
    assert not seen_before("model-a")
    assert caplog.text.count("set aside the damaged") == 2
