"""`fedlb manager`, the BatchSizeManager over gRPC, on real servers on 127.0.0.1: it balances
workers of any framework, and no client can stall it, crash a handler or grow it without
bound; a second manager on its port, bad options, a missing token are refused clearly."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fedlb.cli import app
from fedlb.cluster import ManagerClient, RequestError
from fedlb.cluster.service import (
    MAX_PENDING_ITERATIONS,
    ManagerService,
    PortInUseError,
    ServiceLimits,
    serve,
)
from fedlb.cluster.service_auth import TOKEN_ENV, ManagerSetupError, read_token
from fedlb.cluster.service_requests import MAX_REQUEST_BYTES

REPORT = "/fedlb.BatchSizeManager/Report"
REGISTER = "/fedlb.BatchSizeManager/Register"
TOKEN = "a-test-token-of-32-characters-xy"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_token_in_the_environment(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


@contextlib.contextmanager
def running(**options: Any) -> Iterator[tuple[str, ManagerService]]:
    server, port, service = serve(0, **options)
    try:
        yield f"127.0.0.1:{port}", service
    finally:
        service.close()
        server.stop(0).wait()


@contextlib.contextmanager
def raw(address: str) -> Iterator[Callable[..., Any]]:
    """Report with bytes in and out: what a hostile client sends."""
    channel = grpc.insecure_channel(address)
    try:
        yield channel.unary_unary(REPORT)
    finally:
        channel.close()


def report(worker: str, iteration: int, job: str = "j", wait: bool = True) -> bytes:
    request = {"job": job, "worker": worker, "iteration": iteration, "batch_size": 8}
    return json.dumps({**request, "compute_s": 0.1, "wait": wait}).encode()


def until(condition: Callable[[], bool], timeout: float = 30.0) -> float:
    """Seconds until `condition` holds; fails past `timeout` (generous: it returns as soon
    as the condition holds, and a busy machine may take seconds to get there)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.01)
    return time.monotonic() - start


def outcome(call: Callable[[], Any]) -> RequestError | None:
    try:
        call()
    except RequestError as error:
        return error
    return None


def flat(output: str) -> str:
    """The console's text without its wrapping and error-box lines."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())


def refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


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


# 4. and 5. Every field is checked; hostile JSON is an INVALID_ARGUMENT naming it.


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[str, ManagerService]]:
    with running(wait_timeout=0.3) as (address, service):
        ManagerClient(address).register("j", ["a", "b"], 8)
        yield address, service


GOOD_REPORT = {"job": "j", "worker": "a", "iteration": 1, "batch_size": 8, "compute_s": 0.1}
GOOD_REGISTER = {"job": "k", "workers": ["a", "b"], "batch_size": 8, "policy": "lb-ema"}
DIGITS_400 = "1" * 400


@pytest.mark.parametrize(
    ("method", "data", "says"),
    [
        (REPORT, b'{"job": "j", "worker": "a", "iteration": ' + DIGITS_400.encode() + b"}",
         "iteration must be a whole number in 0..9007199254740991, got a 400-digit number"),
        (REPORT, json.dumps(GOOD_REPORT).replace('"batch_size": 8', '"batch_size": ' + "9" * 5000)
         .encode(), "batch_size must be a whole number in 1..1048576, got a 5000-digit number"),
        (REPORT, b"[" * 100_000, "not a JSON request: nested too deeply"),
        (REPORT, b'{"job": ' + b"[" * 500 + b"]" * 500 + b"}", "job must be a name of 1 to 128"),
        (REPORT, json.dumps({**GOOD_REPORT, "compute_s": 1}).replace("1}", "1e999}").encode(),
         "compute_s must be a finite number of seconds in (0, 1e+07], got inf"),
        (REPORT, json.dumps({**GOOD_REPORT, "compute_s": math.nan}).encode(), "compute_s"),
        (REPORT, b'{"job": "\xff"}', "not a JSON request"),
        (REPORT, b"[]", "a request is a JSON object, got a list"),
        (REGISTER, json.dumps({**GOOD_REGISTER, "batch_size": 1e308}).encode(),
         "batch_size must be a whole number in 1..1048576, got 1e+308"),
    ],
)  # fmt: skip
def test_hostile_json_is_an_invalid_argument_naming_the_field(shared, method, data, says):
    address, _ = shared
    channel = grpc.insecure_channel(address)
    try:
        error = refused(lambda: channel.unary_unary(method)(data, timeout=5))
    finally:
        channel.close()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert says in error.details()


def test_a_request_over_the_size_limit_is_refused_unread(shared):
    address, _ = shared
    with raw(address) as call:
        error = refused(lambda: call(b" " * (MAX_REQUEST_BYTES + 1), timeout=5))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert json.loads(call(report("b", 1, wait=False), timeout=5))["batch_size"] == 8


@pytest.mark.parametrize(
    ("method", "change", "says"),
    [
        (REPORT, {"batch_size": 1e308}, "batch_size must be a whole number in 1..1048576"),
        (REPORT, {"batch_size": True}, "batch_size must be a whole number in 1..1048576"),
        (REPORT, {"batch_size": 0}, "batch_size must be a whole number in 1..1048576, got 0"),
        (REPORT, {"iteration": -1}, "iteration must be a whole number in 0..9007199254740991"),
        (REPORT, {"iteration": 1.5}, "iteration must be a whole number"),
        (REPORT, {"wait": "no"}, "wait must be true or false, got 'no'"),
        (REPORT, {"wait": 0}, "wait must be true or false, got 0"),
        (REPORT, {"compute_s": 0}, "compute_s must be a finite number of seconds in (0, 1e+07]"),
        (REPORT, {"compute_s": "1"}, "compute_s must be a finite number of seconds"),
        (REPORT, {"cpu": 2}, "cpu must be a fraction in [0, 1] or null, got 2"),
        (REPORT, {"worker": 5}, "worker must be a name of 1 to 128 characters, got 5"),
        (REPORT, {"worker": "x"}, "worker 'x' is not in job 'j'"),
        (REPORT, {"job": ""}, "job must be a name of 1 to 128 characters, got ''"),
        (REPORT, {"job": "j" * 200}, "job must be a name of 1 to 128 characters, got 'jjj"),
        (REPORT, {"batchsize": 8}, "unknown field 'batchsize' in a Report request; it has job,"),
        (REGISTER, {"workers": []}, "workers must be a non-empty list of names, got a list"),
        (REGISTER, {"workers": ["a", "a"]}, "workers must be distinct names; 'a' is there twice"),
        (REGISTER, {"workers": ["a", 3]}, "workers[1] must be a name of 1 to 128 characters"),
        (REGISTER, {"workers": "ab"}, "workers must be a non-empty list of names, got 'ab'"),
        (
            REGISTER,
            {"policy": "fast"},
            "policy must be one of bsp, lb, lb-curve, lb-ema, lb-narx, lb-gpu, ",
        ),
        (REGISTER, {"policy": ["bsp"]}, "policy must be one of"),
        (REGISTER, {"job": None}, "job must be a name of 1 to 128 characters, got null"),
    ],
)
def test_every_field_is_checked_with_its_allowed_values(shared, method, change, says):
    address, _ = shared
    request = {**(GOOD_REPORT if method == REPORT else GOOD_REGISTER), "wait": False, **change}
    if method == REGISTER:
        request.pop("wait")
    channel = grpc.insecure_channel(address)
    try:
        call = channel.unary_unary(method)
        error = refused(lambda: call(json.dumps(request).encode(), timeout=5))
    finally:
        channel.close()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert says in error.details()


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats()
    | st.text(max_size=200),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=5,
)


GOOD = {
    "register": GOOD_REGISTER,
    "report": {**GOOD_REPORT, "cpu": None, "mem": 0.5, "accel_mem": None, "wait": False},
}
FIELDS = [(kind, key) for kind, request in GOOD.items() for key in request]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS), value=JSON)
def test_a_field_with_any_json_value_is_accepted_or_refused_by_name(field, value):
    """Property: one field of a good request set to any JSON value is either accepted or an
    INVALID_ARGUMENT whose message starts with that field's name; nothing else escapes."""
    kind, key = field
    service = ManagerService(wait_timeout=0.01)
    service.register({"job": "j", "workers": ["a", "b"], "batch_size": 8})
    method = service.register if kind == "register" else service.report
    error = outcome(lambda: method(json.loads(json.dumps({**GOOD[kind], key: value}))))
    if error is None:
        return
    if error.code == grpc.StatusCode.INVALID_ARGUMENT:
        assert str(error).startswith(key), str(error)
    else:  # a valid job or worker name that is not there; a report that waited
        expected = {"NOT_FOUND", "ALREADY_EXISTS", "DEADLINE_EXCEEDED"}
        assert error.code.name in expected, str(error)


# 6. Jobs, workers and iterations in flight are capped; idle jobs are forgotten.


def test_jobs_and_workers_are_capped_and_idle_jobs_forgotten(monkeypatch):
    """Idle time on the service's own clock (ManagerService's `clock`), moved by the test:
    a job is idle for 0.4 s when the test says so, not when a busy machine stalls."""
    limits = ServiceLimits(max_jobs=2, max_job_workers=3, job_idle_s=0.4)
    now = [1000.0]
    with running(wait_timeout=30, limits=limits) as (address, service), raw(address) as call:
        monkeypatch.setattr(service, "_clock", lambda: now[0])
        client = ManagerClient(address, timeout=30)
        error = refused(lambda: client.register("big", ["a", "b", "c", "d"], 8))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "4 workers, more than the service's limit of 3 per job" in error.details()
        assert "fedlb manager --max-job-workers" in error.details()
        client.register("j1", ["a", "b"], 8)
        client.register("j2", ["a", "b"], 8)
        error = refused(lambda: client.register("j3", ["a", "b"], 8))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "holds 2 jobs, its limit, none idle for 0.4 s" in error.details()
        assert "fedlb manager --max-jobs" in error.details()
        waiting = call.future(report("a", 1, "j1"), timeout=30)  # j1 stays busy
        until(lambda: service.waiting == 1)
        now[0] += 0.5
        client.register("j3", ["a", "b"], 8)  # j2 was idle: forgotten
        error = refused(lambda: client.register("j4", ["a", "b"], 8))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # j1 waits, j3 is new
        error = refused(lambda: client.report("j2", "a", 1, 8, 0.1))
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert "a job idle for 0.4 s is forgotten" in error.details()
        assert client.report("j1", "b", 1, 8, 0.1) == 8
        assert json.loads(waiting.result())["batch_size"] == 8
        assert sorted(service.jobs) == ["j1", "j3"]
        client.close()


def test_iterations_in_flight_are_capped_and_old_ones_refused(shared):
    address, _ = shared
    client = ManagerClient(address, timeout=5)
    client.register("drift", ["a", "b"], 8)
    for iteration in range(MAX_PENDING_ITERATIONS):
        client.report("drift", "a", iteration, 8, 0.1, wait=False)
    error = refused(lambda: client.report("drift", "a", 10**6, 8, 0.1, wait=False))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "has 64 iterations missing reports, its limit; the oldest, 0," in error.details()
    for iteration in range(20, 30):  # b catches up from 20: iterations before 18 go
        client.report("drift", "b", iteration, 8, 0.1, wait=False)
    error = refused(lambda: client.report("drift", "b", 3, 8, 0.1, wait=False))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "iteration 3 of job 'drift' is over: sizes are decided up to iteration 29" in (
        error.details()
    )
    assert client.report("drift", "a", 10**6, 8, 0.1, wait=False) == 8  # room again
    client.close()


# 7. The command's options.


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--max-workers", "0"], "--max-workers must be >= 1, got 0"),
        (["--max-jobs", "0"], "--max-jobs must be >= 1, got 0"),
        (["--max-job-workers", "-3"], "--max-job-workers must be >= 1, got -3"),
        (["--port", "70000"], "--port must be in 0..65535 (0: a free port), got 70000"),
        (["--wait-timeout", "0"], "--wait-timeout must be a number of seconds > 0, got 0.0"),
        (["--wait-timeout", "nan"], "--wait-timeout must be a number of seconds > 0, got nan"),
        (["--job-idle-timeout", "-1"], "--job-idle-timeout must be a number of seconds > 0"),
    ],
)
def test_bad_manager_options_are_usage_errors(flags, says):
    result = runner.invoke(app, ["manager", *flags])
    assert result.exit_code == 2, result.output
    assert says in flat(result.output)
    assert "Traceback" not in result.output


def test_the_cli_on_port_0_prints_the_port_it_got_and_stops_on_sigterm(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    command = [sys.executable, "-m", "fedlb.cli", "manager", "--port", "0"]
    env = {**os.environ, "COLUMNS": "200"}
    manager = subprocess.Popen(
        [*command, "--token-file", str(token_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert manager.stdout is not None
        first = manager.stdout.readline()
        found = re.search(r"fedlb manager on 127\.0\.0\.1:(\d+)", first)
        assert found, first
        guards = manager.stdout.readline()
        assert "token on, TLS off" in guards
        from fedlb.balance import defaults  # the manager says what "default" means

        assert defaults.controller() in manager.stdout.readline()
        client = ManagerClient(f"127.0.0.1:{found.group(1)}", timeout=5, token=TOKEN)
        assert client.register("j", ["a"], 4) == {"a": 4}
        client.close()
        manager.send_signal(signal.SIGTERM)
        manager.wait(timeout=20)
        # Read through the same buffered reader as readline() above:
        # communicate() reads the raw pipe and would miss what that reader holds.
        output = manager.stdout.read()
    finally:
        if manager.poll() is None:
            manager.kill()
    assert manager.returncode == 0, output
    assert "fedlb manager stopped" in output


# 8. A token, TLS.


def test_a_token_is_required_when_the_service_has_one():
    with running(token=TOKEN) as (address, _):
        for token in (None, "x" * 32):
            client = ManagerClient(address, timeout=5, token=token)
            error = refused(lambda c=client: c.register("j", ["a"], 8))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "this manager wants a token" in error.details()
            client.close()
        client = ManagerClient(address, timeout=5, token=TOKEN)
        assert client.register("j", ["a"], 8) == {"a": 8}
        assert client.report("j", "a", 1, 8, 0.1) == 8
        client.close()


def test_the_client_takes_the_token_from_the_environment(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with running(token=TOKEN) as (address, _):
        client = ManagerClient(address, timeout=5)
        assert client.register("j", ["a"], 8) == {"a": 8}
        client.close()


def test_tls_with_the_files_of_fedlb_certs(tmp_path):
    from fedlb.security import make_certificates

    files = make_certificates(tmp_path, ["127.0.0.1"])
    with running(token=TOKEN, tls=(files.cert, files.key)) as (address, _):
        client = ManagerClient(address, timeout=5, token=TOKEN, root_certificates=files.ca)
        assert client.register("j", ["a"], 8) == {"a": 8}
        client.close()
        plain = ManagerClient(address, timeout=2, token=TOKEN)
        assert refused(lambda: plain.register("j", ["a"], 8)).code() == (
            grpc.StatusCode.UNAVAILABLE
        )
        plain.close()


def test_bad_tokens_and_certificates_are_clear_errors(tmp_path):
    with pytest.raises(ManagerSetupError, match="cannot read the token file"):
        read_token(tmp_path / "missing")
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ManagerSetupError, match="at least 16 printable ASCII characters"):
        read_token(tmp_path / "short")
    assert read_token(None, {TOKEN_ENV: f" {TOKEN}\n"}) == TOKEN
    assert read_token(None, {}) is None
    pair = (tmp_path / "server.crt", tmp_path / "server.key")
    with pytest.raises(ManagerSetupError, match="cannot read the TLS key"):
        serve(0, tls=pair)
    for path in pair:
        path.write_text("not PEM")
    with pytest.raises(ManagerSetupError, match="unusable TLS files"):
        serve(0, tls=pair)
    result = runner.invoke(app, ["manager", "--port", "0", "--token-file", str(Path("/nope"))])
    assert result.exit_code == 2
    assert "cannot read the token file /nope" in flat(result.output)
