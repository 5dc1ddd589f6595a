"""What an outside probe did to a stopped run's files before `fedlb server --resume`
(issue 51, items 4 and 6), each retried on real files: deeply nested JSON in server.json,
run.json, rounds.jsonl or app.json, a line of rounds.jsonl relabelled to a later round,
an extra round-99 line, `batch_size: -5`. Each is one line naming the file (and line)
and what to do, exit 2, no traceback, nothing rewritten; only lines of rounds after the
checkpoint, at the end of the file, are still dropped as written after it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from flwr.app import ArrayRecord
from typer.testing import CliRunner

import fedlb.cli.federation
from fedlb.cli import app
from fedlb.deploy import ConfigError, RunConfig
from fedlb.deploy.operations import resume_settings
from fedlb.flower import (
    Checkpoint,
    CheckpointError,
    RoundReporter,
    load_checkpoint,
    save_checkpoint,
    start_run_identity,
)
from fedlb.flower.records.rounds_file import RecordsError, resume_round_lines
from tests.flower_fakes import record_lines

DEEP = b"[" * 200_000  # RecursionError inside json, before fedlb.security.stored


def stopped_run(folder: Path, rounds_on_file: int = 3) -> Path:
    """A run of 5 rounds stopped after its checkpoint of round 3 (no record pending):
    run.json, checkpoint.npz, rounds.jsonl (2 silos a round) and server.json."""
    settings = {**RunConfig().to_mapping(), "num-rounds": 5}
    start_run_identity(folder, settings)
    save_checkpoint(folder, Checkpoint(3, 5, ArrayRecord(), {"pending": None}, settings))
    write_lines(folder, [line for r in range(1, rounds_on_file + 1) for line in record_lines(r)])
    listed = {"host": "127.0.0.1", "port": 9, "server": {"pid": 2**22 + 7, "started": 1.0}}
    (folder / "server.json").write_text(json.dumps({**listed, "processes": []}))
    return folder


def write_lines(folder: Path, lines: list[str]) -> None:
    (folder / "rounds.jsonl").write_text("".join(line + "\n" for line in lines))


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]


def resumed_by_the_cli(folder: Path, monkeypatch) -> str:
    """`fedlb server --resume FOLDER` as typed: exit 2, no traceback, every file of the
    run as it was; its output without rich's box and white space."""
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(fedlb.cli.federation, "run_server", started)
    result = CliRunner().invoke(app, ["server", "--resume", str(folder)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    return "".join(result.output.replace("│", "").split())


def flat(text: str) -> str:
    return "".join(text.split())


def deep_rounds_line(folder: Path) -> None:
    lines = (folder / "rounds.jsonl").read_bytes().split(b"\n")
    (folder / "rounds.jsonl").write_bytes(b"\n".join([lines[0], DEEP, *lines[1:]]))


NESTED = {
    "server.json": (
        lambda folder: (folder / "server.json").write_bytes(DEEP),
        "server.json is damaged (nested deeper than 32 levels)",
    ),
    "run.json": (
        lambda folder: (folder / "run.json").write_bytes(DEEP),
        "run.json is damaged (nested deeper than 32 levels)",
    ),
    "rounds.jsonl, the whole file": (
        lambda folder: (folder / "rounds.jsonl").write_bytes(DEEP),
        "rounds.jsonl line 1 is not a round record (nested deeper than 32 levels)",
    ),
    "rounds.jsonl, a line": (
        deep_rounds_line,
        "rounds.jsonl line 2 is not a round record (nested deeper than 32 levels)",
    ),
    "rounds.jsonl, the last line": (
        lambda folder: (folder / "rounds.jsonl").open("ab").write(DEEP + b"\n"),
        "rounds.jsonl line 7 is not a round record (nested deeper than 32 levels)",
    ),
    "app.json": (
        lambda folder: (folder / "app.json").write_bytes(DEEP),
        "app.json is damaged (nested deeper than 32 levels)",
    ),
}


@pytest.mark.parametrize("damage", NESTED, ids=list(NESTED))
def test_deeply_nested_json_in_a_run_file_stops_a_resume_with_one_line(
    tmp_path, monkeypatch, damage
):
    folder = stopped_run(tmp_path)
    resume_settings(folder)  # whole, it resumes
    change, message = NESTED[damage]
    change(folder)
    said = resumed_by_the_cli(folder, monkeypatch)
    assert flat(message) in said
    with pytest.raises(ConfigError) as caught:
        resume_settings(folder)
    assert "\n" not in str(caught.value)
    named = message.split(" ")[0]
    assert str(folder / named) in str(caught.value)  # the file, in full
    if named != "server.json" and named != "app.json":  # what resume_settings reads first
        with pytest.raises(CheckpointError, match="nested deeper than 32 levels"):
            load_checkpoint(folder)


def relabelled(line: int, round_: int):
    def damage(folder: Path) -> None:
        lines = (folder / "rounds.jsonl").read_text().splitlines()
        row = json.loads(lines[line - 1])
        lines[line - 1] = json.dumps({**row, "round": round_})
        write_lines(folder, lines)

    return damage


def inserted(after: int, round_: int):
    def damage(folder: Path) -> None:
        lines = (folder / "rounds.jsonl").read_text().splitlines()
        write_lines(folder, [*lines[:after], record_lines(round_)[0], *lines[after:]])

    return damage


def field_set(line: int, key: str, value):
    def damage(folder: Path) -> None:
        lines = (folder / "rounds.jsonl").read_text().splitlines()
        lines[line - 1] = json.dumps({**json.loads(lines[line - 1]), key: value})
        write_lines(folder, lines)

    return damage


REWRITES = {
    # the probe's: a line relabelled to a later round, once "written after the checkpoint"
    "relabelled to a later round": (
        relabelled(2, 3),
        "rounds.jsonl line 3 is of round 2, after line 2 of round 3: fedlb writes rounds in order",
    ),
    "relabelled past the checkpoint": (
        relabelled(4, 4),
        "rounds.jsonl line 5 is of round 3, after line 4 of round 4",
    ),
    "an extra round-99 line in the middle": (
        inserted(3, 99),
        "rounds.jsonl line 4 is of round 99, later than any a stopped server writes after "
        "its checkpoint (round 4 at most)",
    ),
    "an extra round-99 line at the end": (
        inserted(6, 99),
        "rounds.jsonl line 7 is of round 99, later than any a stopped server writes",
    ),
    "batch_size -5": (
        field_set(2, "batch_size", -5),
        "rounds.jsonl line 2 is not a round record (batch_size is -5, below 0)",
    ),
    "local_steps -1": (
        field_set(3, "local_steps", -1),
        "rounds.jsonl line 3 is not a round record (local_steps is -1, below 0)",
    ),
    "negative seconds": (
        field_set(1, "compute_s", -0.5),
        "rounds.jsonl line 1 is not a round record (compute_s is -0.5, below 0)",
    ),
    "idle fraction above 1": (
        field_set(5, "idle_fraction", 3.0),
        "rounds.jsonl line 5 is not a round record (idle_fraction is 3.0, above 1)",
    ),
}


@pytest.mark.parametrize("damage", REWRITES, ids=list(REWRITES))
def test_a_record_resume_cannot_explain_is_damage_not_dropped(tmp_path, monkeypatch, damage):
    """Before: relabelled or extra lines were "dropped ... written after the checkpoint",
    deleting a real round's record, and batch_size -5 was kept."""
    folder = stopped_run(tmp_path)
    change, message = REWRITES[damage]
    change(folder)
    said = resumed_by_the_cli(folder, monkeypatch)
    assert flat(message) in said
    assert "restorethefilefromacopy" in said or "restoreitfromacopy" in said
    before = (folder / "rounds.jsonl").read_bytes()
    with pytest.raises(RecordsError) as caught:  # the ServerApp's own reporter refuses it
        RoundReporter(folder, keep_before=4, done=3, num_rounds=5)
    assert "\n" not in str(caught.value)
    assert (folder / "rounds.jsonl").read_bytes() == before  # nothing rewritten


def test_lines_after_the_checkpoint_at_the_end_are_still_dropped_and_said(tmp_path, caplog):
    """What a stopped server can have written after its checkpoint of round 3 (round 4's
    record, published before round 4's checkpoint) goes, as said; rounds 1-3 stay."""
    folder = stopped_run(tmp_path, rounds_on_file=4)
    caplog.set_level(logging.WARNING)
    reporter = RoundReporter(folder, keep_before=4, done=3, num_rounds=5)
    assert [r.round for r in reporter.records] == [1, 2, 3]
    assert [row["round"] for row in rows(folder)] == [1, 1, 2, 2, 3, 3]
    assert "dropped the 2 lines of round 4, written after the checkpoint" in caplog.text
    assert "round 4 is run again" in caplog.text


def test_a_half_written_last_line_is_one_that_was_cut_short(tmp_path):
    """Only a last line cut short as fedlb writes them (no newline after it, beginning
    as a record does) is half-written; a whole line that is no record is damage."""
    folder = stopped_run(tmp_path)
    whole = (folder / "rounds.jsonl").read_text()
    for cut in (record_lines(4)[0][:40], "{", '{"rou'):
        (folder / "rounds.jsonl").write_text(whole + cut)
        assert resume_round_lines(folder / "rounds.jsonl", 4, 3).lines == whole.splitlines()
    for damaged in ("not json", record_lines(4)[0][:40] + "\n", '["round": 4'):
        (folder / "rounds.jsonl").write_text(whole + damaged)
        with pytest.raises(RecordsError, match="line 7 is not a round record"):
            resume_round_lines(folder / "rounds.jsonl", 4, 3)
