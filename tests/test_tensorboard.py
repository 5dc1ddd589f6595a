"""Each round's scalars as TensorBoard event files, read back with TensorBoard's own
reader: every round of a run, equal to rounds.jsonl's figures, and after a resume no
round twice."""

from __future__ import annotations

import json

import pytest
from flwr.app import ArrayRecord

from fedlb.deploy import RunConfig
from fedlb.deploy.task import federation_data, model_for
from fedlb.flower import RoundReporter, load_checkpoint
from fedlb.flower.records.tensorboard import ROUND_SCALARS, SILO_SCALARS
from tests.test_flower_resume import SETTINGS, CrashError, CrashingGrid, run, strategy_for

pytestmark = pytest.mark.usefixtures("task_identity")


def scalars(folder):
    """tag -> {step: value}, as TensorBoard reads the folder's event files; each step of
    each tag must be there once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    read = {}
    for tag in events.Tags()["scalars"]:
        steps = [event.step for event in events.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)
        read[tag] = {event.step: event.value for event in events.Scalars(tag)}
    return read


def test_every_round_is_in_the_event_files_and_a_resume_writes_no_round_twice(tmp_path):
    config = RunConfig.from_mapping(SETTINGS)
    pool, _ = federation_data(config)
    initial = ArrayRecord(model_for(config, pool).state_dict())
    out = tmp_path / "run"

    def strategy(**resumed):
        made = strategy_for(out, **resumed)
        made.rounds.reporter = RoundReporter(out, tensorboard=True, **resumed)
        return made

    with pytest.raises(CrashError):
        run(strategy(), CrashingGrid(crash_before=4), initial)
    checkpoint = load_checkpoint(out)
    resumed = strategy(keep_before=checkpoint.first_unpublished_round)
    arrays = resumed.restore(checkpoint)
    run(resumed, CrashingGrid(), arrays)
    resumed.reporter.close()

    read = scalars(out / "tensorboard")
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    rounds = sorted({row["round"] for row in rows})
    assert rounds == [1, 2, 3, 4, 5, 6]
    assert sorted(read["round/E"]) == rounds  # each round once, after the resume too
    for row in rows:
        step = row["round"]
        assert read["round/E"][step] == pytest.approx(row["efficiency"], rel=1e-6)
        assert read["round/T_round_s"][step] == pytest.approx(row["round_s"], rel=1e-6)
        assert read["round/wall_s"][step] == pytest.approx(row["wall_s"], rel=1e-6)
        silo = row["silo"]
        assert read[f"silo/{silo}/B"][step] == row["batch_size"]
        assert read[f"silo/{silo}/compute_s"][step] == pytest.approx(row["compute_s"], rel=1e-6)
        assert read[f"silo/{silo}/idle_s"][step] == pytest.approx(row["idle_s"], rel=1e-6)
        if row["accuracy"] is not None:
            assert read["model/accuracy"][step] == pytest.approx(row["accuracy"], rel=1e-6)
    silos = {row["silo"] for row in rows}
    expected = {t for t in ROUND_SCALARS if t.startswith("round/")} | {
        f"silo/{s}/{name}" for s in silos for name in ("B", "compute_s", "fixed_s", "idle_s")
    }
    assert expected <= set(read)
    assert set(SILO_SCALARS) >= {"B", "compute_s", "fixed_s", "idle_s", "wall_s", "start_s"}


def test_a_resumed_run_drops_the_rounds_the_stopped_one_wrote_after_its_checkpoint(tmp_path):
    from fedlb.flower.records import RoundRecord
    from fedlb.flower.records.tensorboard import RoundScalars

    def record(number, efficiency):
        return RoundRecord(number, "model", [], 1.0, 1.0, efficiency, 0.0, 1.0)

    stopped = RoundScalars(tmp_path)
    for number in (1, 2, 3, 4):  # rounds 3 and 4 came after its last checkpoint
        stopped.write(record(number, 0.5))
    stopped.close()
    resumed = RoundScalars(tmp_path, first_round=3)
    for number in (3, 4, 5):
        resumed.write(record(number, 0.9))
    resumed.close()
    assert scalars(tmp_path)["round/E"] == pytest.approx({1: 0.5, 2: 0.5, 3: 0.9, 4: 0.9, 5: 0.9})


def test_without_tensorboard_installed_the_run_goes_on_and_says_so(tmp_path, monkeypatch, caplog):
    import fedlb.flower.records.rounds_file as rounds_file

    monkeypatch.setattr(rounds_file, "tensorboard_installed", lambda: False)
    caplog.set_level("INFO")
    reporter = RoundReporter(tmp_path, tensorboard=True)
    assert reporter.scalars is None
    assert "tensorboard is not installed" in caplog.text
    assert "fedlb[tensorboard]" in caplog.text
    assert not (tmp_path / "tensorboard").exists()
