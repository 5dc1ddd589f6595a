"""`fedlb tune`, the what-if calculator, through the real command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from fedlb.cli import app

runner = CliRunner()


def test_help_lists_the_commands():
    result = subprocess.run(
        [sys.executable, "-m", "fedlb.cli", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0
    assert "tune" in result.stdout


def test_tune_shows_the_fig8_split_and_names_its_clock():
    result = runner.invoke(app, ["tune", "--speeds", "89,21,12,6", "--rounds", "3"])
    assert result.exit_code == 0, result.output
    assert "clock: model" in result.output
    assert "89 │   21 │   12 │    6" in result.output


def test_tune_json_lines_carry_sizes_and_efficiency():
    result = runner.invoke(
        app,
        [
            "tune",
            "--speeds",
            "10,20,40",
            "--overheads",
            "2,1,0.5",
            "--iterations",
            "10",
            "--batch",
            "16",
            "--tuners",
            "proportional,deadband",
            "--rounds",
            "4",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert {r["tuner"] for r in rows} == {"proportional", "deadband"}
    assert all(r["clock"] == "model" and sum(r["sizes"].values()) == 48 for r in rows)
    last = [r for r in rows if r["tuner"] == "proportional"][-1]
    assert last["efficiency"] > 0.95
    assert rows[0]["efficiency"] < 0.5


def test_tune_gpu_curve_with_leader_straggler():
    result = runner.invoke(
        app,
        [
            "tune",
            "--speeds",
            "3000,800",
            "--curve",
            "gpu",
            "--launch",
            "0.01",
            "--saturation",
            "8",
            "--tuners",
            "leader-straggler",
            "--rounds",
            "80",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert rows[-1]["sizes"]["w0"] > rows[0]["sizes"]["w0"]


def test_tune_bad_input_says_what_is_wrong():
    cases = {
        ("--speeds", "1,x"): "--speeds must be comma-separated numbers",
        ("--speeds", "1,-2"): "--speeds must all be > 0",
        ("--speeds", "1,2", "--overheads", "1,2,3"): "--overheads has 3 values but there are 2",
        ("--speeds", "1,2", "--tuners", "magic"): "unknown tuner 'magic'",
        ("--speeds", "1,2", "--launch", "0.1"): "need --curve gpu",
        ("--speeds", "1,2", "--curve", "tpu"): "--curve must be 'linear' or 'gpu'",
        ("--speeds", "1,2", "--min-batch", "40"): "cannot divide a total of 64",
    }
    for args, message in cases.items():
        result = runner.invoke(app, ["tune", *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in " ".join(result.output.split()), (args, result.output)


@pytest.mark.parametrize("width", [80, 120])
def test_every_help_reads_without_a_sentence_broken_mid_line(width):
    """`fedlb --help` and each command's own help, at the terminal's width: every line
    of a command's text that a later line of the same paragraph follows is filled (a
    hard break in a docstring left "gloo, or NCCL with a" alone on a line)."""
    names = [c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands]
    pages = {"fedlb": runner.invoke(app, ["--help"], terminal_width=width)}
    for name in names:
        pages[name] = runner.invoke(app, [name, "--help"], terminal_width=width)
    for page, result in pages.items():
        assert result.exit_code == 0, (page, result.output)
        lines = result.output.splitlines()
        if page == "fedlb":  # the Commands panel: "│ name   text │"
            start = next(i for i, line in enumerate(lines) if "Commands" in line)
            rows = [line[2:].rstrip("│ ") for line in lines[start + 1 :] if line.startswith("│")]
            for name in names:
                assert any(row.startswith(name + " ") for row in rows), (name, rows)
            texts = [
                row[12:].strip() if row[:12].strip() == "" else row.partition(" ")[2].strip()
                for row in rows
            ]
            following = [rows[i + 1][:12].strip() == "" for i in range(len(rows) - 1)] + [False]
        else:  # the text between the usage line and the first panel
            usage = next(i for i, line in enumerate(lines) if "Usage:" in line)
            panel = next(i for i, line in enumerate(lines) if line.startswith("╭"))
            texts = [line.strip() for line in lines[usage + 1 : panel]]
            following = [bool(texts[i + 1]) for i in range(len(texts) - 1)] + [False]
        column = max((len(t) for t in texts), default=0)
        for text, more in zip(texts, following, strict=True):
            if text and more:
                assert len(text) >= 0.6 * column, (page, text)
