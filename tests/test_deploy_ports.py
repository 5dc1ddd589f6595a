"""A silo's SuperNode port: a free one where none is given, another if the first is taken
before it is used; a port the user gives, taken, is refused."""

from __future__ import annotations

import socket

import pytest

from fedlb.deploy import ports as processes  # where the port helpers live
from fedlb.deploy.errors import DeployError


def test_a_free_port_taken_before_use_is_replaced_by_another(monkeypatch):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        offered = iter([taken, taken])  # what a racing probe returns: a port now in use

        def racing_free_port(host="127.0.0.1"):
            return next(offered, None) or socket_free(host)

        monkeypatch.setattr(processes, "free_port", racing_free_port)
        port = processes.unused_port("127.0.0.1", "silo x's SuperNode")
        assert port != taken
        processes.check_port_free("127.0.0.1", port, "it")  # free indeed
        with pytest.raises(DeployError, match=f"port 127.0.0.1:{taken} is in use"):
            processes.check_port_free("127.0.0.1", taken, "silo x's SuperNode")


def test_a_port_that_stays_taken_is_refused_with_why(monkeypatch):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        monkeypatch.setattr(processes, "free_port", lambda host="127.0.0.1": taken)
        with pytest.raises(DeployError, match="is in use"):
            processes.unused_port("127.0.0.1", "silo x's SuperNode", tries=3)


def socket_free(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def test_ports_given_to_processes_not_yet_bound_are_avoided(monkeypatch):
    first = second = socket_free("127.0.0.1")
    while second == first:
        second = socket_free("127.0.0.1")
    offered = iter([first, first, second])
    monkeypatch.setattr(processes, "free_port", lambda host="127.0.0.1": next(offered))
    assert processes.unused_port("127.0.0.1", "silo y's SuperNode", avoid={first}) == second
