"""Round 1 balanced from the silos' stored speed profiles (fedlb.flower.profiles): the
store, the query, and Flower's quickstart run twice."""

from __future__ import annotations

import json
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
from tests.flower_fakes import InProcessGrid
from tests.test_flower_dropin import balance_lines

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
    """A stored speed no silo can have (1e300, inf, NaN, negative, 0 samples/s) is a
    damaged profile: ignored, with one line naming the file and the figure, written
    short (never 300 digits); the silo's next round's measurement replaces it."""
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
    assert f"ignoring the damaged speed profile {path} (speed" in line
    assert "samples/s" in line
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
    assert f"ignoring the damaged speed profile {damaged} (speed 1e+300 samples/s" in log
    assert "balanced from the silos' stored speed profiles" not in log
    assert "stale" not in log
    assert max(map(len, re.findall(r"\d+", log))) < 25  # no 300-digit number anywhere
    assert 0 < json.loads(damaged.read_text())["speed"] < 1e9  # measured afresh
