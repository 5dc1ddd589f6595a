"""A silo joining its server, on stand-in processes: waiting for it to join returns its
node id or says why not; start_silo starts again while its key is unknown and gives up on
a final refusal or after its timeout."""

from __future__ import annotations

import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from fedlb.deploy import silo_settings
from fedlb.deploy.processes import FlowerProcess, JoinError, free_port, wait_joined
from tests.join_helpers import CONNECTED, RETRYING, UNREGISTERED, WRONG_CA, started

# 3. waiting for it, and start_silo's retries, on stand-in processes


def stand_in(tmp_path: Path, log: str, runs: bool = True, name: str = "silo-0") -> FlowerProcess:
    """A process standing in for a SuperNode, its log already written."""
    path = tmp_path / f"{name}.log"
    path.write_text(started(log))
    command = [sys.executable, "-c", "import time; time.sleep(60)"] if runs else ["true"]
    process = subprocess.Popen(command, start_new_session=True)
    if not runs:
        process.wait()
    return FlowerProcess(name, process, path, 0)


def test_wait_joined_returns_the_node_id_or_says_why_not(tmp_path):
    nobody = f"127.0.0.1:{free_port()}"
    node = stand_in(tmp_path, CONNECTED)
    try:
        assert wait_joined(node, nobody, tls=True) == 6868470573225693217
    finally:
        node.stop()
    node = stand_in(tmp_path, UNREGISTERED)
    try:
        with pytest.raises(JoinError, match=r"refused by the server: \[code: 2004\]") as error:
            wait_joined(node, nobody, tls=True)
        assert error.value.unregistered
    finally:
        node.stop()
    with pytest.raises(JoinError, match="exited with code 0 before it connected") as error:
        wait_joined(stand_in(tmp_path, RETRYING, runs=False), nobody, tls=True)
    assert not error.value.unregistered
    said: list[str] = []
    node = stand_in(tmp_path, RETRYING)
    try:
        with pytest.raises(JoinError, match=r"not connected after 1 s: cannot reach"):
            wait_joined(node, nobody, tls=False, timeout=0.6, on_wait=said.append, every=0.2)
    finally:
        node.stop()
    assert said
    assert all("cannot reach the server" in s for s in said)


def fake_start(tmp_path: Path, logs: list[str], monkeypatch) -> list[FlowerProcess]:
    """start_silo's SuperNodes replaced: the n-th start's log is logs[n]; no sleeping."""
    import fedlb.deploy.operations as deployment

    nodes: list[FlowerProcess] = []

    def start(workdir, name, *args, **kwargs):
        nodes.append(stand_in(tmp_path, logs[len(nodes)], name=f"start-{len(nodes)}"))
        return nodes[-1]

    clock = types.SimpleNamespace(monotonic=time.monotonic, sleep=lambda s: None)
    monkeypatch.setattr(deployment, "start_supernode", start)
    monkeypatch.setattr(deployment, "time", clock)
    return nodes


def silo(tmp_path: Path):
    return silo_settings(
        None, {"partition-id": 0, "num-partitions": 2, "workdir": str(tmp_path / "silo")}
    )


def test_start_silo_starts_again_while_its_key_is_unknown(tmp_path, monkeypatch):
    from fedlb.deploy import start_silo

    nodes = fake_start(tmp_path, [UNREGISTERED, UNREGISTERED, CONNECTED], monkeypatch)
    said: list[str] = []
    node = start_silo(silo(tmp_path), 60, on_wait=said.append)
    try:
        assert node is nodes[2]
        assert node.alive()
        assert not nodes[0].alive()
        assert not nodes[1].alive()
        assert len(said) == 2
        assert all("waiting for the server to register this silo's key" in s for s in said)
        assert "trying again in 2 s" in said[0]
        assert "trying again in 4 s" in said[1]
    finally:
        node.stop()


def test_start_silo_gives_up_on_a_final_refusal_and_after_its_timeout(tmp_path, monkeypatch):
    from fedlb.deploy import start_silo

    nodes = fake_start(tmp_path, [WRONG_CA, CONNECTED], monkeypatch)
    with pytest.raises(JoinError, match="CERTIFICATE_VERIFY_FAILED"):
        start_silo(silo(tmp_path), 60)
    assert len(nodes) == 1
    assert not nodes[0].alive()
    nodes = fake_start(tmp_path, [UNREGISTERED, CONNECTED], monkeypatch)
    with pytest.raises(JoinError, match="does not know this silo's key"):
        start_silo(silo(tmp_path), 1)  # no time left for a second try
    assert len(nodes) == 1
    assert not nodes[0].alive()
