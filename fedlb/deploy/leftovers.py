"""Processes an earlier fedlb left behind, named in its server.json: recognised by PID,
start time and command line (fedlb's guard running the SuperLink's or a SuperNode's entry
point on its own port) before anything is stopped; anything else is left alone."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from fedlb.security import cut_command

SHOWN_CHARS = 80  # of a process's command line in a message
GUARD = Path(__file__).with_name("guard.py")  # every Flower process fedlb starts runs under it


def process_start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


SUPERLINK = "SuperLink"  # the name FlowerProcess gives the SuperLink; a silo's is its own
ENTRY_POINTS = {SUPERLINK: "flower-superlink"}  # a silo's: flower-supernode


def leftover(identity: Mapping[str, Any], port: int | None = None) -> str | None:
    """Whether the process `FlowerProcess.identity()` described still runs as fedlb
    started it: None when it does; "" when no process has its PID and start time (gone);
    else why the process there is not it, in words. A PID and a start time are only
    what a file says: the process must also be fedlb's guard running the entry point
    (flower-superlink for the SuperLink, flower-supernode for a silo; fedlb's gate and
    warm launcher run them) with `--port` its own port (`port`, else the identity's)."""
    pid, started = identity.get("pid"), identity.get("started")
    if not isinstance(pid, int) or started is None or process_start_time(pid) != started:
        return ""
    port = port if port is not None else identity.get("port")
    try:
        command = _command_line(psutil.Process(pid))
    except psutil.Error as error:  # gone since, or another user's
        return "" if isinstance(error, psutil.NoSuchProcess) else "its command line is not readable"
    entry = ENTRY_POINTS.get(str(identity.get("name")), "flower-supernode")
    shown = cut_command(command, SHOWN_CHARS)
    if len(command) < 3 or not _is_guard(command[1]):
        return f"`{shown}` is no process fedlb started"
    points = [i for i, arg in enumerate(command) if Path(arg).name == entry]
    if not points:
        return f"`{shown}` runs no {entry}"
    if not isinstance(port, int) or isinstance(port, bool):  # an older file's: no port
        return f"`{shown}` is a {entry}, but no port is given to check it by"
    if not any(
        command[i + 1 : i + 2] == [str(port)]
        for i in range(points[0], len(command) - 1)
        if command[i] == "--port"
    ):
        return f"`{shown}` is a {entry}, but not on port {port}"
    return None


def _command_line(process: psutil.Process, wait_s: float = 2.0) -> list[str]:
    """The process's command line; a process caught inside exec() (just started: Linux
    shows an empty /proc/PID/cmdline for that instant) is read again until it has one."""
    deadline = time.monotonic() + wait_s
    command = process.cmdline()
    while not command and time.monotonic() < deadline and process.is_running():
        time.sleep(0.05)
        command = process.cmdline()
    return list(command)


def _is_guard(path: str) -> bool:
    try:
        return Path(path).resolve() == GUARD.resolve()
    except (OSError, RuntimeError):
        return False


def stop_leftover(
    identity: Mapping[str, Any], grace: float = 10.0, port: int | None = None
) -> bool:
    """Stop the process group `FlowerProcess.identity()` described, if its leader still
    runs as fedlb started it (`leftover`: same PID and start time, and the command line
    of its entry point on its port); whether there was one to stop. Any other process
    is left alone."""
    if leftover(identity, port) is not None:
        return False
    pid, started = int(identity["pid"]), identity.get("started")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _running(pid, started):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return True


def _running(pid: int, started: Any) -> bool:
    """Whether `pid` still runs as the process started at `started` (a zombie, ended but
    not yet reaped by its parent, does not)."""
    try:
        process = psutil.Process(pid)
        return bool(process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False
