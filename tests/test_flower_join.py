"""A silo joining its server: `fedlb silo` says "joined" only once its SuperNode has
connected, says why when it was refused, could not reach the server or did not connect in
time (exit 1), exits 1 when its SuperNode dies, and waits for a key the server has not
registered yet. The log reading and the retry logic first, without Flower; then real
processes against one TLS SuperLink with SuperNode authentication."""

from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import psutil
import pytest

from fedlb.deploy import silo_settings
from fedlb.deploy.federation import Federation
from fedlb.deploy.join import SUPERNODE_START, diagnose, read_join, supernode_join
from fedlb.deploy.processes import (
    FlowerProcess,
    JoinError,
    free_port,
    wait_joined,
)
from fedlb.security import make_certificates, make_silo_key

# Flower 1.41's own lines (colour codes included), as flower-supernode logs them.
STARTED = (
    "\x1b[92mINFO \x1b[0m:      Starting Flower SuperNode\n"
    "INFO:     Uvicorn running on http://127.0.0.1:41611 (Press CTRL+C to quit)\n"
)
CONNECTED = STARTED + "\x1b[92mINFO \x1b[0m:      SuperNode ID: 6868470573225693217\n"
RETRYING = STARTED + "\x1b[93mWARNING \x1b[0m:   Connection attempt failed, retrying in 0.37 s\n"


def gave_up(reason: str) -> str:
    return STARTED + (
        "\x1b[91mERROR \x1b[0m:     Exit Code: 305\n"
        "Failed to initialize the connection to the SuperLink.\n"
        f"{reason}\n"
        "The SuperNode could not establish a connection to the SuperLink.\n\n"
        "For more information, visit: <https://flower.ai/docs/framework/1.41/en/"
        "ref-exit-codes/305.html>\n"
        "INFO:     Shutting down\n"
    )


WRONG_CA = gave_up(
    "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: certificate signature "
    "failure (_ssl.c:1006)"
)
UNREGISTERED = gave_up("[code: 2004] Failed to activate SuperNode.")
NO_KEY = gave_up(
    "[code: 2001] SuperNode authentication is enabled. All SuperNodes must be registered "
    "via the CLI."
)
NOT_TLS = gave_up("[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)")


def started(log: str) -> str:
    return f"{SUPERNODE_START} silo-0 for 127.0.0.1:1 at 2026-01-01 00:00:00\n{log}"


# 1. the log, read


def test_a_connected_supernode_is_read_with_its_node_id():
    assert read_join(started(CONNECTED)).node_id == 6868470573225693217
    assert read_join(started(RETRYING)) == read_join("") == read_join(started(STARTED))
    assert not read_join(started(RETRYING)).refused


@pytest.mark.parametrize(
    ("log", "said", "unregistered"),
    [
        (WRONG_CA, "not signed by the CA given as --root-certificates", False),
        (UNREGISTERED, "does not know this silo's key", True),
        (NO_KEY, "give --auth-key", False),
        (NOT_TLS, "does not speak TLS: leave out --root-certificates", False),
    ],
)
def test_a_refusal_is_read_with_flowers_reason_and_what_to_do(log, said, unregistered):
    join = read_join(started(log))
    assert join.node_id is None
    assert said in join.refused
    assert join.unregistered is unregistered
    reason = log.split("SuperLink.\n")[1].splitlines()[0]
    assert join.refused.startswith(reason)  # Flower's own words first
    assert "For more information" not in join.refused
    assert "could not establish" not in join.refused


def test_only_the_last_start_in_an_appended_log_counts():
    assert read_join(started(CONNECTED) + started(UNREGISTERED)).unregistered
    assert read_join(started(UNREGISTERED) + started(CONNECTED)).node_id is not None
    assert read_join(started(CONNECTED) + started(RETRYING)) == read_join("")
    assert supernode_join(Path("/nonexistent/silo.log")) == read_join("")


# 2. why it has not connected, seen from the silo's side


def serve_once(tls: Path | None) -> int:
    """A port that accepts one connection, with a TLS handshake when `tls` (a `fedlb
    certs` folder) is given."""
    listener = socket.create_server(("127.0.0.1", 0))
    context = None
    if tls is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls / "server.crt", tls / "server.key")

    def accept() -> None:
        with listener:
            connection, _ = listener.accept()
            try:
                if context is not None:
                    connection = context.wrap_socket(connection, server_side=True)
                connection.recv(1)
            except (OSError, ssl.SSLError):
                pass
            finally:
                connection.close()

    threading.Thread(target=accept, daemon=True).start()
    return int(listener.getsockname()[1])


def test_diagnose_names_an_unreachable_server_and_a_tls_one(tmp_path):
    make_certificates(tmp_path, ["127.0.0.1"])
    with socket.socket() as held:  # bound, never listening: nobody answers, nobody takes it
        held.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{held.getsockname()[1]}"
        assert "cannot reach the server at " + nobody in diagnose(nobody, tls=False)
    assert "cannot reach" in diagnose("no-such-host.invalid:8000", tls=True)
    tls_server = f"127.0.0.1:{serve_once(tmp_path)}"
    said = diagnose(tls_server, tls=False)
    assert "speaks TLS: give --root-certificates" in said, said
    plain = f"127.0.0.1:{serve_once(None)}"
    assert "accepts connections; not connected yet" in diagnose(plain, tls=False, timeout=1)


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
