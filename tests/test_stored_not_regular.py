"""Stored files that are not files (issue 56, items 4, 5 and 7): a FIFO in place of
verdicts.json, run.json, rounds.jsonl or checkpoint.npz, or checkpoint.npz linked to
/dev/urandom, hung `fedlb verdicts` and `fedlb server --resume` with no output. Each is
now one line within seconds: the real commands, as processes, and the real readers.
`fedlb verdicts` on a damaged file exits 2, as every damaged file; `--resume` of a run
that finished all its rounds is refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedlb.deploy import ConfigError
from fedlb.deploy.operations import resume_settings
from fedlb.flower import CheckpointError, load_checkpoint
from fedlb.flower.verdicts import VERDICTS_FILE
from fedlb.security import (
    DigestError,
    StoredFileError,
    check_digest,
    check_seal,
    file_digest,
    read_json,
    read_lines,
)
from tests.test_flower_resume_damage import resumed_by_the_cli, stopped_run

FEDLB = [sys.executable, "-m", "fedlb.cli"]
pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def fedlb(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A fedlb command as typed; a hang fails the test at 60 s (the import takes most)."""
    return subprocess.run(
        [*FEDLB, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "300", **(env or {})},
    )


def test_every_reader_refuses_a_fifo_and_a_device_at_once(tmp_path):
    pipe = fifo(tmp_path / "x.json")
    device = tmp_path / "random.npz"
    device.symlink_to("/dev/urandom")
    for read in (read_json, lambda p: list(read_lines(p)), check_seal, file_digest):
        with pytest.raises(StoredFileError, match="a FIFO \\(named pipe\\), not a regular file"):
            read(pipe)
        with pytest.raises(StoredFileError, match="a character device, not a regular file"):
            read(device)
    with pytest.raises(StoredFileError, match="a folder, not a regular file"):
        read_json(tmp_path)
    (tmp_path / "model.pt").write_bytes(b"x")
    fifo(tmp_path / "model.pt.sha256")
    with pytest.raises(DigestError, match="is unreadable"):
        check_digest(tmp_path / "model.pt")


def test_fedlb_verdicts_answers_a_fifo_and_a_damaged_file_with_exit_2(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    env = {"FEDLB_PROFILE_DIR": str(folder)}
    fifo(folder / VERDICTS_FILE)
    answered = fedlb("verdicts", env=env)
    assert answered.returncode == 2, answered.stdout + answered.stderr
    assert "a FIFO (named pipe), not a regular file" in answered.stdout
    assert "Traceback" not in answered.stdout + answered.stderr
    (folder / VERDICTS_FILE).unlink()
    (folder / VERDICTS_FILE).write_text("{half")
    damaged = fedlb("verdicts", env=env)
    assert damaged.returncode == 2, damaged.stdout + damaged.stderr
    assert "is damaged" in damaged.stdout


@pytest.mark.parametrize("name", ["run.json", "checkpoint.npz", "rounds.jsonl", "urandom"])
def test_resume_refuses_a_fifo_or_a_device_in_place_of_a_runs_file(tmp_path, name):
    folder = stopped_run(tmp_path / "run")
    if name == "urandom":
        (folder / "checkpoint.npz").unlink()
        (folder / "checkpoint.npz").symlink_to("/dev/urandom")
        said = "a character device, not a regular file"
    else:
        fifo(folder / name)
        said = "a FIFO (named pipe), not a regular file"
    with pytest.raises((CheckpointError, ConfigError), match="not a regular file"):
        resume_settings(folder)
    if name == "checkpoint.npz":
        with pytest.raises(CheckpointError, match="give the out-dir of a run fedlb wrote"):
            load_checkpoint(folder)
    resumed = fedlb("server", "--resume", str(folder))
    assert resumed.returncode == 2, resumed.stdout + resumed.stderr
    assert "".join(said.split()) in "".join((resumed.stdout + resumed.stderr).split())
    assert "Traceback" not in resumed.stdout + resumed.stderr


def test_resuming_a_run_that_finished_all_its_rounds_is_refused(tmp_path, monkeypatch):
    """It said "rounds 6-5 to go" and started a SuperLink."""
    from flwr.app import ArrayRecord

    from fedlb.deploy import RunConfig
    from fedlb.flower import Checkpoint, save_checkpoint

    folder = stopped_run(tmp_path / "run")
    settings = {**RunConfig().to_mapping(), "num-rounds": 5}
    save_checkpoint(folder, Checkpoint(5, 5, ArrayRecord(), {"pending": None}, settings))
    from tests.flower_fakes import record_lines
    from tests.test_flower_resume_damage import write_lines

    write_lines(folder, [line for r in range(1, 6) for line in record_lines(r)])
    with pytest.raises(ConfigError, match="nothing is left to run; give --num-rounds above 5"):
        resume_settings(folder)
    with pytest.raises(ConfigError, match="nothing is left to run"):
        resume_settings(folder, 5)
    assert resume_settings(folder, 6)[1].num_rounds == 6
    said = resumed_by_the_cli(folder, monkeypatch)
    assert "nothingislefttorun" in said
