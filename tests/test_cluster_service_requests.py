"""`fedlb manager` on a real server on 127.0.0.1, against hostile requests: every field is
checked and hostile JSON is an INVALID_ARGUMENT naming it, oversized requests are refused
unread, jobs, workers and iterations in flight are capped and idle jobs forgotten."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlb.cluster import ManagerClient
from fedlb.cluster.service import MAX_PENDING_ITERATIONS, ManagerService, ServiceLimits
from fedlb.cluster.service_requests import MAX_REQUEST_BYTES
from tests.cluster_service_helpers import (
    REGISTER,
    REPORT,
    _no_token_in_the_environment,  # noqa: F401 (autouse)
    outcome,
    raw,
    refused,
    report,
    running,
    until,
)

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
