"""One fedlb run per folder at a time (issue 35): every command that writes a folder holds
an OS lock on it for its process's life. Two starts into one folder: the second is refused
at once, exit 2, naming the holder; a holder that is killed leaves nothing that blocks the
next run; the lock file is no earlier run's result."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedlb.deploy import ConfigError, check_run_folder
from fedlb.deploy.operations import SERVER_FILE, clear_run_folder
from fedlb.security import LOCK_FILE, FolderInUseError, claim_folder

FEDLB = str(Path(sys.executable).with_name("fedlb"))  # the installed command, as typed
IN_USE = "is in use by another fedlb run"


def said(output: str) -> str:
    """Output without rich's box drawing and any spaces (it wraps paths anywhere)."""
    return "".join(re.sub(r"[│╭╮╰╯─]", "", output).split())


def says(output: str, text: str) -> bool:
    return "".join(text.split()) in said(output)


def holder(folder: Path, seconds: float = 60.0) -> subprocess.Popen[str]:
    """Another process holding `folder` (it says "held" once it does)."""
    code = (
        "import sys, time; from pathlib import Path; from fedlb.security import claim_folder\n"
        "with claim_folder(Path(sys.argv[1])):\n"
        "    print('held', flush=True); time.sleep(float(sys.argv[2]))"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(folder), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_held_folder_is_refused_and_free_once_its_holder_is_killed(tmp_path):
    out = tmp_path / "out"
    other = holder(out)
    try:
        with pytest.raises(FolderInUseError) as refused, claim_folder(out):
            pass
        assert str(refused.value) == (
            f"{out} is in use by another fedlb run (pid {other.pid}, `python -c {out} 60.0` "
            f"started at {json.loads((out / LOCK_FILE).read_text())['started']}): wait for "
            "it to end or give another folder"
        )
    finally:
        other.send_signal(signal.SIGKILL)  # no clean-up of its own: the OS drops the lock
        other.wait(10)
    with claim_folder(out) as held:
        assert held == out.resolve()
        assert json.loads((out / LOCK_FILE).read_text())["pid"] != other.pid


def test_claims_nest_in_one_process_and_a_folder_made_for_nothing_goes(tmp_path):
    out = tmp_path / "new" / "run"
    with claim_folder(out), claim_folder(out):  # a command, then the function it calls
        assert (out / LOCK_FILE).exists()
    assert not out.exists()  # made for the claim and left empty: gone again
    assert (tmp_path / "new").exists()
    out.mkdir(parents=True)
    with claim_folder(out):
        pass
    assert (out / LOCK_FILE).exists()  # not made for it: kept, lock file and all


def test_the_lock_file_is_no_earlier_run_and_overwrite_keeps_it(tmp_path):
    with claim_folder(tmp_path):
        check_run_folder(tmp_path)  # only the lock: a fresh run may start
        (tmp_path / "rounds.jsonl").write_text("{}\n")
        (tmp_path / SERVER_FILE).write_text("{}")
        with pytest.raises(ConfigError, match=r"holds an earlier run \(rounds.jsonl\)"):
            check_run_folder(tmp_path)
        clear_run_folder(tmp_path)  # --overwrite
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]


@pytest.mark.parametrize(
    "command",
    [
        ["server", "--out-dir"],
        ["demo", "--out-dir"],
        ["experiment", "--rounds", "1", "--out"],
        ["cluster", "--iterations", "1", "--out"],
        ["silo", "--partition-id", "0", "--num-partitions", "1", "--workdir"],
    ],
    ids=lambda command: command[0],
)
def test_every_command_that_writes_a_folder_is_refused_a_held_one(tmp_path, command):
    """Refused at once, before anything starts or is written there: exit 2, one line."""
    from typer.testing import CliRunner

    from fedlb.cli import app

    out = tmp_path / "out"
    other = holder(out)
    try:
        result = CliRunner().invoke(app, [*command, str(out)])
    finally:
        other.kill()
        other.wait(10)
    assert result.exit_code == 2, result.output
    assert says(result.output, f"{out} {IN_USE} (pid {other.pid}, `python -c {out} 60.0`")
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]


@pytest.mark.slow
def test_two_experiments_started_together_into_one_folder(tmp_path):
    """The issue: both passed the reuse check and shared one SuperExec secret; one hung
    and failed after ~113 s. Now the second is refused at once and the first completes."""
    out = tmp_path / "out"
    command = [
        *(FEDLB, "experiment", "--silos", "2", "--speeds", "1,2", "--rounds", "1"),
        *("--local-steps", "2", "--policies", "fedavg", "--out", str(out)),
    ]
    began = time.monotonic()
    runs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    ended: dict[int, float] = {}
    try:
        while len(ended) < 2 and time.monotonic() < began + 280:
            for index, run in enumerate(runs):
                if index not in ended and run.poll() is not None:
                    ended[index] = time.monotonic() - began
            time.sleep(0.1)
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
    outputs = [run.communicate()[0] for run in runs]
    codes = [run.returncode for run in runs]
    assert sorted(codes) == [0, 2], outputs
    first, second = (0, 1) if codes[0] == 0 else (1, 0)
    refusal = outputs[second]
    assert says(refusal, f"{out} {IN_USE} (pid {runs[first].pid}, `fedlb experiment --silos 2")
    assert says(refusal, "wait for it to end or give another folder"), refusal
    assert "Traceback" not in outputs[second]
    assert ended[second] < 30, ended  # at once: imports and settings, nothing run
    assert ended[second] < ended[first]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"fedavg"}


@pytest.mark.slow
def test_a_killed_server_leaves_no_lock_behind(tmp_path):
    """`fedlb server` holds its out-dir: a second one is refused; SIGKILLed, it holds
    nothing, and the next run into that folder starts."""
    out = tmp_path / "out"
    server = [FEDLB, "server", "--port", "0", "--num-silos", "1", "--out-dir", str(out)]
    first = subprocess.Popen(server, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not started and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
            with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
                listed = json.loads((out / SERVER_FILE).read_text())["processes"]
                started = [p["pid"] for p in listed]  # its SuperLink is up
        assert started, first.communicate()[0] if first.poll() is not None else "no SuperLink"
        refused = subprocess.run(
            [*server, "--num-rounds", "3"], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 2, refused.stdout + refused.stderr
        message = refused.stderr + refused.stdout
        assert says(message, f"{out} {IN_USE} (pid {first.pid}, `fedlb server --port 0"), message
        first.kill()
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
        # what it started follows it (fedlb's guard); make sure before the next run
        leftovers = [psutil.Process(pid) for pid in started if psutil.pid_exists(pid)]
        _, alive = psutil.wait_procs(leftovers, timeout=30)
        for process in alive:
            process.kill()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == first.pid  # the file stays
    again = subprocess.run(
        [*server, "--overwrite", "--run-timeout", "2"], capture_output=True, text=True, timeout=120
    )
    output = again.stdout + again.stderr
    assert not says(output, IN_USE), output
    assert says(output, f"results in {out}"), output  # its SuperLink came up: it was free
    assert again.returncode == 1, output  # no silo joined before its --run-timeout
