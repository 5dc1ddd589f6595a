"""What an outside probe broke (issue 18), each reproduced and guarded, for a run's round
records: a run that trained nothing, or fewer rounds than asked, is a failure; each round
is shown once; runs compared on the wall clock; the round table and older records read."""

from __future__ import annotations

import json

from fedlb.deploy import RunOutcome
from fedlb.deploy.federation import RoundWatcher
from fedlb.flower import records_from_json_lines
from tests.reliability_helpers import record


# ---- a run that trained nothing, or fewer rounds than asked, is a failure -----------------
def test_rounds_without_updates_are_on_record_and_fail_the_run(tmp_path):
    lost = record(2, silos=False, failed=["node-7: ClientApp raised: std::bad_alloc"])
    lines = record(1).json_lines() + lost.json_lines()
    back = records_from_json_lines(lines, complete_only=True)
    assert [r.round for r in back] == [1, 2]
    assert back[1].silos == []
    assert back[1].failed == lost.failed
    outcome = RunOutcome("1", "finished:completed", back, num_rounds=2)
    assert not outcome.ok
    assert "std::bad_alloc" in outcome.problem
    short = RunOutcome("1", "finished:completed", [record(1)], num_rounds=3)
    assert not short.ok
    assert "[2, 3]" in short.problem
    assert RunOutcome("1", "finished:completed", [record(2)], first_round=2, num_rounds=2).ok
    assert "ended as finished:failed" in RunOutcome("1", "finished:failed").problem


def test_the_round_watcher_shows_each_of_this_runs_rounds_once(tmp_path):
    path = tmp_path / "rounds.jsonl"
    path.write_text("".join(line + "\n" for k in (1, 2, 3) for line in record(k).json_lines()))
    watcher = RoundWatcher(path, first_round=3)  # a resume after round 2
    assert [r.round for r in watcher.poll()] == [3]
    path.write_text("".join(line + "\n" for k in (1, 2) for line in record(k).json_lines()))
    assert watcher.poll() == []  # trimmed by the resume: nothing new
    with path.open("a") as handle:
        handle.write("".join(line + "\n" for line in record(4).json_lines()))
    assert [r.round for r in watcher.poll()] == [4]
    assert watcher.poll() == []


def test_runs_side_by_side_on_the_wall_clock():
    """`fedlb demo --compare`'s table: the time to the accuracy both runs reached."""
    from rich.console import Console

    from fedlb.flower import compare_runs
    from fedlb.flower.records.record import wall_to

    def run(walls, accuracies):
        records = []
        for number, (wall, accuracy) in enumerate(zip(walls, accuracies, strict=True), 1):
            r = record(number)
            r.wall_s, r.accuracy = wall, accuracy
            records.append(r)
        return records

    fedavg = run([20.0, 20.0, 20.0, 20.0], [0.3, 0.6, 0.7, 0.8])
    fedlb = run([12.0, 12.0, 12.0, 12.0], [0.3, 0.5, 0.7, 0.85])
    assert wall_to(fedavg, 0.8) == 80.0
    assert wall_to(fedlb, 0.8) == 48.0
    assert wall_to(fedlb, 0.9) is None
    console = Console(width=200, record=True)
    console.print(compare_runs({"FedAvg": fedavg, "fedlb": fedlb, "none": []}))
    text = console.export_text()
    assert "the same accuracy: 0.800" in text
    assert "1.67x" in text  # 80 s against 48 s


def test_a_long_reason_does_not_wrap_the_round_table_one_word_per_row():
    """Issue 35: a silo's reason for sending no update filled the round table's silo
    column, one word per row. The table names the silo; the reason follows it, whole
    (the record as it prints itself: fedlb server's console and the ServerApp's log)."""
    from rich.console import Console

    reason = (
        "node-5021877373327894310: ClientApp raised ValueError: /data/hospital-3.npz: x and "
        "y differ in length (100 samples and 99 labels): give one label per sample"
    )
    console = Console(record=True, width=100)
    console.print(record(4, failed=[reason]))
    lines = console.export_text().splitlines()
    below = next(i for i, line in enumerate(lines) if "no update:" in line)
    table = lines[:below]
    assert [line.split()[:2] for line in table if "node-" in line] == [
        ["node-5021877373327894310", "–"]
    ]
    assert not [line for line in table if "ClientApp" in line or "labels" in line]
    assert " ".join(" ".join(lines[below:]).split()) == f"no update: {reason}"


def test_rounds_written_before_the_timeline_fields_still_read():
    line = json.loads(record(1).json_lines()[0])
    for key in ("start_s", "silo_wall_s"):
        line.pop(key)
    (back,) = records_from_json_lines([json.dumps(line)])
    assert back.silos[0].start_s is None
    assert back.silos[0].wall_s is None
