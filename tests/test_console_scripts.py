"""Flower's console scripts found as a user's shell finds them (fedlb.deploy.console_scripts):
this Python's folder first, then PATH; the log says which file runs; a clear error where
none is found. The field report: Flower installed with `pip install --target DIR`, its
scripts in DIR/bin on PATH, and a cold silo failed at once (../shared/notes)."""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest

from fedlb.deploy import console_scripts, processes
from fedlb.deploy.console_scripts import MissingScriptError, console_script, find_script
from fedlb.deploy.errors import DeployError

REAL_BIN = Path(console_scripts.bin_dir())  # this venv's, where the real scripts are
COLD_SILO = ("flower-supernode", "flower-superexec", "flwr-clientapp")


def shim(folder: Path, name: str, marker: Path) -> Path:
    """`name` in `folder`: notes that it ran, then runs the real one."""
    path = folder / name
    path.write_text(f'#!/bin/sh\necho "{name} $$" >> "{marker}"\nexec "{REAL_BIN / name}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """This Python's folder without Flower's scripts (a `pip install --target` or system
    install), and PATH a shell would have: a folder of scripts, then the rest."""
    empty = tmp_path / "python-bin"
    empty.mkdir()
    monkeypatch.setattr(console_scripts, "bin_dir", lambda: empty)
    monkeypatch.setattr(processes, "bin_dir", lambda: empty)
    monkeypatch.setattr(console_scripts, "_SAID", set())  # a fresh process's log: said once
    scripts = tmp_path / "target" / "bin"
    scripts.mkdir(parents=True)
    monkeypatch.setenv("PATH", f"{scripts}{os.pathsep}/usr/bin{os.pathsep}/bin")
    return scripts


def test_this_pythons_own_script_comes_before_one_on_path(tmp_path, monkeypatch):
    assert (REAL_BIN / "flower-supernode").is_file()  # the venv the tests run in has it
    other = tmp_path / "other"
    other.mkdir()
    shim(other, "flower-supernode", tmp_path / "ran")
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{os.environ['PATH']}")
    assert find_script("flower-supernode") == REAL_BIN / "flower-supernode"


def test_a_cold_silo_runs_flowers_scripts_from_path(elsewhere, tmp_path, caplog):
    """bin_dir has none; PATH has them: the silo's SuperNode runs the one on PATH (and it
    starts Flower's SuperExec from PATH too), and the log says which file runs."""
    marker = tmp_path / "ran"
    for name in COLD_SILO:
        shim(elsewhere, name, marker)
    caplog.set_level(logging.INFO, logger="fedlb.flower")
    node = processes.launch_supernode(
        tmp_path / "procs", "silo-0", f"127.0.0.1:{processes.free_port()}", {"partition-id": 0}
    )
    try:
        processes.supernode_ready(node)  # its local API answers: it runs
        assert node.command[0] == str(elsewhere / "flower-supernode")
        deadline = time.monotonic() + 30  # the SuperNode starts its SuperExec from PATH
        while "flower-superexec" not in (marker.read_text() if marker.exists() else ""):
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.1)
    finally:
        node.stop()
    ran = marker.read_text()
    assert "flower-supernode" in ran
    said = [r.getMessage() for r in caplog.records]
    for name in COLD_SILO:
        line = f"fedlb runs Flower's {name} from {elsewhere / name} (found on PATH)"
        assert said.count(line) == 1, said
    # once per process: a second silo says nothing new
    second = processes.launch_supernode(
        tmp_path / "procs", "silo-1", f"127.0.0.1:{processes.free_port()}", {"partition-id": 1}
    )
    second.stop()
    assert [r.getMessage() for r in caplog.records].count(line) == 1


def test_no_script_anywhere_is_one_clear_error_before_anything_starts(elsewhere, tmp_path):
    shim(elsewhere, "flower-supernode", tmp_path / "ran")  # the SuperNode, but not its helpers
    with pytest.raises(MissingScriptError) as refused:
        processes.launch_supernode(tmp_path / "procs", "silo-0", "127.0.0.1:9", {})
    message = str(refused.value)
    assert "`flower-superexec`, `flwr-clientapp` not found (silo silo-0 runs cold)" in message
    assert "flower-supernode" not in message.split("not found")[0]
    for advice in ("nor on PATH", "pip install", "DIR/bin"):
        assert advice in message
    assert isinstance(refused.value, DeployError)  # the CLI's one-line errors
    assert not (tmp_path / "procs" / "silo-0.log").exists()  # nothing started
    with pytest.raises(MissingScriptError, match=r"console script `flwr` not found"):
        console_script("flwr")


def test_a_cold_server_is_refused_without_flowers_helpers(elsewhere, tmp_path):
    """A cold SuperLink starts flower-superexec and flwr-serverapp by name from PATH at
    each run: missing, it is refused at start, not at the first run."""
    with pytest.raises(MissingScriptError, match=r"`flower-superexec`, `flwr-serverapp`"):
        processes.start_superlink(tmp_path / "procs", warm=False)
    assert not (tmp_path / "procs" / "superlink.log").exists()


@pytest.mark.slow
def test_a_warm_silo_needs_no_console_script(elsewhere, tmp_path, caplog):
    """The warm path runs Flower's entry points inside fedlb's own processes: with no
    Flower script anywhere, a warm SuperNode still starts, and the log says what runs."""
    caplog.set_level(logging.INFO, logger="fedlb.flower")
    node = processes.start_supernode(
        tmp_path / "procs",
        "silo-0",
        f"127.0.0.1:{processes.free_port()}",
        {"partition-id": 0},
        warm=True,
    )
    try:
        assert node.alive()
    finally:
        node.stop()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "fedlb runs Flower's flower-supernode inside fedlb's own process" in said
