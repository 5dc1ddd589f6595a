"""Shared helpers of the `fedlb manager` tests (tests/test_cluster_service_*.py): the
service's method paths, a test token, a service running on a free port, raw and typed
calls, and the autouse fixture that keeps a manager token in the environment out of them
(each of those files imports it)."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner

from fedlb.cluster import RequestError
from fedlb.cluster.service import ManagerService, serve
from fedlb.cluster.service_auth import TOKEN_ENV

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
