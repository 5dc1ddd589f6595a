"""A silo joining its server, without Flower: its SuperNode's log read (connected with its
node id, refused with Flower's reason and what to do, only the last start counting), and
why it has not connected seen from the silo's side (an unreachable server, a TLS one)."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

import pytest

from fedlb.deploy.join import diagnose, read_join, supernode_join
from fedlb.security import make_certificates
from tests.join_helpers import (
    CONNECTED,
    NO_KEY,
    NOT_TLS,
    RETRYING,
    STARTED,
    UNREGISTERED,
    WRONG_CA,
    started,
)

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
