"""The manager service's requests: JSON decoded defensively and checked field by field.

Whatever a client sends, the answer is a RequestError naming the field and what it allows
(INVALID_ARGUMENT), never a traceback: the size is bounded before parsing, nesting too deep
for the parser and integer literals too long for any field are caught, every field has a
type and a range.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import grpc

from fedlb.balance import LONGEST_S

from .policies import BALANCING_POLICIES, DEFAULT_CLUSTER_POLICY

MAX_REQUEST_BYTES = 256 * 1024  # a Register of 1024 workers with 128-character names fits
MAX_NAME_CHARS = 128
MAX_BATCH_SIZE = 1 << 20
MAX_ITERATION = (1 << 53) - 1  # the largest integer every JSON reader keeps exactly
_MAX_INT_DIGITS = 20  # longer integer literals are no field's value; never converted

REGISTER_FIELDS = ("job", "workers", "batch_size", "policy")
REPORT_FIELDS = (
    "job",
    "worker",
    "iteration",
    "batch_size",
    "compute_s",
    "cpu",
    "mem",
    "accel_mem",
    "wait",
)


class RequestError(ValueError):
    """A request the service refuses; `code` is the gRPC status to answer with."""

    def __init__(
        self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    ) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _LongInteger:
    """An integer literal too long to be any field's value, kept unconverted: Python
    refuses to convert past 4300 digits, and converting is quadratic below that."""

    digits: int


def _parse_int(text: str) -> int | _LongInteger:
    if len(text) > _MAX_INT_DIGITS:
        return _LongInteger(len(text.lstrip("-")))
    return int(text)


def decode(data: bytes) -> dict[str, Any]:
    """A request's JSON object, or RequestError saying why it is not one."""
    if len(data) > MAX_REQUEST_BYTES:
        raise RequestError(
            f"the request is {len(data)} bytes, more than the service's {MAX_REQUEST_BYTES}"
        )
    try:
        value = json.loads(data, parse_int=_parse_int)
    except RecursionError as error:  # the C parser's guard against deep nesting
        raise RequestError("not a JSON request: nested too deeply") from error
    except ValueError as error:  # bad JSON or bad UTF-8 alike
        raise RequestError(f"not a JSON request: {error}") from error
    if not isinstance(value, dict):
        raise RequestError(f"a request is a JSON object, got {_show(value)}")
    return value


def encode(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()


def _show(value: Any) -> str:
    """A value for a message: short, and never a repr of a deeply nested structure."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, _LongInteger):
        return f"a {value.digits}-digit number"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} characters)"
    return "a list" if isinstance(value, list) else "an object"


def _only(request: dict[str, Any], allowed: tuple[str, ...], kind: str) -> None:
    unknown = sorted(set(request) - set(allowed))
    if unknown:
        raise RequestError(
            f"unknown field {_show(unknown[0])} in a {kind} request; it has {', '.join(allowed)}"
        )


def _name(request: dict[str, Any], key: str) -> str:
    value = request.get(key)
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_NAME_CHARS:
        raise RequestError(
            f"{key} must be a name of 1 to {MAX_NAME_CHARS} characters, got {_show(value)}"
        )
    return value


def _whole(request: dict[str, Any], key: str, low: int, high: int) -> int:
    value = request.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not float(value).is_integer()
        or not low <= value <= high
    ):
        raise RequestError(f"{key} must be a whole number in {low}..{high}, got {_show(value)}")
    return int(value)


def _real(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fraction(request: dict[str, Any], key: str) -> float | None:
    value = request.get(key)
    if value is None:
        return None
    if not _real(value) or not 0.0 <= value <= 1.0:  # NaN fails the comparison too
        raise RequestError(f"{key} must be a fraction in [0, 1] or null, got {_show(value)}")
    return float(value)


@dataclass(frozen=True)
class RegisterRequest:
    job: str
    workers: tuple[str, ...]
    batch_size: int
    policy: str


@dataclass(frozen=True)
class ReportRequest:
    job: str
    worker: str
    iteration: int
    batch_size: int
    compute_s: float
    cpu: float | None
    mem: float | None
    accel_mem: float | None
    wait: bool


def parse_register(request: dict[str, Any], max_job_workers: int) -> RegisterRequest:
    _only(request, REGISTER_FIELDS, "Register")
    job = _name(request, "job")
    workers = request.get("workers")
    if not isinstance(workers, list) or not workers:
        raise RequestError(f"workers must be a non-empty list of names, got {_show(workers)}")
    if len(workers) > max_job_workers:
        raise RequestError(
            f"job {job!r} has {len(workers)} workers, more than the service's limit of "
            f"{max_job_workers} per job (raise it with fedlb manager --max-job-workers)",
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
    for index, name in enumerate(workers):
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS:
            raise RequestError(
                f"workers[{index}] must be a name of 1 to {MAX_NAME_CHARS} characters, "
                f"got {_show(name)}"
            )
    if len(set(workers)) != len(workers):
        twice = next(name for name in workers if workers.count(name) > 1)
        raise RequestError(f"workers must be distinct names; {_show(twice)} is there twice")
    batch = _whole(request, "batch_size", 1, MAX_BATCH_SIZE)
    policy = request.get("policy", DEFAULT_CLUSTER_POLICY)
    if not isinstance(policy, str) or policy not in BALANCING_POLICIES:
        # the manager serves batch sizes: only the balancing policies (asp, eager, ... are
        # training schemes of their own, run by fedlb cluster)
        raise RequestError(
            f"policy must be one of {', '.join(BALANCING_POLICIES)}, got {_show(policy)}"
        )
    return RegisterRequest(job, tuple(workers), batch, policy)


def parse_report(request: dict[str, Any]) -> ReportRequest:
    _only(request, REPORT_FIELDS, "Report")
    job, worker = _name(request, "job"), _name(request, "worker")
    iteration = _whole(request, "iteration", 0, MAX_ITERATION)
    batch = _whole(request, "batch_size", 1, MAX_BATCH_SIZE)
    compute = request.get("compute_s")
    # > 0: a speed is B / compute_s; capped where the balancer calls a time corrupt
    if not _real(compute) or not math.isfinite(compute) or not 0 < compute <= LONGEST_S:
        raise RequestError(
            f"compute_s must be a finite number of seconds in (0, {LONGEST_S:g}], "
            f"got {_show(compute)}"
        )
    cpu, mem, accel_mem = (_fraction(request, key) for key in ("cpu", "mem", "accel_mem"))
    wait = request.get("wait", True)
    if not isinstance(wait, bool):
        raise RequestError(f"wait must be true or false, got {_show(wait)}")
    return ReportRequest(job, worker, iteration, batch, float(compute), cpu, mem, accel_mem, wait)
