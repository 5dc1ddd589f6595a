"""`fedlb manager`, the BatchSizeManager over gRPC, on real servers on 127.0.0.1, serving:
it balances workers of any framework; waiting reports cannot take every thread; a client
that goes away frees its thread at once; one manager per port."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc
import pytest

from fedlb.cli import app
from fedlb.cluster import ManagerClient
from fedlb.cluster.service import PortInUseError, serve
from tests.cluster_service_helpers import (
    REPORT,
    _no_token_in_the_environment,  # noqa: F401 (autouse)
    flat,
    raw,
    refused,
    report,
    runner,
    running,
    until,
)


def test_the_manager_service_balances_workers_of_any_framework():
    """Four plain-Python workers at speeds 1 : 1 : 2 : 4 report each iteration and wait for
    their next size (BSP); bad requests get clear statuses. The wait covers the gap
    between the threads' reports, which on a busy machine is its scheduler's to say."""
    with running(wait_timeout=5.0) as (address, _):
        names = ["a", "b", "c", "d"]
        speeds = dict(zip(names, (100.0, 100.0, 200.0, 400.0), strict=True))
        ManagerClient(address).register("job-1", names, 32)
        final: dict[str, int] = {}

        def work(name: str) -> None:
            client = ManagerClient(address, timeout=10)
            size = 32
            for iteration in range(1, 6):
                size = client.report("job-1", name, iteration, size, size / speeds[name])
            final[name] = size
            client.close()

        threads = [threading.Thread(target=work, args=(n,)) for n in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert final == {"a": 16, "b": 16, "c": 32, "d": 64}

        client = ManagerClient(address, timeout=10)
        error = refused(lambda: client.report("job-1", "a", 7, 16, float("nan")))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "compute_s must be a finite number" in error.details()
        error = refused(lambda: client.report("nope", "a", 1, 16, 0.1))
        assert error.code() == grpc.StatusCode.NOT_FOUND
        error = refused(lambda: client.report("job-1", "a", 9, 16, 0.1))  # nobody else comes
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no report from ['b', 'c', 'd']" in error.details()
        assert client.report("job-1", "b", 10, 16, 0.1, wait=False) == 16  # no waiting
        error = refused(lambda: client.channel.unary_unary(REPORT)(b"\xff not json"))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        client.close()


# 1. Waiting reports cannot take every thread.


def test_waiting_reports_cannot_stall_another_jobs_register(caplog):
    """8 threads: 7 may wait, the rest are refused at once; another job registers fast."""
    with running(max_workers=8, wait_timeout=10) as (address, service), raw(address) as call:
        client = ManagerClient(address, timeout=5)
        client.register("hog", [f"w{i}" for i in range(20)], 8)
        calls = [call.future(report(f"w{i}", 1, "hog"), timeout=10) for i in range(12)]
        until(lambda: service.waiting == 7 and sum(c.done() for c in calls) == 5)
        for extra in (c for c in calls if c.done()):
            assert extra.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "waiting reports, its limit" in extra.details()
            assert "--max-workers" in extra.details()
        start = time.monotonic()
        assert client.register("other", ["a", "b"], 8) == {"a": 8, "b": 8}
        assert client.report("other", "a", 1, 8, 0.1, wait=False) == 8
        # at once: stalled, they would wait for a thread the hog's reports hold for 10 s
        # (and the client's 5 s timeout would fail them first)
        assert time.monotonic() - start < 5.0
        assert service.waiting == 7
        client.close()
    assert any("refused: the manager holds 7 waiting" in r.getMessage() for r in caplog.records)


def test_a_retried_waiting_report_replaces_the_older_one():
    with running(wait_timeout=30) as (address, service), raw(address) as call:
        ManagerClient(address).register("j", ["a", "b"], 8)
        first = call.future(report("a", 1), timeout=30)
        until(lambda: service.waiting == 1)
        second = call.future(report("a", 1), timeout=30)
        until(first.done)
        assert first.code() == grpc.StatusCode.ABORTED
        assert "a newer waiting report from worker 'a' replaced this one" in first.details()
        assert service.waiting == 1  # the slot moved to the newer call
        call(report("b", 1))
        assert json.loads(second.result()) == {"batch_size": 8, "iteration": 1}
        assert service.waiting == 0


# 2. A client that goes away frees its thread at once.


def test_a_cancelled_waiting_call_frees_its_slot_at_once():
    with running(wait_timeout=30) as (address, service), raw(address) as call:
        ManagerClient(address).register("j", ["a", "b"], 8)
        waiting = call.future(report("a", 1), timeout=30)
        until(lambda: service.waiting == 1)
        waiting.cancel()
        assert until(lambda: service.waiting == 0) < 10  # at once, not the 30 s wait-timeout


def test_a_killed_client_frees_its_slot_at_once():
    script = (
        "import grpc, sys; grpc.insecure_channel(sys.argv[1])"
        f".unary_unary({REPORT!r})(sys.argv[2].encode(), timeout=30)"
    )
    with running(wait_timeout=30) as (address, service):
        ManagerClient(address).register("j", ["a", "b"], 8)
        client = subprocess.Popen([sys.executable, "-c", script, address, report("a", 1).decode()])
        try:
            until(lambda: service.waiting == 1, timeout=20)
        finally:
            client.kill()
            client.wait()
        assert until(lambda: service.waiting == 0) < 10  # not the 30 s wait-timeout


def test_stopping_the_service_ends_waiting_calls():
    with running(wait_timeout=30) as (address, service), raw(address) as call:
        ManagerClient(address).register("j", ["a", "b"], 8)
        waiting = call.future(report("a", 1), timeout=30)
        until(lambda: service.waiting == 1)
        service.close()
        until(waiting.done, timeout=10.0)  # not the 30 s wait-timeout
        assert waiting.code() == grpc.StatusCode.UNAVAILABLE
        assert "the manager is stopping" in waiting.details()


# 3. One manager per port.


def test_a_second_manager_on_the_same_port_is_refused():
    with running() as (address, _):
        port = int(address.rsplit(":", 1)[1])
        with pytest.raises(PortInUseError, match=f"port {port} is already in use by another"):
            serve(port)


def test_grpc_itself_refuses_to_share_the_port(monkeypatch):
    """A default gRPC server sets SO_REUSEPORT; ours does not, so the kernel refuses the
    second bind (the plain-socket check that runs first is skipped here)."""
    from concurrent import futures

    import fedlb.cluster.service as service_module

    other = grpc.server(futures.ThreadPoolExecutor(1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    real = service_module._bind_error
    checks = iter([None])  # the first (pre-bind) check finds nothing
    monkeypatch.setattr(service_module, "_bind_error", lambda h, p: next(checks, real(h, p)))
    try:
        with pytest.raises(PortInUseError):
            serve(port)
    finally:
        other.stop(0).wait()


def test_the_cli_says_the_port_is_taken_without_a_traceback():
    with running() as (address, _):
        port = address.rsplit(":", 1)[1]
        result = runner.invoke(app, ["manager", "--port", port])
    assert result.exit_code == 2, result.output
    said = f"port {port} is already in use by another process; pick another --port"
    assert said in flat(result.output)
    assert "Traceback" not in result.output
