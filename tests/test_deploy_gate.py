"""The SuperLink's public door serves the Runtime API to loopback callers only (issue 51,
item 8): a caller on one of this machine's other addresses is refused with 403, as the
Control API is from anywhere but the control door; Flower's own SuperExec (cold
ServerApps) reaches the Runtime API at the control door instead."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from fedlb import _flower_internals as flower
from fedlb.deploy import gate
from fedlb.deploy.processes import free_port, start_superlink

# A real uvicorn server: fedlb's public door in front of an app that answers every path
DOOR = """
import sys, uvicorn
from fedlb.deploy.gate import PublicDoor

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"served"})

uvicorn.run(PublicDoor(app, 4321), host="0.0.0.0", port=int(sys.argv[1]), log_level="warning")
"""


def own_address() -> str | None:
    """One of this machine's IPv4 addresses that is not loopback (None: it has none)."""
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family == socket.AF_INET and not entry.address.startswith("127."):
                return str(entry.address)
    return None


def answer(url: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture
def door():
    """The public door on every address of this machine, on a free port: the port."""
    port = free_port("0.0.0.0")
    server = subprocess.Popen([sys.executable, "-c", DOOR, str(port)])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert server.poll() is None, "the door did not start"
            time.sleep(0.1)
        yield port
    finally:
        server.terminate()
        server.wait(10)


def test_the_runtime_api_is_refused_at_the_public_door_from_a_non_loopback_address(door):
    address = own_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    runtime = f"{flower.RUNTIME_PATH}acquire-task"
    assert answer(f"http://127.0.0.1:{door}{runtime}") == (200, b"served")
    status, body = answer(f"http://{address}:{door}{runtime}")  # this machine, not loopback
    assert status == 403
    assert "Control API listens on 127.0.0.1:4321" in json.loads(body)["detail"]
    # as the Control API is refused from anywhere, loopback included
    assert answer(f"http://127.0.0.1:{door}/v1/control/list-runs")[0] == 403
    # the silos' API and the health check pass from any address
    for host in ("127.0.0.1", address):
        assert answer(f"http://{host}:{door}{flower.FLEET_PATH}pull-messages") == (200, b"served")


def test_loopback_addresses_are_told_apart_from_the_machines_others():
    assert gate.loopback("127.0.0.1")
    assert gate.loopback("127.3.0.9")
    assert gate.loopback("::1")
    assert gate.loopback("::ffff:127.0.0.1")
    for other in ("192.0.2.2", "10.0.0.1", "::ffff:10.0.0.1", "fd00::2", "", "localhost"):
        assert not gate.loopback(other), other


def test_flowers_superexec_is_pointed_at_the_control_door(monkeypatch):
    """Flower 1.42's SuperLink starts its SuperExec against its own --host:--port: from a
    public address, a caller the public door now refuses. The gate points it at the
    control door, plain HTTP (the internals it relies on are checked here too)."""
    import importlib
    import inspect

    entry = importlib.import_module(flower.SUPERLINK_ENTRY)
    original = entry._get_superexec_command
    assert {"runtime_address", "runtime_certificates", "runtime_root_certificates_path"} <= set(
        inspect.signature(original).parameters
    )
    monkeypatch.setattr(entry, "_get_superexec_command", original)  # put back afterwards
    gate.superexec_at_control_door(5555)
    gate.superexec_at_control_door(5555)  # once is enough: not wrapped twice
    command = entry._get_superexec_command(
        runtime_address="192.0.2.2:9093",
        runtime_certificates=(b"ca", b"cert", b"key"),
        runtime_root_certificates_path="/nowhere/ca.crt",
        parent_pid=1,
        runtime_dependency_install=False,
    )
    assert command[command.index("--runtime-api-address") + 1] == "127.0.0.1:5555"
    assert "--insecure" in command
    assert "/nowhere/ca.crt" not in command


@pytest.mark.slow
def test_a_cold_superlink_starts_its_superexec_at_the_control_door(tmp_path):
    """A real SuperLink listening on every address, cold (Flower's own SuperExec): the
    SuperExec it starts calls the Runtime API at the control door on 127.0.0.1, plain,
    not at the public port."""
    link = start_superlink(tmp_path, host="0.0.0.0", warm=False)
    try:
        deadline = time.monotonic() + 30
        superexec: list[str] = []
        while not superexec and time.monotonic() < deadline:
            for child in psutil.Process(link.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    command = child.cmdline()
                    if any(Path(arg).name == "flower-superexec" for arg in command[:2]):
                        superexec = command
            time.sleep(0.2)
        assert superexec, "no SuperExec started"
        at = superexec[superexec.index("--runtime-api-address") + 1]
        assert at == f"127.0.0.1:{link.control_port}"
        assert "--insecure" in superexec
    finally:
        link.stop()
