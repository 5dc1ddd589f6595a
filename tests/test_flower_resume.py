"""Checkpoints and resume: a run stopped after a round and resumed from its checkpoint ends
exactly where an uninterrupted run does (model clock: times are modelled, so deterministic)."""

from __future__ import annotations

import json

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
from tests.flower_fakes import InProcessGrid, fedlb_app, lr_config

pytestmark = pytest.mark.usefixtures("task_identity")

SETTINGS = {"num-silos": 4, "local-steps": 3, "batch-size": 16, "evaluate-every": 2}
PROFILES = [
    SpeedProfile(400.0 / f, 0.05, trace="walk:0.3", seed=i) for i, f in enumerate((1, 2, 3, 4))
]


class CrashError(Exception):
    """The server process dying: nothing after it runs."""


class CrashingGrid(InProcessGrid):
    """Silos on the model clock; the 'server dies' when round `crash_before` would start."""

    def __init__(self, crash_before: int | None = None):
        config = RunConfig.from_mapping(SETTINGS)
        nodes = {100 + i: {"partition-id": i, "num-partitions": 4} for i in range(4)}

        def clock(context):
            return EmulatedClock("model", PROFILES[context.node_config["partition-id"]])

        super().__init__(nodes, SETTINGS, fedlb_app(clock=clock, config=config))
        if crash_before is not None:
            self.before_round[crash_before] = crash


def crash(grid):
    raise CrashError


def strategy_for(out_dir, keep_before=None):
    return LoadBalancedFedAvg(
        min_available_nodes=4,
        fraction_train=0.75,  # node sampling: the RNG's state must carry over too
        evaluate_every=2,
        evaluate_with_train=True,  # a record waits for its evaluation across the stop
        seed=7,
        balancing=Balancing(batch_size=16, local_steps=3),
        keeping=Keeping(
            reporter=RoundReporter(out_dir, keep_before=keep_before),
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
        if m.metadata.message_type == "train"
    ]


def without_measured_seconds(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        measured_keys = ("wall_s", "eval_wall_s", "server_s", "balancer_s", "server_rss_mb")
        for measured in (*measured_keys, "silo_wall_s"):
            row.pop(measured)
        row.pop("start_s", None)
    return rows


def test_a_resumed_run_ends_with_the_same_model_as_an_uninterrupted_one(tmp_path):
    config = RunConfig.from_mapping(SETTINGS)
    pool, _ = federation_data(config)
    initial = ArrayRecord(model_for(config, pool).state_dict())

    whole = CrashingGrid()
    expected = run(strategy_for(tmp_path / "whole"), whole, initial)

    stopped = CrashingGrid(crash_before=4)
    with pytest.raises(CrashError):
        run(strategy_for(tmp_path / "stopped"), stopped, initial)
    checkpoint = load_checkpoint(tmp_path / "stopped")
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
    assert "half-written line" in caplog.text
    path.write_text(whole[0] + "\nnot json\n" + whole[1] + "\n")
    with pytest.raises(ValueError, match=r"rounds.jsonl line 2 is not a round record"):
        RoundReporter(tmp_path, keep_before=3)
