"""A silo joining its server, on real processes: `fedlb silo` against one TLS SuperLink
with SuperNode authentication says "joined" only once its SuperNode has connected, says
why when it was refused or could not reach the server (exit 1), exits 1 when its
SuperNode dies and 0 when stopped, waits for a key not registered yet, rejoins a
restarted server, and says on its console why its ClientApp failed."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import psutil
import pytest

from fedlb.deploy.federation import Federation
from fedlb.security import make_certificates, make_silo_key

# 4. real processes: `fedlb silo` against a TLS SuperLink that checks silo keys


class Silo:
    """`fedlb silo` in the background, its output collected line by line."""

    def __init__(self, workdir: Path, address: str, *args: str) -> None:
        command = [sys.executable, "-m", "fedlb.cli", "silo", "--server", address]
        command += ["--partition-id", "0", "--num-partitions", "2", "--threads", "1"]
        self.workdir = workdir
        self.process = subprocess.Popen(
            [*command, "--workdir", str(workdir), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def said(self) -> str:
        return " ".join("".join(self.lines).split())

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.said and time.monotonic() < deadline:
            assert self.process.poll() is None or self.reader.is_alive(), self.said
            time.sleep(0.2)
        assert text in self.said, self.said

    def end(self, timeout: float = 60) -> int:
        code = self.process.wait(timeout)
        self.reader.join(10)
        return code

    def supernode(self) -> psutil.Process:
        below = psutil.Process(self.process.pid).children(recursive=True)
        return next(p for p in below if "flower-supernode" in " ".join(p.cmdline()))


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """A TLS SuperLink admitting the keys silo-a, silo-b and silo-c; `late` and `stranger` have
    keys it does not know."""
    root = tmp_path_factory.mktemp("join")
    tls = make_certificates(root / "certs", ["127.0.0.1"])
    names = ("silo-a", "silo-b", "silo-c", "late", "stranger")
    keys = {n: make_silo_key(root / "keys", n) for n in names}
    with Federation(
        root / "procs", tls=tls, silo_keys=[keys[n][1] for n in ("silo-a", "silo-b", "silo-c")]
    ) as running:
        yield types.SimpleNamespace(
            link=running,
            root=root,
            tls=tls,
            keys=keys,
            other=make_certificates(root / "other-ca", ["127.0.0.1"]),
        )


@pytest.mark.slow
def test_refused_and_unreachable_silos_say_why_and_exit_1(federation, tmp_path):
    """Flower exits at once on a certificate its CA did not sign and on a missing key; a
    plain-HTTP silo against the TLS server, and a silo whose server is not there, Flower
    retries for ever without a word: those end at --connect-timeout with the cause."""
    address, ca = federation.link.address, str(federation.tls.ca)
    key = str(federation.keys["silo-a"][0])
    # A port held (bound, never listening) for the whole test: nobody answers there, and
    # no process started meanwhile (a SuperNode's own API port) can take it.
    nobody = socket.socket()
    nobody.bind(("127.0.0.1", 0))
    nobody_port = nobody.getsockname()[1]
    silos = {
        "wrong CA": Silo(
            tmp_path / "a",
            address,
            "--root-certificates",
            str(federation.other.ca),
            "--auth-key",
            key,
        ),
        "no key": Silo(tmp_path / "b", address, "--root-certificates", ca),
        "plain HTTP": Silo(tmp_path / "c", address, "--connect-timeout", "12"),
        "nobody": Silo(
            tmp_path / "d",
            f"127.0.0.1:{nobody_port}",
            "--root-certificates",
            ca,
            "--connect-timeout",
            "4",
        ),
    }
    expected = {
        "wrong CA": "refused by the server: [SSL: CERTIFICATE_VERIFY_FAILED]",
        "no key": "the server admits registered silos only: give --auth-key",
        "plain HTTP": f"not connected after 12 s: the server at {address} speaks TLS: give "
        "--root-certificates",
        "nobody": "not connected after 4 s: cannot reach the server at 127.0.0.1:",
    }
    try:
        codes = {case: silo.end() for case, silo in silos.items()}
    finally:
        nobody.close()
    for case, silo in silos.items():
        assert codes[case] == 1, (case, silo.said)
        assert "silo-0 did not join" in silo.said, silo.said
        assert expected[case] in silo.said, silo.said
        assert " joined " not in silo.said


@pytest.mark.slow
def test_a_joined_silo_exits_1_when_its_supernode_dies_and_0_when_stopped(federation, tmp_path):
    address, ca = federation.link.address, str(federation.tls.ca)
    silos = [
        Silo(
            tmp_path / n,
            address,
            "--root-certificates",
            ca,
            "--auth-key",
            str(federation.keys[n][0]),
        )
        for n in ("silo-a", "silo-b", "silo-c")
    ]
    for silo in silos:
        silo.wait_for("silo-0 joined")
        assert "as node " in silo.said
        assert "as node None" not in silo.said
    below = psutil.Process(silos[2].process.pid).children(recursive=True)
    silos[0].process.send_signal(signal.SIGTERM)
    silos[1].supernode().kill()
    silos[2].process.kill()  # `fedlb silo` alone, SIGKILL: its SuperNode must not go on
    assert silos[0].end() == 0, silos[0].said
    assert "silo-0 stopped" in silos[0].said
    assert silos[1].end() == 1, silos[1].said
    assert "its SuperNode exited (code" in silos[1].said
    assert "its log" in silos[1].said
    silos[2].end()
    _, alive = psutil.wait_procs(below, timeout=20)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


@pytest.mark.slow
def test_a_silo_started_before_its_key_is_registered_joins_once_it_is(federation, tmp_path):
    """`fedlb server --silo-keys` registers the keys once its SuperLink is up; a silo that
    came first was refused for good by Flower (code 2004). `fedlb silo` starts its
    SuperNode again until the key is there; a key never registered ends at the timeout."""
    address, ca = federation.link.address, str(federation.tls.ca)
    late = Silo(
        tmp_path / "late",
        address,
        "--root-certificates",
        ca,
        "--auth-key",
        str(federation.keys["late"][0]),
    )
    stranger = Silo(
        tmp_path / "stranger",
        address,
        "--root-certificates",
        ca,
        "--auth-key",
        str(federation.keys["stranger"][0]),
        "--connect-timeout",
        "5",
    )
    try:
        late.wait_for("waiting for the server to register this silo's key")
        assert " joined " not in late.said
        federation.link.control.register_supernode(federation.keys["late"][1])
        federation.link.control.register_supernode(federation.keys["late"][1])  # twice: fine
        late.wait_for("silo-0 joined", timeout=40)
        assert stranger.end() == 1, stranger.said
        assert "refused by the server: [code: 2004]" in stranger.said
    finally:
        late.process.send_signal(signal.SIGTERM)
        stranger.process.kill()
    assert late.end() == 0, late.said


@pytest.mark.slow
def test_a_silo_rejoins_a_server_restarted_on_its_address(tmp_path):
    """Before: every silo exited 1 with a raw 401 traceback when a new server came up on
    the address it had joined; silos/README.md says a silo stays up until Ctrl-C."""
    import subprocess
    import sys
    import time

    from fedlb.deploy import processes as deploy

    port = deploy.free_port()
    first = deploy.start_superlink(tmp_path / "first", "127.0.0.1", port)
    silo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedlb.cli",
            "silo",
            "--server",
            f"127.0.0.1:{port}",
            "--partition-id",
            "0",
            "--num-partitions",
            "2",
            "--workdir",
            str(tmp_path / "silo"),
            "--cold",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    said: list[str] = []

    def wait_for(text: str, count: int = 1, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while sum(text in line for line in said) < count:
            assert time.monotonic() < deadline, "".join(said)
            assert silo.stdout is not None
            line = silo.stdout.readline()
            if not line and silo.poll() is not None:
                raise AssertionError("the silo exited: " + "".join(said))
            said.append(line)

    second = None
    try:
        wait_for(" joined ")
        first.stop()
        second = deploy.start_superlink(tmp_path / "second", "127.0.0.1", port)
        wait_for("rejoining")
        wait_for(" joined ", count=2)
        assert silo.poll() is None
        silo.send_signal(signal.SIGTERM)
        rest, _ = silo.communicate(timeout=60)
        assert silo.returncode == 0, "".join(said) + rest
        assert "Traceback" not in "".join(said) + rest
    finally:
        if silo.poll() is None:
            silo.kill()
        first.stop()
        if second is not None:
            second.stop()


@pytest.mark.slow
def test_a_silo_says_on_its_console_why_its_clientapp_failed(tmp_path):
    """Before: a silo whose --num-partitions disagreed with the run printed nothing on its
    own console (the error went to the server and the silo's log only), nor a silo whose
    update the server left out (NaN)."""
    import subprocess
    import sys
    import time

    from fedlb.deploy import RunConfig
    from fedlb.deploy.federation import Federation

    with Federation(tmp_path / "procs") as federation:
        silos = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fedlb.cli",
                    "silo",
                    "--server",
                    federation.address,
                    "--partition-id",
                    str(i),
                    "--num-partitions",
                    str(count),
                    "--workdir",
                    str(tmp_path / f"silo-{i}"),
                    "--threads",
                    "1",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i, count in ((0, 2), (1, 3))  # silo-1 splits the data another way
        ]
        try:
            settings = {
                **RunConfig().to_mapping(),
                "num-silos": 2,
                "num-rounds": 1,
                "local-steps": 2,
                "batch-size": 8,
                "round-timeout": 60.0,
                "out-dir": str(tmp_path / "out"),
            }
            federation.run(settings, timeout=180)
            # at η = 1e30 silo-0's update of round 1 holds NaN: the server leaves it out,
            # and says so to the silo with round 2's message
            blown = {"learning-rate": 1e30, "num-rounds": 2, "out-dir": str(tmp_path / "nan")}
            federation.run({**settings, **blown}, timeout=180)
            time.sleep(2.0)  # the silo reads its log every 0.5 s
        finally:
            for silo in silos:
                silo.send_signal(signal.SIGTERM)
            outputs = [" ".join(silo.communicate(timeout=60)[0].split()) for silo in silos]
    failed = "a message failed in its ClientApp: SiloConfigError: this silo has num-partitions 3"
    assert failed in outputs[1], outputs[1]
    assert "but the run has num-silos 2" in outputs[1]
    assert "restart it with --num-partitions 2" in outputs[1]
    assert "failed in its ClientApp" not in outputs[0]
    told = "the server says its update of round 1 was left out of the average: "
    assert told in outputs[0], outputs[0]
    assert "NaN or infinite" in outputs[0].split(told, 1)[1]
