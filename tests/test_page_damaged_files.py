"""The other JSON files fedlb reads back go through fedlb.security.stored too (issue 51,
item 4): the live page's round-progress.json, an experiment's summary.json and
rounds.jsonl. Deeply nested, oversized or ill-shaped content is one line naming the file
(and line), or for the page nothing shown, never a traceback."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fedlb.cli import app
from fedlb.experiments.results import load_results
from fedlb.experiments.scenario import ScenarioError
from fedlb.flower import RUN_FILES, RoundReporter
from fedlb.page.state import PROGRESS_BYTES, PageState

DEEP = b"[" * 200_000


@pytest.mark.parametrize(
    "content",
    [
        DEEP,
        b'{"round": 3, "sent": "silo-0", "replied": {}}',  # sent not a list
        b'{"round": 3, "sent": ["silo-0"], "replied": [1, 2]}',  # replied not an object
        b'{"round": 3, "sent": ["silo-0"], "replied": {"silo-0": 1e999}}',
        b'{"round": 3, "sent": [], "replied": {}, "pad": "' + b"x" * PROGRESS_BYTES + b'"}',
    ],
    ids=["deep", "sent", "replied", "infinite", "oversized"],
)
def test_a_damaged_progress_file_shows_no_round_in_flight(tmp_path, content):
    state = PageState()
    state.start_run("fedlb server", out_dir=str(tmp_path), num_rounds=5)
    RoundReporter(tmp_path).progress(1, ["silo-0"], {"silo-0": 0.5})
    assert state.snapshot()["current"]["in_flight"] is not None
    (tmp_path / RUN_FILES.progress).write_bytes(content)
    assert state.snapshot()["current"]["in_flight"] is None


def test_reply_times_that_are_not_numbers_are_left_out(tmp_path):
    state = PageState()
    state.start_run("fedlb server", out_dir=str(tmp_path), num_rounds=5)
    (tmp_path / RUN_FILES.progress).write_text(
        json.dumps(
            {"round": 1, "sent": ["a", "b"], "replied": {"a": "[b]x[/b]", "b": 0.5}, "time": 0}
        )
    )
    assert state.snapshot()["current"]["in_flight"] == {
        "sent": ["a", "b"],
        "replied": {"b": 0.5},
        "waiting": ["a"],
    }


def experiment(folder):
    """An experiment's files as `fedlb experiment` leaves them (the scenario minimal)."""
    folder.mkdir()
    (folder / RUN_FILES.summary).write_text(json.dumps({"scenario": {"num_silos": 3}}))
    (folder / RUN_FILES.rounds).write_text("")
    return folder


@pytest.mark.parametrize(
    ("name", "content", "said"),
    [
        ("summary.json", DEEP, "summary.json is damaged (nested deeper than 32 levels)"),
        ("rounds.jsonl", b"{}\n" + DEEP + b"\n", "rounds.jsonl line 2 is not an experiment's"),
        ("rounds.jsonl", b'{"round": NaN}\n', "rounds.jsonl line 1 is not an experiment's"),
    ],
    ids=["summary.json", "rounds.jsonl", "NaN"],
)
def test_a_damaged_experiment_is_refused_in_one_line(tmp_path, name, content, said):
    folder = experiment(tmp_path / "run")
    (folder / name).write_bytes(content)
    with pytest.raises(ScenarioError) as refused:
        load_results(folder, 0.5)
    assert said in str(refused.value)
    assert str(folder / name) in str(refused.value)
    assert "\n" not in str(refused.value)
    result = CliRunner().invoke(
        app, ["experiment", "--from-results", str(folder), "--target-accuracy", "0.5"]
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "".join(said.split()) in "".join(result.output.replace("│", "").split())
