"""What a SuperNode's log says of its connection to the SuperLink, and what to do about it.

Flower 1.41's SuperNode logs "SuperNode ID: N" once connected and "Exit Code: 305" with
the reason when it gives up (a TLS error, a refused key); a server it cannot reach, or
one that speaks TLS to a plain-HTTP SuperNode, it retries for ever with only "Connection
attempt failed" (the cause is at DEBUG). `fedlb silo` reads the log, and checks the
address itself, to say which. The lines and codes read are Flower's
(fedlb._flower_internals, checked by tests/test_flower_internals_*.py).
"""

from __future__ import annotations

import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from fedlb import _flower_internals as flower
from fedlb.flower.protocol import NOTICE_LINE

SUPERNODE_START = "fedlb: starting SuperNode"  # heads each start's part of a SuperNode log
_CONNECTED = flower.SUPERNODE_CONNECTED  # Flower's line once ActivateNode succeeded
_EXIT = flower.EXIT_CODE  # flwr_exit's first line; the reason follows
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# flwr_exit's lines around the reason that say nothing of this case
_GENERIC = flower.EXIT_GENERIC_LINES
# What Flower 1.41's reasons mean for a fedlb silo, and what to do.
_HINTS = {
    "CERTIFICATE_VERIFY_FAILED": "the server's certificate is not signed by the CA given as "
    "--root-certificates: give the federation's ca.crt (fedlb certs)",
    "WRONG_VERSION_NUMBER": "the server does not speak TLS: leave out --root-certificates, "
    "or start the server with --certs",
    flower.REGISTRATION_DISABLED: "the server admits registered silos only: give --auth-key "
    "(fedlb silo-key) and have its .pub in the server's --silo-keys folder",
    flower.NODE_ACTIVATION_FAILED: "the server does not know this silo's key (not registered "
    "yet, or not in its --silo-keys folder), or a SuperNode with this key is still connected",
}
UNREGISTERED = flower.NODE_ACTIVATION_FAILED  # Flower: "Failed to activate SuperNode."


@dataclass(frozen=True)
class Join:
    """What a SuperNode's log says of its connection to the SuperLink since its last start."""

    node_id: int | None = None  # connected: the node id the SuperLink gave it
    refused: str = ""  # Flower gave up connecting (it exits): its reason, with a hint
    unregistered: bool = False  # refused as a key the SuperLink does not know (yet)


def read_join(log: str) -> Join:
    """Read a SuperNode log (from `start_supernode`: each start marked). Flower 1.41 logs
    "SuperNode ID: N" once connected and "Exit Code: 305" with the reason when it gives
    up (a TLS error, a refused key); a server it cannot reach, or one that speaks TLS to
    a plain-HTTP SuperNode, it retries for ever with only "Connection attempt failed"."""
    log = _ANSI.sub("", log.rsplit(SUPERNODE_START, 1)[-1])
    if connected := _CONNECTED.search(log):
        return Join(node_id=int(connected.group(1)))
    exit_code = _EXIT.search(log)
    if exit_code is None:
        return Join()
    lines = []
    for line in log[exit_code.end() :].splitlines():
        if line.startswith(flower.EXIT_MORE_INFORMATION):
            break
        if line.strip() and line.strip() not in _GENERIC:
            lines.append(line.strip())
    reason = "; ".join(lines) or f"Flower's exit code {exit_code.group(1)}"
    hints = [hint for key, hint in _HINTS.items() if key in reason]
    return Join(
        refused=f"{reason} ({'; '.join(hints)})" if hints else reason,
        unregistered=UNREGISTERED in reason,
    )


def supernode_join(log_path: Path) -> Join:
    """`read_join` of the SuperNode log at `log_path` (nothing yet if there is none)."""
    try:
        return read_join(log_path.read_text(errors="replace"))
    except OSError:
        return Join()


def diagnose(address: str, tls: bool, timeout: float = 3.0) -> str:
    """Why a SuperNode may not have connected to `address`, as seen from here: nothing
    answers there, or (for a plain-HTTP SuperNode) the server speaks TLS."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout) as sock:
            if tls:
                return f"the server at {address} accepts connections; not connected yet"
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE  # only: does it speak TLS at all?
            try:
                with context.wrap_socket(sock, server_hostname=host.strip("[]")):
                    return (
                        f"the server at {address} speaks TLS: give --root-certificates "
                        "(the federation's ca.crt)"
                    )
            except (ssl.SSLError, OSError):
                return f"the server at {address} accepts connections; not connected yet"
    except (OSError, ValueError) as error:
        why = getattr(error, "strerror", None) or str(error)
        return f"cannot reach the server at {address} ({why}): is it up, is the address right?"


_APP_FAILED = flower.CLIENTAPP_RAISED  # Flower's line before the traceback
_WARM_RESTART = "warm: the silo's"  # fedlb.deploy.warm: "... warm ClientApp server exited"
LOST_TASK = "fedlb: a ClientApp ended without a reply"  # fedlb.deploy.prompt's line
_RAISED = re.compile(r"^([\w.]*(?:Error|Exception)): (.+)$")  # a traceback's last line


class ClientAppFailures:
    """What the operator at a silo's console must hear of, from its SuperNode's log, one
    sentence each, as `fedlb silo` reads it while the silo runs: a message that failed in
    its ClientApp (Flower sends the error to the server and logs the traceback only here),
    a ClientApp that ended without a reply, a warm server restarted, and the server's
    word that an update of this silo was left out of the average."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.offset = log_path.stat().st_size if log_path.exists() else 0
        self.failing = False  # inside a failure's traceback
        self.said: set[str] = set()  # Flower logs each failure twice (two handlers)

    def new(self) -> list[str]:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.offset)
                chunk = log.read()
        except OSError:
            return []
        complete = chunk.rfind(b"\n") + 1  # a line still being written waits
        self.offset += complete
        found: list[str] = []
        for line in chunk[:complete].decode(errors="replace").splitlines():
            line = _ANSI.sub("", line).strip()
            sentence = self._sentence(line)
            if sentence is not None:
                found.append(sentence)
        return found

    def _sentence(self, line: str) -> str | None:
        """What `line` (one line of the log) tells the operator; None: nothing."""
        where = f"the traceback is in {self.log_path}"
        if line.startswith(LOST_TASK):  # fedlb's own line: the whole story in one
            return f"a message's ClientApp ended without a reply {line[len(LOST_TASK) :]}"
        if _WARM_RESTART in line:  # the launcher's line: its warm server died
            return "its " + line.split(_WARM_RESTART, 1)[1].strip()
        if line.startswith(NOTICE_LINE):  # the server's word, printed by balance_mod
            return f"the server says {line[len(NOTICE_LINE) :].strip()}"
        if _APP_FAILED in line:
            self.failing = True
        elif self.failing and (match := _RAISED.match(line)):
            self.failing = False
            failure = f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2)}"
            if failure in self.said:
                return None
            self.said.add(failure)
            return (
                f"a message failed in its ClientApp: {failure} (the server goes on without "
                f"this silo's reply; {where})"
            )
        return None
