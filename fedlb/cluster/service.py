"""The BatchSizeManager as a gRPC service: "here is my report, what is my next batch size?"

For workers that are not torch.distributed ranks of one job: a TensorFlow or JAX job, a
plain loop, or several jobs at once (each has its own manager, by job name). The LB-BSP
paper's BatchSizeManager was a Thrift service with a thread pool; this is the same over
grpcio, with JSON messages (no generated code to ship):

    /fedlb.BatchSizeManager/Register  {job, workers: [names], batch_size, policy}
                                      -> {sizes: {name: B}}
    /fedlb.BatchSizeManager/Report    {job, worker, iteration, batch_size, compute_s,
                                       cpu?, mem?, accel_mem?, wait?}
                                      -> {batch_size, iteration}

`Report` with wait=true (BSP) returns once every worker of the job has reported that
iteration, with the size decided from all of them; wait=false returns at once with the
newest decided size (the sizes then apply one iteration late, as in GPU mode). A worker
that waits longer than the service's `wait_timeout` gets DEADLINE_EXCEEDED naming the
workers that did not report.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from fedlb.balance import (
    BatchSizeManager,
    WorkerReport,
)

from .policies import CLUSTER_POLICIES, DEFAULT_CLUSTER_POLICY

log = logging.getLogger("fedlb.cluster")

SERVICE = "fedlb.BatchSizeManager"


class RequestError(ValueError):
    """A request the service refuses; `code` is the gRPC status to answer with."""

    def __init__(
        self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    ) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Job:
    manager: BatchSizeManager
    workers: list[str]
    condition: threading.Condition = field(default_factory=threading.Condition)
    pending: dict[int, dict[str, WorkerReport]] = field(default_factory=dict)
    decided: dict[int, dict[str, int]] = field(default_factory=dict)
    latest: int = 0


def _number(request: dict[str, Any], key: str, kind: type = float, default: Any = None) -> Any:
    value = request.get(key)
    if value is None:  # missing or null alike
        if key in ("job", "worker", "iteration"):
            raise RequestError(f"the request has no {key}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{key} must be a number, got {value!r}")
    if kind is int and not float(value).is_integer():
        raise RequestError(f"{key} must be a whole number, got {value!r}")
    return kind(value)


class ManagerService:
    """The service's state: one BatchSizeManager per job."""

    def __init__(self, wait_timeout: float = 60.0) -> None:
        self.wait_timeout = wait_timeout
        self.jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    def register(self, request: dict[str, Any]) -> dict[str, Any]:
        job_name = str(request.get("job") or "")
        workers = request.get("workers")
        if not job_name:
            raise RequestError("the request has no job name")
        if (
            not isinstance(workers, list)
            or not workers
            or len(set(map(str, workers))) != len(workers)
        ):
            raise RequestError("workers must be a non-empty list of distinct names")
        batch = _number(request, "batch_size", int, 0)
        if batch < 1:
            raise RequestError(f"batch_size must be >= 1, got {batch}")
        policy = str(request.get("policy", DEFAULT_CLUSTER_POLICY))
        if policy not in CLUSTER_POLICIES:
            raise RequestError(f"policy must be one of {', '.join(CLUSTER_POLICIES)}")
        chosen = CLUSTER_POLICIES[policy]
        names = [str(w) for w in workers]
        with self._lock:
            job = self.jobs.get(job_name)
            if job is None:
                manager = BatchSizeManager(
                    dict.fromkeys(names, batch), chosen.make_tuner(), chosen.make_estimator()
                )
                job = self.jobs[job_name] = _Job(manager, names)
                log.info("job %s: %d workers, B0 = %d, %s", job_name, len(names), batch, policy)
            elif sorted(job.workers) != sorted(names):
                raise RequestError(
                    f"job {job_name} is registered with workers {job.workers}",
                    grpc.StatusCode.ALREADY_EXISTS,
                )
        return {"sizes": dict(job.manager.sizes)}

    def report(self, request: dict[str, Any]) -> dict[str, Any]:
        job = self.jobs.get(str(request.get("job")))
        if job is None:
            raise RequestError(
                f"unknown job {request.get('job')!r}: Register it first", grpc.StatusCode.NOT_FOUND
            )
        worker = str(request.get("worker"))
        if worker not in job.workers:
            raise RequestError(f"worker {worker!r} is not in job {request.get('job')!r}")
        iteration = _number(request, "iteration", int)
        compute = _number(request, "compute_s")
        if compute is None or not math.isfinite(compute) or compute <= 0:
            raise RequestError(f"compute_s must be a finite number > 0, got {compute!r}")
        batch = _number(request, "batch_size", int, 0)
        if batch < 1:
            raise RequestError(f"batch_size must be >= 1, got {batch}")
        report = WorkerReport(
            worker=worker,
            batch_size=batch,
            iterations=1,
            compute_s=compute,
            cpu=_number(request, "cpu"),
            mem=_number(request, "mem"),
            accel_mem=_number(request, "accel_mem"),
        )
        with job.condition:
            if iteration <= job.latest and iteration in job.decided:
                return {"batch_size": job.decided[iteration][worker], "iteration": iteration}
            arrived = job.pending.setdefault(iteration, {})
            arrived[worker] = report
            if len(arrived) == len(job.workers):
                job.decided[iteration] = job.manager.step(arrived.values())
                job.latest = max(job.latest, iteration)
                del job.pending[iteration]
                for old in [k for k in job.decided if k < iteration - 2]:
                    del job.decided[old]
                job.condition.notify_all()
            if request.get("wait", True):
                if not job.condition.wait_for(
                    lambda: iteration in job.decided, timeout=self.wait_timeout
                ):
                    missing = sorted(set(job.workers) - set(job.pending.get(iteration, {})))
                    raise RequestError(
                        f"iteration {iteration}: no report from {missing} within "
                        f"{self.wait_timeout:g} s",
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                    )
                return {"batch_size": job.decided[iteration][worker], "iteration": iteration}
            latest = job.decided.get(job.latest, job.manager.sizes)
            return {"batch_size": latest[worker], "iteration": job.latest}


def _handler(
    method: Callable[[dict[str, Any]], dict[str, Any]],
) -> Callable[[dict[str, Any], grpc.ServicerContext], dict[str, Any]]:
    def handle(request: dict[str, Any], context: grpc.ServicerContext) -> dict[str, Any]:
        try:
            return method(request)
        except RequestError as error:
            context.abort(error.code, str(error))
            raise  # abort raises; this line is for type checkers

    return handle


def _decode(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as error:
        raise RequestError(f"not a JSON request: {error}") from error
    if not isinstance(value, dict):
        raise RequestError("a request is a JSON object")
    return value


def _encode(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()


def serve(
    port: int = 0, host: str = "127.0.0.1", max_workers: int = 64, wait_timeout: float = 60.0
) -> tuple[grpc.Server, int, ManagerService]:
    """Start the service; returns (server, the port it listens on, its state). Waiting
    reports hold a thread each: `max_workers` must exceed the workers of all jobs."""
    service = ManagerService(wait_timeout)

    def safe_decode(data: bytes) -> dict[str, Any]:
        try:
            return _decode(data)
        except RequestError:
            return {"__invalid__": data[:80].decode(errors="replace")}

    def guarded(method: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
        def call(request: dict[str, Any]) -> dict[str, Any]:
            if "__invalid__" in request:
                raise RequestError(f"not a JSON object: {request['__invalid__']!r}")
            return method(request)

        return grpc.unary_unary_rpc_method_handler(
            _handler(call), request_deserializer=safe_decode, response_serializer=_encode
        )

    handlers = grpc.method_handlers_generic_handler(
        SERVICE, {"Register": guarded(service.register), "Report": guarded(service.report)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers, "fedlb-manager"))
    server.add_generic_rpc_handlers((handlers,))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound, service


class ManagerClient:
    """A worker's side: `register` once, then `report` at every iteration boundary."""

    def __init__(self, address: str, timeout: float = 120.0) -> None:
        self.channel = grpc.insecure_channel(address)
        self.timeout = timeout
        self._register = self.channel.unary_unary(
            f"/{SERVICE}/Register", request_serializer=_encode, response_deserializer=json.loads
        )
        self._report = self.channel.unary_unary(
            f"/{SERVICE}/Report", request_serializer=_encode, response_deserializer=json.loads
        )

    def register(
        self, job: str, workers: list[str], batch_size: int, policy: str = DEFAULT_CLUSTER_POLICY
    ) -> dict[str, int]:
        answer = self._register(
            {"job": job, "workers": workers, "batch_size": batch_size, "policy": policy},
            timeout=self.timeout,
        )
        return dict(answer["sizes"])

    def report(
        self,
        job: str,
        worker: str,
        iteration: int,
        batch_size: int,
        compute_s: float,
        *,
        cpu: float | None = None,
        mem: float | None = None,
        accel_mem: float | None = None,
        wait: bool = True,
    ) -> int:
        """This worker's next batch size."""
        request = {
            "job": job,
            "worker": worker,
            "iteration": iteration,
            "batch_size": batch_size,
            "compute_s": compute_s,
            "cpu": cpu,
            "mem": mem,
            "accel_mem": accel_mem,
            "wait": wait,
        }
        answer = self._report(request, timeout=self.timeout)
        return int(answer["batch_size"])

    def close(self) -> None:
        self.channel.close()
