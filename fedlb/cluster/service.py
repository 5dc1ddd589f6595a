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

One client cannot stall the others: a waiting report holds a server thread, so waiting
reports are capped below the thread count (a reserve stays free for Register and
non-waiting reports), one per worker (a newer one replaces it), and a cancelled call
frees its thread at once. Jobs, workers per job and iterations in flight are capped too
(`ServiceLimits`); past a cap the answer is RESOURCE_EXHAUSTED saying which limit. Every
field of a request is checked (service_requests.py); an optional token and TLS decide who
may call (service_auth.py).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from fedlb.balance import BatchSizeManager, WorkerReport

from .policies import CLUSTER_POLICIES
from .service_auth import ManagerSetupError, TokenCheck, read_token, server_credentials
from .service_client import SERVICE, ManagerClient
from .service_requests import MAX_REQUEST_BYTES, RequestError, parse_register, parse_report
from .service_requests import decode as _decode
from .service_requests import encode as _encode

log = logging.getLogger("fedlb.cluster")

KEEP_DECIDED = 2  # decided iterations kept behind the newest, for late or repeated reports
MAX_PENDING_ITERATIONS = 64  # iterations of one job still missing reports
_WAIT_SLICE_S = 1.0  # a waiting call re-checks its client at least this often
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

__all__ = [
    "ManagerClient",
    "ManagerService",
    "ManagerSetupError",
    "PortInUseError",
    "RequestError",
    "ServiceLimits",
    "serve",
]


class PortInUseError(OSError):
    """Another process listens on the port (gRPC's SO_REUSEPORT is off: no sharing)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(
            errno.EADDRINUSE, f"port {port} is already in use by another process; pick another port"
        )
        self.host, self.port = host, port


@dataclass(frozen=True)
class ServiceLimits:
    """The most one manager holds; past each, calls get RESOURCE_EXHAUSTED saying so.

    Attributes:
        max_jobs: jobs at once. A job with no call for `job_idle_s` and no waiting report is
            forgotten (a later call gets NOT_FOUND; Register makes it anew).
        max_job_workers: workers of one job.
        max_waiting: waiting reports (wait=true) at once, all jobs together. Each holds a server
            thread, so `serve` keeps this below its thread count.
    """

    max_jobs: int = 64
    max_job_workers: int = 1024
    job_idle_s: float = 3600.0
    max_waiting: int = 56

    def __post_init__(self) -> None:
        for name, low in (("max_jobs", 1), ("max_job_workers", 1), ("max_waiting", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
        if not math.isfinite(self.job_idle_s) or self.job_idle_s <= 0:
            raise ValueError(f"job_idle_s must be a number of seconds > 0, got {self.job_idle_s}")


def waiting_slots(max_workers: int) -> int:
    """Threads waiting reports may hold: the rest (an eighth, at least one) stay free."""
    return max_workers - max(1, max_workers // 8)


@dataclass(eq=False)
class _Waiter:
    iteration: int
    replaced: bool = False  # a newer waiting report of the same worker took its place


@dataclass(eq=False)
class _Job:
    manager: BatchSizeManager
    workers: tuple[str, ...]
    last_call: float
    condition: threading.Condition = field(default_factory=threading.Condition)
    pending: dict[int, dict[str, WorkerReport]] = field(default_factory=dict)
    decided: dict[int, dict[str, int]] = field(default_factory=dict)
    waiting: dict[str, _Waiter] = field(default_factory=dict)
    latest: int = 0
    forgotten: bool = False

    def missing(self, iteration: int) -> str:
        return _names(set(self.workers) - set(self.pending.get(iteration, {})))


def _names(names: set[str] | tuple[str, ...]) -> str:
    """Names for a message: a job may have a thousand."""
    shown = sorted(names)
    if len(shown) <= 10:
        return str(shown)
    return f"{str(shown[:10])[:-1]}, ... ({len(shown)} in all)]"


class ManagerService:
    """The service's state: one BatchSizeManager per job. Locks, always in this order:
    the jobs lock, a job's condition, the waiting count's lock."""

    def __init__(
        self,
        wait_timeout: float = 60.0,
        limits: ServiceLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.wait_timeout = wait_timeout
        self.limits = limits or ServiceLimits()
        self.jobs: dict[str, _Job] = {}
        self._clock = clock  # for idle expiry only; waits use real time
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._waiting = 0
        self._closed = False

    @property
    def waiting(self) -> int:
        """Reports waiting now (each holds a server thread)."""
        return self._waiting

    def close(self) -> None:
        """Wake every waiting report with UNAVAILABLE (the server is stopping)."""
        self._closed = True
        with self._lock:
            jobs = list(self.jobs.values())
        for job in jobs:
            self._wake(job)

    def _forget_if_idle(self, name: str, job: _Job) -> bool:
        """Forget `job` if it is idle; the caller holds the jobs lock."""
        with job.condition:
            if job.waiting or self._clock() - job.last_call < self.limits.job_idle_s:
                return False
            job.forgotten = True
        del self.jobs[name]
        log.info("job %s forgotten: no call for %g s", name, self.limits.job_idle_s)
        return True

    def _job(self, name: str) -> _Job:
        with self._lock:
            job = self.jobs.get(name)
            if job is not None and self._forget_if_idle(name, job):
                job = None
        if job is None:
            raise RequestError(
                f"unknown job {name!r}: Register it first (a job idle for "
                f"{self.limits.job_idle_s:g} s is forgotten)",
                grpc.StatusCode.NOT_FOUND,
            )
        return job

    def register(self, request: dict[str, Any]) -> dict[str, Any]:
        wanted = parse_register(request, self.limits.max_job_workers)
        chosen = CLUSTER_POLICIES[wanted.policy]
        with self._lock:
            for name, other in list(self.jobs.items()):  # a sweep costs little at <= max_jobs
                self._forget_if_idle(name, other)
            job = self.jobs.get(wanted.job)
            if job is None:
                if len(self.jobs) >= self.limits.max_jobs:
                    raise RequestError(
                        f"the manager holds {len(self.jobs)} jobs, its limit, none idle for "
                        f"{self.limits.job_idle_s:g} s; raise it with fedlb manager --max-jobs "
                        "(or forget idle jobs sooner with --job-idle-timeout)",
                        _EXHAUSTED,
                    )
                manager = BatchSizeManager(
                    dict.fromkeys(wanted.workers, wanted.batch_size),
                    chosen.make_tuner(),
                    chosen.make_estimator(),
                )
                job = self.jobs[wanted.job] = _Job(manager, wanted.workers, self._clock())
                log.info(
                    "job %s: %d workers, B0 = %d, %s",
                    wanted.job,
                    len(wanted.workers),
                    wanted.batch_size,
                    wanted.policy,
                )
            elif sorted(job.workers) != sorted(wanted.workers):
                raise RequestError(
                    f"job {wanted.job} is registered with workers {_names(job.workers)}",
                    grpc.StatusCode.ALREADY_EXISTS,
                )
            with job.condition:
                job.last_call = self._clock()
                return {"sizes": dict(job.manager.sizes)}

    def report(
        self, request: dict[str, Any], context: grpc.ServicerContext | None = None
    ) -> dict[str, Any]:
        """A report's answer; a waiting one also ends when `context`'s client goes away."""
        wanted = parse_report(request)
        job = self._job(wanted.job)
        if wanted.worker not in job.workers:
            raise RequestError(f"worker {wanted.worker!r} is not in job {wanted.job!r}")
        report = WorkerReport(
            worker=wanted.worker,
            batch_size=wanted.batch_size,
            iterations=1,
            compute_s=wanted.compute_s,
            cpu=wanted.cpu,
            mem=wanted.mem,
            accel_mem=wanted.accel_mem,
        )
        iteration, worker = wanted.iteration, wanted.worker
        with job.condition:
            if job.forgotten:  # forgotten between the lookup and here
                raise RequestError(f"unknown job {wanted.job!r}", grpc.StatusCode.NOT_FOUND)
            job.last_call = self._clock()
            if iteration in job.decided:
                return {"batch_size": job.decided[iteration][worker], "iteration": iteration}
            if iteration < job.latest - KEEP_DECIDED:
                raise RequestError(
                    f"iteration {iteration} of job {wanted.job!r} is over: sizes are decided "
                    f"up to iteration {job.latest}",
                    grpc.StatusCode.FAILED_PRECONDITION,
                )
            arrived = job.pending.get(iteration, {})
            if not arrived and len(job.pending) >= MAX_PENDING_ITERATIONS:
                oldest = min(job.pending)
                raise RequestError(
                    f"job {wanted.job!r} has {len(job.pending)} iterations missing reports, "
                    f"its limit; the oldest, {oldest}, has none from {job.missing(oldest)}: "
                    "a worker stopped or is far behind",
                    _EXHAUSTED,
                )
            complete = len(arrived) + (worker not in arrived) == len(job.workers)
            # the last report of an iteration needs no slot: it is answered at once
            waiter = None
            if wanted.wait and not complete:
                waiter = self._admit(job, wanted.job, worker, iteration)
            job.pending.setdefault(iteration, {})[worker] = report
            if complete:
                self._decide(job, iteration)
            if waiter is not None:
                return self._wait(job, worker, waiter, context)
            if wanted.wait:
                return {"batch_size": job.decided[iteration][worker], "iteration": iteration}
            newest = job.decided.get(job.latest, job.manager.sizes)
            return {"batch_size": newest[worker], "iteration": job.latest}

    def _admit(self, job: _Job, name: str, worker: str, iteration: int) -> _Waiter:
        """A waiting slot for `worker`, or RESOURCE_EXHAUSTED; the job's condition is held."""
        waiter = _Waiter(iteration)
        previous = job.waiting.get(worker)
        if previous is not None:  # a retry: the newer call takes over the older one's slot
            previous.replaced = True
            job.condition.notify_all()
        else:
            with self._count_lock:
                if self._waiting >= self.limits.max_waiting:
                    raise RequestError(
                        f"the manager holds {self._waiting} waiting reports, its limit (each "
                        f"holds a thread); worker {worker!r} of job {name!r} cannot wait: "
                        "report with wait=false, or raise fedlb manager --max-workers",
                        _EXHAUSTED,
                    )
                self._waiting += 1
        job.waiting[worker] = waiter
        return waiter

    def _decide(self, job: _Job, iteration: int) -> None:
        job.decided[iteration] = job.manager.step(job.pending.pop(iteration).values())
        job.latest = max(job.latest, iteration)
        oldest = job.latest - KEEP_DECIDED
        for old in [k for k in job.decided if k < oldest]:
            del job.decided[old]
        for old in [k for k in job.pending if k < oldest]:  # abandoned: the job moved on
            del job.pending[old]
        job.condition.notify_all()

    def _wake(self, job: _Job) -> None:
        with job.condition:
            job.condition.notify_all()

    def _wait(
        self, job: _Job, worker: str, waiter: _Waiter, context: grpc.ServicerContext | None
    ) -> dict[str, Any]:
        """Wait for `waiter`'s iteration to be decided; the job's condition is held."""
        iteration = waiter.iteration
        deadline = time.monotonic() + self.wait_timeout
        if context is not None:  # a cancelled or broken call wakes its handler at once
            context.add_callback(lambda: self._wake(job))
        try:
            while iteration not in job.decided:
                if waiter.replaced:
                    raise RequestError(
                        f"a newer waiting report from worker {worker!r} replaced this one",
                        grpc.StatusCode.ABORTED,
                    )
                if iteration not in job.pending:
                    raise RequestError(
                        f"iteration {iteration} was abandoned: the job decided iteration "
                        f"{job.latest} without it",
                        grpc.StatusCode.ABORTED,
                    )
                if self._closed:
                    raise RequestError("the manager is stopping", grpc.StatusCode.UNAVAILABLE)
                if context is not None and not context.is_active():
                    raise RequestError("the client went away", grpc.StatusCode.CANCELLED)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RequestError(
                        f"iteration {iteration}: no report from {job.missing(iteration)} "
                        f"within {self.wait_timeout:g} s",
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                    )
                job.condition.wait(min(remaining, _WAIT_SLICE_S))
            return {"batch_size": job.decided[iteration][worker], "iteration": iteration}
        finally:
            if job.waiting.get(worker) is waiter:
                del job.waiting[worker]
                with self._count_lock:
                    self._waiting -= 1


class _Throttle:
    """At most one log line per kind of refusal per `period_s`: a flood stays readable."""

    def __init__(self, period_s: float = 10.0) -> None:
        self.period_s = period_s
        self._last: dict[str, float] = {}

    def __call__(self, kind: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(kind, -math.inf) < self.period_s:
            return False
        self._last[kind] = now
        return True


def _handler(
    method: Callable[[dict[str, Any], grpc.ServicerContext], dict[str, Any]],
    throttle: _Throttle,
) -> Any:
    def handle(data: bytes, context: grpc.ServicerContext) -> dict[str, Any]:
        try:
            return method(_decode(data), context)
        except RequestError as error:
            if error.code == _EXHAUSTED and throttle(str(error)[:30]):
                log.warning("refused: %s", error)
            context.abort(error.code, str(error))
            raise  # abort raises; this line is for type checkers

    # no deserializer: the raw bytes reach `handle`, whose errors become statuses
    return grpc.unary_unary_rpc_method_handler(handle, response_serializer=_encode)


def _bind_error(host: str, port: int) -> OSError | None:
    """Why listening on host:port fails, from a plain bind (gRPC only says that it does)."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        return OSError(f"cannot listen on {host}:{port}: {error.strerror}")
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            # as gRPC does: a stopped server's connections in TIME_WAIT are no conflict
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return PortInUseError(host, port)
                return OSError(error.errno, f"cannot listen on {host}:{port}: {error.strerror}")
    return None


def serve(
    port: int = 0,
    host: str = "127.0.0.1",
    max_workers: int = 64,
    wait_timeout: float = 60.0,
    *,
    limits: ServiceLimits | None = None,
    token: str | None = None,
    tls: tuple[Path, Path] | None = None,
) -> tuple[grpc.Server, int, ManagerService]:
    """Start the service; returns (server, the port it listens on, its state).

    `max_workers` threads; waiting reports hold one each and may take all but an eighth
    (`limits.max_waiting` is lowered to that). `token`: calls must carry it (see
    ManagerClient). `tls`: (certificate, key) PEM files to serve TLS with. Raises
    PortInUseError when another process listens on the port, OSError when the address
    cannot be used, ValueError or ManagerSetupError for bad arguments or files."""
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be a whole number >= 1, got {max_workers!r}")
    if not math.isfinite(wait_timeout) or wait_timeout <= 0:
        raise ValueError(f"wait_timeout must be a number of seconds > 0, got {wait_timeout}")
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535 (0: a free one), got {port}")
    limits = limits or ServiceLimits()
    slots = min(limits.max_waiting, waiting_slots(max_workers))
    service = ManagerService(wait_timeout, dataclasses.replace(limits, max_waiting=slots))
    credentials = server_credentials(*tls) if tls is not None else None
    if port != 0:  # checked first: gRPC's own failure also writes C-level lines to stderr
        error = _bind_error(host, port)
        if error is not None:
            raise error
    throttle = _Throttle()
    handlers = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Register": _handler(lambda request, _: service.register(request), throttle),
            "Report": _handler(service.report, throttle),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers, "fedlb-manager"),
        interceptors=[TokenCheck(token)] if token is not None else None,
        options=[
            ("grpc.so_reuseport", 0),  # a second manager on the port must fail, not share
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ],
        maximum_concurrent_rpcs=4 * max_workers,  # past it: RESOURCE_EXHAUSTED, not a queue
    )
    server.add_generic_rpc_handlers((handlers,))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpcio >= 1.5x raises where older ones returned 0
        bound = 0
    if bound == 0:
        raise _bind_error(host, port) or OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound, service


def start_manager(
    port: int,
    host: str,
    max_workers: int,
    wait_timeout: float,
    limits: ServiceLimits,
    token_file: Path | None = None,
    certs: Path | None = None,
) -> tuple[grpc.Server, int, ManagerService, bool]:
    """`fedlb manager`'s service: `serve` with its token read from `token_file` (else
    $FEDLB_MANAGER_TOKEN) and TLS from `certs` (the folder of `fedlb certs`); returns
    serve's three and whether calls must carry a token. Every reason it cannot start is
    a ManagerSetupError that says what to do."""
    from fedlb.security import TlsError, TlsFiles

    try:
        token = read_token(token_file)
        tls = None
        if certs is not None:
            files = TlsFiles.from_folder(certs)
            tls = (files.cert, files.key)
        started = serve(port, host, max_workers, wait_timeout, limits=limits, token=token, tls=tls)
        return (*started, token is not None)
    except PortInUseError as error:
        raise ManagerSetupError(
            f"port {port} is already in use by another process; pick another --port"
        ) from error
    except (OSError, ValueError, TlsError) as error:
        raise ManagerSetupError(str(error)) from error
