"""`--resume` stops only what it started (issue 51, item 5): a process server.json names is
stopped only when its command line is the one fedlb started it with (its guard running
flower-superlink or flower-supernode) on its own port; a `sleep` whose PID and start
time a damaged server.json gives is left alone, and that is said. An address that is not
this machine's is said so, not "port in use"."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedlb.deploy import ConfigError
from fedlb.deploy.errors import DeployError
from fedlb.deploy.operations import SERVER_FILE, stop_left_behind
from fedlb.deploy.processes import FlowerProcess, check_port_free, free_port, leftover

SLEEP = "import time; time.sleep(60)"


def sleep_60() -> subprocess.Popen:
    """A `sleep 60`, once it is one (right after the fork it is still this process)."""
    sleeper = subprocess.Popen(["sleep", "60"])
    deadline = time.monotonic() + 10
    while psutil.Process(sleeper.pid).cmdline() != ["sleep", "60"]:
        assert time.monotonic() < deadline, "sleep did not start"
        time.sleep(0.01)
    return sleeper


def identity_of(process: subprocess.Popen, name: str, port: int | None = None) -> dict:
    """What server.json says of a process: its name, PID, start time (and port)."""
    found = {"name": name, "pid": process.pid, "started": psutil.Process(process.pid).create_time()}
    return found if port is None else {**found, "port": port}


def listed(folder: Path, processes: list[dict], port: int = 9) -> None:
    server = {"pid": 2**22 + 7, "started": 1.0}  # the stopped server: gone
    (folder / SERVER_FILE).write_text(
        json.dumps({"host": "127.0.0.1", "port": port, "server": server, "processes": processes})
    )


def test_a_sleep_named_in_server_json_survives_the_resumes_stop_step(tmp_path, caplog):
    """The probe's: a damaged server.json naming a `sleep 60` (its PID and start time) as
    the SuperLink got it stopped. Now it is left alone, and the log says so."""
    sleeper = sleep_60()
    try:
        listed(tmp_path, [identity_of(sleeper, "SuperLink", 9)])
        caplog.set_level(logging.WARNING)
        stop_left_behind(tmp_path)
        assert sleeper.poll() is None  # still running
        said = [r.getMessage() for r in caplog.records if str(sleeper.pid) in r.getMessage()]
        assert said == [
            f"left alone pid {sleeper.pid}, which server.json names as SuperLink: `sleep 60` "
            "is no process fedlb started"
        ]
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_a_guarded_process_is_stopped_only_as_the_entry_point_on_its_port(tmp_path, caplog):
    """fedlb's guard running something that is not flower-superlink, or flower-superlink
    on another port than server.json's, is left alone; the same on its port is stopped."""
    port = free_port()
    started: list[FlowerProcess] = []

    def guarded(*command: str) -> FlowerProcess:
        process = FlowerProcess.start(
            "SuperLink",
            [sys.executable, "-c", SLEEP, *command],
            tmp_path / f"home-{len(started)}",
            tmp_path / f"{len(started)}.log",
            port,
        )
        started.append(process)
        return process

    try:
        other = guarded()  # fedlb's guard, but no SuperLink
        elsewhere = guarded("flower-superlink", "--port", str(port + 1))
        link = guarded("flower-superlink", "--insecure", "--port", str(port))
        assert str(leftover(other.identity())).endswith("runs no flower-superlink")
        assert "not on port" in str(leftover(elsewhere.identity()))
        assert leftover(link.identity()) is None
        listed(tmp_path, [p.identity() for p in started], port)
        caplog.set_level(logging.WARNING)
        stop_left_behind(tmp_path)
        assert link.process.wait(15) is not None  # stopped
        assert other.alive()
        assert elsewhere.alive()
        assert f"stopped SuperLink (pid {link.pid})" in caplog.text
        assert f"left alone pid {other.pid}, which server.json names as SuperLink" in caplog.text
        assert f"is a flower-superlink, but not on port {port}" in caplog.text
        assert leftover(link.identity()) == ""  # gone: nothing to stop twice
    finally:
        for process in started:
            process.stop()


def test_a_live_process_named_as_the_server_refuses_the_resume_showing_what_it_is(tmp_path):
    sleeper = sleep_60()
    try:
        (tmp_path / SERVER_FILE).write_text(
            json.dumps({"server": identity_of(sleeper, "server"), "processes": []})
        )
        with pytest.raises(ConfigError) as refused:
            stop_left_behind(tmp_path)
        assert f"still runs (pid {sleeper.pid}, `sleep 60`" in str(refused.value)
        assert "if it is not, server.json is stale: delete it" in str(refused.value)
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_an_address_that_is_not_this_machines_is_said_so():
    """The probe's `"host": "8.8.8.8"` in server.json was "port ... is in use"."""
    with pytest.raises(DeployError) as refused:
        check_port_free("8.8.8.8", 9092, "the SuperLink")
    message = str(refused.value)
    assert message.startswith("the SuperLink cannot listen on 8.8.8.8:9092: 8.8.8.8 is not an ")
    assert "address of this machine" in message
    assert "in use" not in message
    assert "Give --host one of its own addresses" in message
    with pytest.raises(DeployError, match=r"no-such-host\.invalid is not an address"):
        check_port_free("no-such-host.invalid", 9092, "the SuperLink")


@pytest.mark.slow
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_the_superlink_and_silos_fedlb_starts_are_recognised_by_their_command_lines(tmp_path, warm):
    """What `--resume` must still stop: a real SuperLink and a real silo as fedlb starts
    them, warm (fedlb's launcher) or cold (Flower's console scripts), on their ports."""
    from fedlb.deploy.processes import launch_supernode, start_superlink

    started: list[FlowerProcess] = []
    try:
        link = start_superlink(tmp_path, warm=warm)
        started.append(link)
        silo = launch_supernode(
            tmp_path, "silo-0", f"127.0.0.1:{link.port}", {"partition-id": 0}, warm=warm
        )
        started.append(silo)
        assert leftover(link.identity(), link.port) is None
        assert leftover(silo.identity()) is None
        assert "not on port" in str(leftover(link.identity(), link.port + 1))
        assert "not on port" in str(leftover({**silo.identity(), "port": silo.port + 1}))
        # a silo named as the SuperLink is no SuperLink
        assert "runs no flower-superlink" in str(leftover({**silo.identity(), "name": "SuperLink"}))
    finally:
        for process in started:
            process.stop()
