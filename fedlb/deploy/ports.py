"""Ports on this machine: a free one, whether one is, and why one cannot be bound (in
use, not this machine's address, privileged), in words for an operator."""

from __future__ import annotations

import errno
import socket
from collections.abc import Collection

from .errors import DeployError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int, what: str) -> None:
    """Refuse (DeployError) a port something already listens on, before starting a
    process there: a second SuperLink on a live server's port would fail to bind, and
    the health check and `flwr` commands that follow would reach the live server's (and
    stop its run)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise DeployError(_unbindable(host, port, what, error)) from None


def _unbindable(host: str, port: int, what: str, error: OSError) -> str:
    """Why `what` cannot listen on host:port, in one line with what to do: only a port
    something holds is "in use" (an address that is not this machine's is another fault)."""
    nothing = "Nothing was started or stopped"
    if isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL:
        why = error.strerror or str(error)
        return (
            f"{what} cannot listen on {host}:{port}: {host} is not an address of this "
            f"machine ({why}). {nothing}. Give --host one of its own addresses (0.0.0.0: "
            "all of them)"
        )
    if error.errno == errno.EACCES:
        return (
            f"{what} may not listen on {host}:{port} ({error.strerror}: ports below 1024 "
            f"need privileges). {nothing}. Give another port (--port)"
        )
    return (
        f"{what}'s port {host}:{port} is in use ({error.strerror}): another fedlb "
        f"server or silo, or another program, listens there. {nothing}. Give another "
        "port (--port), or stop what holds it"
    )


def unused_port(host: str, what: str, avoid: Collection[int] = (), tries: int = 10) -> int:
    """A free port that `check_port_free` accepts and that is not in `avoid` (ports given
    to processes not bound yet). Between `free_port`'s probe and the check something else
    can take it (an outgoing connection's ephemeral port, a process started beside this
    one: a fresh clone's suite once hit this), so a port found taken is replaced by
    another, up to `tries` times; only a port the user gave is refused at once."""
    for attempt in range(1, tries + 1):
        port = free_port(host)
        if port in avoid:
            continue
        try:
            check_port_free(host, port, what)
        except DeployError:
            if attempt == tries:
                raise
            continue
        return port
    raise DeployError(f"{what}: no free port on {host} outside {sorted(avoid)} in {tries} tries")
