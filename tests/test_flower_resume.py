"""Checkpoints and resume: a run stopped after a round and resumed from its checkpoint ends
exactly where an uninterrupted run does (model clock: times are modelled, so deterministic)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlb.deploy import RunConfig
from fedlb.deploy.task import federation_data, model_for
from fedlb.experiments.profiles import EmulatedClock, SpeedProfile
from fedlb.flower import (
    Balancing,
    Checkpoint,
    CheckpointError,
    Keeping,
    LoadBalancedFedAvg,
    RoundReporter,
    load_checkpoint,
    save_checkpoint,
)
from fedlb.flower.protocol import BATCH_SIZE, SERVER_ROUND
from tests.flower_fakes import InProcessGrid, fedlb_app, lr_config, record_lines

pytestmark = pytest.mark.usefixtures("task_identity")

SETTINGS = {"num-silos": 4, "local-steps": 3, "batch-size": 16, "evaluate-every": 2}
PROFILES = [
    SpeedProfile(400.0 / f, 0.05, trace="walk:0.3", seed=i) for i, f in enumerate((1, 2, 3, 4))
]


class CrashError(Exception):
    """The server process dying: nothing after it runs."""


class CrashingGrid(InProcessGrid):
    """Silos on the model clock; the 'server dies' when round `crash_before` would start."""

    def __init__(self, crash_before: int | None = None, node_ids=(100, 101, 102, 103)):
        config = RunConfig.from_mapping(SETTINGS)
        nodes = {n: {"partition-id": i, "num-partitions": 4} for i, n in enumerate(node_ids)}

        def clock(context):
            return EmulatedClock("model", PROFILES[context.node_config["partition-id"]])

        super().__init__(nodes, SETTINGS, fedlb_app(clock=clock, config=config))
        if crash_before is not None:
            self.before_round[crash_before] = crash


def crash(grid):
    raise CrashError


def strategy_for(out_dir, keep_before=None, **resumed):
    # FedAvg samples with Python's random: a fresh run starts it at a seed, a resumed one
    # takes the state its checkpoint kept (restore) whatever this seed left it at
    random.seed(7)
    return LoadBalancedFedAvg(
        min_available_nodes=4,
        fraction_train=0.75,  # node sampling: the RNG's state must carry over too
        evaluate_every=2,
        evaluate_with_train=True,  # a record waits for its evaluation across the stop
        balancing=Balancing(batch_size=16, local_steps=3),
        keeping=Keeping(
            reporter=RoundReporter(out_dir, keep_before=keep_before, **resumed),
            checkpoint_dir=out_dir,
            run_settings=SETTINGS,
        ),
    )


def run(strategy, grid, arrays, rounds=6):
    return strategy.start(
        grid=grid, initial_arrays=arrays, num_rounds=rounds, timeout=5, train_config=lr_config(0.1)
    )


def sizes_sent(grid):
    return [
        (
            m.content["config"][SERVER_ROUND],
            m.metadata.dst_node_id,
            m.content["config"][BATCH_SIZE],
        )
        for m in grid.sent
        if m.metadata.message_type == "train" and BATCH_SIZE in m.content["config"]
    ]


def without_measured_seconds(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        measured_keys = ("wall_s", "eval_wall_s", "server_s", "balancer_s", "server_rss_mb")
        for measured in (*measured_keys, "silo_wall_s"):
            row.pop(measured)
        row.pop("start_s", None)
    return rows


def whole_and_stopped(tmp_path):
    """An uninterrupted 6-round run (its grid, its Result) and one whose server died
    before round 4 (its grid, its checkpoint)."""
    config = RunConfig.from_mapping(SETTINGS)
    pool, _ = federation_data(config)
    initial = ArrayRecord(model_for(config, pool).state_dict())
    whole = CrashingGrid()
    expected = run(strategy_for(tmp_path / "whole"), whole, initial)
    stopped = CrashingGrid(crash_before=4)
    with pytest.raises(CrashError):
        run(strategy_for(tmp_path / "stopped"), stopped, initial)
    return whole, expected, stopped, load_checkpoint(tmp_path / "stopped")


def test_a_resumed_run_ends_with_the_same_model_as_an_uninterrupted_one(tmp_path):
    whole, expected, stopped, checkpoint = whole_and_stopped(tmp_path)
    assert checkpoint.round == 3
    # what the operator is told matches what rounds.jsonl holds
    rows = (tmp_path / "stopped" / "rounds.jsonl").read_text().splitlines()
    on_file = sorted({json.loads(row)["round"] for row in rows})
    story = checkpoint.story(6)
    assert story.startswith("rounds 1-3 of 6 done"), story
    assert story.endswith("rounds 4-6 to go"), story
    if on_file == [1, 2]:  # round 3's record waits in the checkpoint for its evaluation
        assert "rounds.jsonl holds rounds 1-2; round 3's record is in the checkpoint" in story
    else:
        assert on_file == [1, 2, 3]
        assert "(rounds.jsonl holds rounds 1-3)" in story
    # a half-written later round in rounds.jsonl must not survive the resume
    with (tmp_path / "stopped" / "rounds.jsonl").open("a") as handle:
        handle.write(json.dumps({"round": 3, "silo": "junk"}) + "\n")

    resumed_grid = CrashingGrid()
    resumed = strategy_for(tmp_path / "stopped", keep_before=checkpoint.first_unpublished_round)
    arrays = resumed.restore(checkpoint)
    result = run(resumed, resumed_grid, arrays)

    for key, array in expected.arrays.items():
        assert np.array_equal(array.numpy(), result.arrays[key].numpy()), key
    # Flower's loop ran the last three rounds; the Result counts them as the run's 4-6
    assert sorted(expected.train_metrics_clientapp) == [1, 2, 3, 4, 5, 6]
    assert sorted(result.train_metrics_clientapp) == [4, 5, 6]
    assert result.train_metrics_clientapp[6] == expected.train_metrics_clientapp[6]
    assert sizes_sent(stopped) + sizes_sent(resumed_grid) == sizes_sent(whole)
    assert {r for r, _, _ in sizes_sent(resumed_grid)} == {4, 5, 6}  # no round done twice
    resumed_rows = without_measured_seconds(tmp_path / "stopped" / "rounds.jsonl")
    assert resumed_rows == without_measured_seconds(tmp_path / "whole" / "rounds.jsonl")
    final = load_checkpoint(tmp_path / "stopped")
    assert final.round == 6


def test_silos_that_rejoin_a_restarted_server_under_new_node_ids_keep_their_state(tmp_path):
    """fedlb server keeps its SuperLink's state in memory: after a restart every silo
    rejoins under a new node id. The resumed run asks each newcomer its partition and
    carries the old node's balance state over to it, so the run still ends exactly where
    an uninterrupted one does (ids chosen in the same order: the sampling RNG draws from
    the sorted ids)."""
    whole, expected, _, checkpoint = whole_and_stopped(tmp_path)
    new_ids = (9_000_000_007, 9_000_000_011, 9_000_000_013, 9_000_000_017)
    resumed_grid = CrashingGrid(node_ids=new_ids)
    resumed = strategy_for(tmp_path / "stopped", keep_before=checkpoint.first_unpublished_round)
    result = run(resumed, resumed_grid, resumed.restore(checkpoint))

    for key, array in expected.arrays.items():
        assert np.array_equal(array.numpy(), result.arrays[key].numpy()), key
    old_of = dict(zip(new_ids, (100, 101, 102, 103), strict=True))
    carried = [(r, old_of[n], b) for r, n, b in sizes_sent(resumed_grid) if r >= 4]
    assert carried == [s for s in sizes_sent(whole) if s[0] >= 4]
    rows = [json.loads(line) for line in (tmp_path / "stopped" / "rounds.jsonl").open()]
    said = [e for row in rows if row["round"] == 4 for e in row.get("events", [])]
    assert any("the server restarted" in e and "silo-0 rejoined as" in e for e in said), said
    later = [e for row in rows if row["round"] >= 4 for e in row.get("events", [])]
    assert not any("joined with" in e or e.endswith(" left") for e in later), later


def test_the_checkpoint_is_replaced_atomically_and_holds_the_state(tmp_path):
    arrays = ArrayRecord({"w": _array([[1.0, 2.0]]), "b": _array([3.0])})
    first = Checkpoint(1, 5, arrays, {"manager": None, "x": [1, 2]}, {"num-rounds": 5})
    save_checkpoint(tmp_path, first)
    loaded = load_checkpoint(tmp_path)
    assert loaded.round == 1
    assert loaded.strategy == first.strategy
    assert list(loaded.arrays.keys()) == ["w", "b"]
    assert np.array_equal(loaded.arrays["w"].numpy(), [[1.0, 2.0]])
    assert loaded.arrays["w"].numpy().dtype == np.float32
    save_checkpoint(tmp_path, Checkpoint(2, 5, arrays, {}, {}))
    assert load_checkpoint(tmp_path).round == 2
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.npz"]  # no temporary left


def test_an_encrypted_model_checkpoints_as_its_ciphertexts(tmp_path):
    from fedlb.flower.he import encrypted_record
    from fedlb.he import encrypt_arrays, load_context, write_keys

    context = load_context(write_keys(tmp_path / "keys").secret, "silo")
    ciphertexts, layout = encrypt_arrays(context, {"w": np.arange(10, dtype=np.float32)})
    record = encrypted_record(ciphertexts, layout)
    save_checkpoint(tmp_path / "run", Checkpoint(1, 2, record, {}, {}))
    loaded = load_checkpoint(tmp_path / "run").arrays
    assert [a.numpy().tobytes() for a in loaded.values()] == [
        a.numpy().tobytes() for a in record.values()
    ]


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(b""),
        lambda p: p.write_bytes(p.read_bytes()[:200]),
        lambda p: p.write_bytes(b"PK\x03\x04" + bytes(300)),
    ],
)
def test_a_damaged_checkpoint_is_refused_with_the_file_named(tmp_path, damage):
    save_checkpoint(tmp_path, Checkpoint(1, 2, ArrayRecord({"w": _array([1.0])}), {}, {}))
    damage(tmp_path / "checkpoint.npz")
    with pytest.raises(CheckpointError, match=r"checkpoint\.npz is damaged"):
        load_checkpoint(tmp_path)


def test_no_checkpoint_says_what_to_give(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_checkpoint(tmp_path)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=2000))
def test_random_bytes_as_a_checkpoint_are_refused(tmp_path, data):
    (tmp_path / "checkpoint.npz").write_bytes(data)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path)


def _array(values):
    from flwr.app import Array

    return Array(np.asarray(values, dtype=np.float32))


def test_a_half_written_last_line_is_dropped_on_resume_and_said(tmp_path, caplog):
    """The server died while appending a round to rounds.jsonl: resuming keeps the whole
    lines before the checkpoint, drops the torn one (saying so) instead of failing with a
    JSONDecodeError; a damaged line before the last one is refused, naming it."""
    import json

    from fedlb.flower import RUN_FILES, RoundReporter

    empty = {"clock": "model", "round_silos": 0, "wall_s": 1.0, "round_s": None}
    empty |= {"ideal_s": None, "efficiency": None, "idle_fraction": None}
    whole = [json.dumps({"round": k, **empty}) for k in (1, 2)]
    path = tmp_path / RUN_FILES.rounds
    path.write_text("\n".join(whole) + '\n{"round": 3, "clock": "mod')
    caplog.set_level("WARNING")
    reporter = RoundReporter(tmp_path, keep_before=3)
    assert [r.round for r in reporter.records] == [1, 2]
    assert path.read_text() == "".join(line + "\n" for line in whole)
    assert "its last line (line 3, of round 3) is half-written" in caplog.text
    assert "round 3 is written again" in caplog.text  # (run again, or from the checkpoint)
    path.write_text(whole[0] + "\nnot json\n" + whole[1] + "\n")
    with pytest.raises(ValueError, match=r"rounds.jsonl line 2 is not a round record"):
        RoundReporter(tmp_path, keep_before=3)
    assert path.read_text() == whole[0] + "\nnot json\n" + whole[1] + "\n"  # left as it was


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("torn", ["before the checkpoint", "after the checkpoint"])
def test_what_resume_says_of_a_half_written_line_is_what_it_does(tmp_path, caplog, torn):
    """The server stopped while writing a line of rounds.jsonl. Of a round after the
    checkpoint: that round's lines go and the round is run again, as said. Of a round the
    checkpoint already holds (a power cut lost what the file had not yet written): the
    round is not run again, and resuming says its record stays short of that line, which
    it does; nothing else is lost."""
    config = RunConfig.from_mapping(SETTINGS)
    pool, _ = federation_data(config)
    initial = ArrayRecord(model_for(config, pool).state_dict())
    run(strategy_for(tmp_path / "whole"), CrashingGrid(), initial)
    with pytest.raises(CrashError):
        run(strategy_for(tmp_path / "stopped"), CrashingGrid(crash_before=4), initial)
    checkpoint = load_checkpoint(tmp_path / "stopped")
    assert checkpoint.round == 3
    path = tmp_path / "stopped" / "rounds.jsonl"
    whole = (tmp_path / "whole" / "rounds.jsonl").read_text().splitlines()
    stopped = [(row["round"], row["silo"]) for row in rows_of(path)]
    assert (
        stopped == [(row["round"], row["silo"]) for row in map(json.loads, whole)][: len(stopped)]
    )
    if torn == "before the checkpoint":  # round 2's last line half on disk, no later one
        ends = max(i for i, line in enumerate(whole) if json.loads(line)["round"] == 2)
        path.write_text("".join(line + "\n" for line in whole[:ends]) + whole[ends][:90])
        said = (
            "its last line (line 6, of round 2) is half-written: the server stopped while "
            "writing it; dropped it; round 2's record stays incomplete (2 of 3 silos' lines) "
            "and round 2 is not run again: the checkpoint includes it; the run goes on from "
            "its checkpoint after round 3 with rounds 4-6"
        )
    else:  # written after the checkpoint: round 3's record, then half of round 4's first line
        ends = min(i for i, line in enumerate(whole) if json.loads(line)["round"] == 4)
        path.write_text("".join(line + "\n" for line in whole[:ends]) + whole[ends][:90])
        said = (
            "its last line (line 10, of round 4) is half-written: the server stopped while "
            "writing it; dropped it and the 3 lines of round 3 before it, written after the "
            "checkpoint; round 3's record is written again from the checkpoint; round 4 is "
            "run again; the run goes on from its checkpoint after round 3 with rounds 4-6"
        )
    assert checkpoint.first_unpublished_round == 3  # round 3's record waits in it
    assert load_checkpoint(tmp_path / "stopped").round == 3  # a torn last line is no damage
    holds = "rounds 1-2 (round 2 in part)" if torn == "before the checkpoint" else "rounds 1-2"
    story = checkpoint.story(6, tmp_path / "stopped")  # what the operator reads first
    assert story.startswith(f"rounds 1-3 of 6 done (rounds.jsonl holds {holds}; round 3's")
    assert story.endswith("rounds 4-6 to go")

    caplog.set_level("WARNING")
    caplog.clear()
    resumed_grid = CrashingGrid()
    resumed = strategy_for(tmp_path / "stopped", keep_before=3, done=checkpoint.round, num_rounds=6)
    assert f"{path}: {said}" in caplog.messages
    run(resumed, resumed_grid, resumed.restore(checkpoint))

    assert {r for r, _, _ in sizes_sent(resumed_grid)} == {4, 5, 6}  # what is run, as said
    rows = rows_of(path)
    expected = rows_of(tmp_path / "whole" / "rounds.jsonl")
    if torn == "before the checkpoint":
        round_2 = [row for row in rows if row["round"] == 2]
        assert len(round_2) == 2
        assert {row["round_silos"] for row in round_2} == {3}
        expected = [row for row in expected if row["round"] != 2 or row in round_2]
    assert [(row["round"], row["silo"]) for row in rows] == [
        (row["round"], row["silo"]) for row in expected
    ]
    assert sorted({row["round"] for row in rows}) == [1, 2, 3, 4, 5, 6]


def _second_line(text):
    def damage(folder):
        path = folder / "rounds.jsonl"
        lines = path.read_bytes().split(b"\n")
        path.write_bytes(b"\n".join([lines[0], text, *lines[2:]]))

    return damage


def _without(key):
    def damage(folder):
        path = folder / "rounds.jsonl"
        lines = path.read_text().splitlines()
        row = json.loads(lines[1])
        del row[key]
        path.write_text("\n".join([lines[0], json.dumps(row), *lines[2:]]) + "\n")

    return damage


def _write(name, content):
    return lambda folder: (folder / name).write_bytes(content)


DAMAGED = {
    "not JSON": (_second_line(b"not json"), "rounds.jsonl line 2 is not a round record (not JSON"),
    "not UTF-8": (
        _second_line(b'{"round": 1, "\xff\xfe"}'),
        "rounds.jsonl line 2 is not a round record (not UTF-8",
    ),
    "no field": (_without("wall_s"), "rounds.jsonl line 2 is not a round record (no wall_s)"),
    "no silo field": (
        _without("batch_size"),
        "rounds.jsonl line 2 is not a round record (no batch_size)",
    ),
    "not an object": (
        _second_line(b"[1, 2]"),
        "rounds.jsonl line 2 is not a round record (an array, not an",
    ),
    "no round": (
        _second_line(b'{"round": "1"}'),
        "rounds.jsonl line 2 is not a round record (round is '1'",
    ),
    "run.json": (_write("run.json", b'{"run-id": "ab'), "run.json is damaged (not JSON"),
    "run.json bytes": (_write("run.json", b"\x80\x81"), "run.json is damaged (not UTF-8"),
    "server.json": (_write("server.json", b"\x00\x00"), "server.json is damaged"),
    "server.json list": (
        _write("server.json", b"[]"),
        "server.json is damaged (not a JSON object)",
    ),
    "server.json pid": (
        _write("server.json", b'{"port": 9, "processes": [{"pid": "x"}]}'),
        "server.json is damaged (a process's pid is 'x')",
    ),
}


@pytest.mark.parametrize("damage", DAMAGED, ids=list(DAMAGED))
def test_a_damaged_run_file_stops_a_resume_with_one_line_and_changes_nothing(
    tmp_path, monkeypatch, damage
):
    """Any line of rounds.jsonl before the last that is no round record, a damaged run.json
    or server.json: `fedlb server --resume` says so in one line naming the file (and the
    line) and what to do, exits 2 (a data error) with no traceback, and leaves every file
    of the run as it was."""
    from typer.testing import CliRunner

    import fedlb.cli.federation
    from fedlb.cli import app
    from fedlb.deploy import ConfigError
    from fedlb.deploy.operations import resume_settings
    from fedlb.flower import start_run_identity

    settings = {**RunConfig().to_mapping(), "num-rounds": 5}
    start_run_identity(tmp_path, settings)
    save_checkpoint(tmp_path, Checkpoint(3, 5, ArrayRecord(), {"pending": None}, settings))
    lines = [line for r in (1, 2, 3) for line in record_lines(r)]
    (tmp_path / "rounds.jsonl").write_text("".join(line + "\n" for line in lines))
    listed = {"host": "127.0.0.1", "port": 9, "server": {"pid": 2**22 + 7, "started": 1.0}}
    (tmp_path / "server.json").write_text(json.dumps({**listed, "processes": []}))
    resume_settings(tmp_path)  # whole, it resumes
    change, message = DAMAGED[damage]
    change(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(fedlb.cli.federation, "run_server", started)
    result = CliRunner().invoke(app, ["server", "--resume", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    flat = "".join(result.output.replace("│", "").split())
    assert "".join(message.split()) in flat, result.output
    with pytest.raises(ConfigError) as caught:
        resume_settings(tmp_path)
    assert "\n" not in str(caught.value)
    named = next(name for name in ("rounds.jsonl", "run.json", "server.json") if name in message)
    assert str(tmp_path / named) in str(caught.value)  # the file, in full
    assert "restore it from a copy" in str(caught.value) or "delete server.json" in str(
        caught.value
    )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_users_app_run_by_fedlbs_server_keeps_its_files_and_goes_on_after_a_stop(
    tmp_path, monkeypatch
):
    """`fedlb server --app` runs a user's ServerApp with FEDLB_RUN_DIR (and, resuming,
    FEDLB_RESUME) set: its LoadBalanced, given no reporter, writes rounds.jsonl and a
    checkpoint there, and a resumed one takes the checkpoint up by itself (the app's
    code unchanged: it passes its initial model, as always) and ends as an uninterrupted
    run does."""
    from flwr.serverapp.strategy import FedAvg

    from fedlb.flower import RUN_FILES, LoadBalanced

    config = RunConfig.from_mapping(SETTINGS)
    pool, _ = federation_data(config)
    initial = ArrayRecord(model_for(config, pool).state_dict())

    def users_app(grid: InProcessGrid, folder: Path):
        monkeypatch.setenv("FEDLB_RUN_DIR", str(folder))
        random.seed(7)
        strategy = LoadBalanced(FedAvg(min_available_nodes=4, fraction_train=0.75))
        return strategy.start(
            grid=grid, initial_arrays=initial, num_rounds=4, timeout=5, train_config=lr_config(0.1)
        )

    expected = users_app(CrashingGrid(), tmp_path / "whole")
    assert (tmp_path / "whole" / RUN_FILES.checkpoint).exists()
    summary = json.loads((tmp_path / "whole" / RUN_FILES.summary).read_text())
    assert summary["rounds"] == 4
    with pytest.raises(CrashError):
        users_app(CrashingGrid(crash_before=3), tmp_path / "stopped")
    # the server died in round 2's evaluation (FedAvg samples its silos then): round 1 is
    # the last one done
    assert load_checkpoint(tmp_path / "stopped").round == 1
    monkeypatch.setenv("FEDLB_RESUME", str(tmp_path / "stopped"))
    resumed = users_app(CrashingGrid(), tmp_path / "stopped")
    rounds = [
        json.loads(line)["round"]
        for line in (tmp_path / "stopped" / RUN_FILES.rounds).read_text().splitlines()
    ]
    assert sorted(set(rounds)) == [1, 2, 3, 4]
    for key, array in expected.arrays.items():
        assert np.array_equal(array.numpy(), resumed.arrays[key].numpy()), key
