"""A warm silo's resident worker: one long-lived child of the warm server that runs the
silo's ClientApp tasks one after another, so a GPU silo keeps its CUDA context, torch's
state and its model (fedlb.deploy.model_cache) between rounds.

Why: with a fork per message (fedlb.deploy.warm) every round's ClientApp starts a fresh
CUDA context (0.26-0.43 s on an H200 machine) and moves the model to the GPU again:
~0.5 s of fixed cost per round that the silo's reports carry, and for which the balancer
gives the GPU silo too small a batch (docs/benchmarks.md, "A federation on a real GPU").
The warm server itself must stay CUDA-free to fork (fedlb.deploy.fork_safety); the worker
is forked from it once, at the same fork-safe point as a task, and may then use CUDA for
as long as it lives.

The trade-off: a resident worker gives up the fork per message's isolation. A
module-level global one message sets reaches the next, and so does a leak; an app's
modules load once per worker (the worker serves one run: a task of another run gets a
fresh worker, so a new FAB loads fresh). That is why it is the default only where a
fresh process costs a context start (a GPU silo, decided in the process that starts the
silo: `wanted`), and CPU silos keep one fork per message.

How: the server writes each task's `task_id token` line to the worker's pipe, and the
worker runs it through Flower's own `run_clientapp` (pull the message, install the FAB,
load the app, call it, push the reply), then writes `task_id code` back. Flower's
runtime ends a task with `flwr_exit` (exit handlers, a force-exit thread, SystemExit):
in the worker the runtime module's `flwr_exit` is replaced by `_task_ended`, which runs
Flower's exit handlers (both phases, as flwr_exit does: they push the task's final
status, stop its heartbeat and close its client; running them also removes them, so
the list does not grow) and returns to the worker's loop. The worker watches the server
(Flower's parent-process monitor, started once: a task's own is not started) and puts
its own signal handlers back after each task (Flower's runtime sets its own per task: a
SIGTERM mid-task still ends the task as Flower's does, with its status pushed).

A worker that dies mid-task (killed, crashed): the server reports that task failed at
once (warm_tasks.report_failed, as for a killed fork), says so in the silo's log, and
forks a fresh worker for the next task. A task that comes while the worker is busy (a
second run's) runs in a fork of its own, as without a resident worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType, ModuleType
from typing import Any, NoReturn

from fedlb import _flower_internals as flower

from .forked import Forked

RESIDENT_NAME = "fedlb-resident"  # the worker's process name
RESIDENT_SETTINGS = ("auto", "on", "off")
STARTED = "warm: resident worker pid"  # the server's line when it forks one (tests read it)
RUNS_IN = "runs in the resident worker pid"  # the server's line per task (tests read it)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
log = logging.getLogger("fedlb.warm")


def wanted(setting: str, device: str) -> bool:
    """Whether a warm silo training on `device` (its node config's: auto, cpu, cuda,
    cuda:N) runs its tasks in a resident worker, given `setting` (auto, on, off). Asked in
    the process that starts the silo, never in the warm launcher or server (where torch
    must not touch CUDA): `auto` with device `auto` asks torch whether a GPU is there."""
    if setting not in RESIDENT_SETTINGS:
        raise ValueError(f"resident must be one of {', '.join(RESIDENT_SETTINGS)}, got {setting!r}")
    if setting != "auto":
        return setting == "on"
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return bool(torch.cuda.is_available())


class _TaskEnded(BaseException):
    """Flower's runtime ended a task (its `flwr_exit`), with this exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _task_ended(code: int, *_args: Any, **_kwargs: Any) -> NoReturn:
    """`flwr_exit` as the ClientApp runtime sees it in the worker: Flower's exit handlers,
    both phases in flwr_exit's order, then back to the worker's loop (no force-exit
    thread, no SystemExit)."""
    flower.run_exit_handlers()
    raise _TaskEnded(int(code))


def _say(text: str) -> None:
    """A line of the worker's own in the silo's log (the worker keeps no log handlers of
    the server's: a ClientApp's logging is its own, as in a fresh process)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stderr.write(f"INFO {stamp} resident: {text}\n")
    sys.stderr.flush()


def run_task(runtime: ModuleType, runtime_api_address: str, token: str) -> int:
    """One task through Flower's `run_clientapp` (in `runtime`, its module, whose
    `flwr_exit` is `_task_ended`); its exit code. Flower's exit handlers have run when it
    returns, whatever happened."""
    from fedlb.flower.protocol import TASK_STARTED_ENV

    os.environ[TASK_STARTED_ENV] = repr(time.time())  # the ClientApp's start, for its report
    try:
        # no parent pid: the worker watches the server once, not a thread per task
        flower.run_clientapp(runtime_api_address, token, None, runtime)
    except _TaskEnded as ended:
        return ended.code
    except Exception as error:  # outside Flower's own try: its handlers still push FAILED
        _say(f"the ClientApp runtime raised {type(error).__name__}: {error}")
        code = 1
    else:
        code = 0  # returned without flwr_exit: not Flower 1.42's runtime
    flower.run_exit_handlers()
    return code


def _cuda_initialised() -> str:
    torch = sys.modules.get("torch")
    return "yes" if torch is not None and torch.cuda.is_initialized() else "no"


def serve_tasks(runtime_api_address: str, server_pid: int, tasks_fd: int, done_fd: int) -> int:
    """The worker's body (in a fork of the warm server): run each task read from
    `tasks_fd` in turn, write its end to `done_fd`; return when the server closes the
    pipe, exit when the server dies."""
    from . import model_cache

    runtime = flower.module(flower.CLIENTAPP_RUNTIME)
    # this process's runtime only (the server keeps Flower's): a task ends back in the loop
    flower.end_tasks_with(runtime, _task_ended)
    flower.watch_parent(server_pid)  # SIGINT here when the server is gone
    own: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {
        signum: signal.getsignal(signum) for signum in SIGNALS
    }
    handlers = flower.exit_handlers()
    baseline = len(handlers)
    served = 0
    while line := _read_line(tasks_fd, server_pid):
        task_id, token = line.split()
        served += 1
        _say(
            f"task {task_id} runs in worker pid {os.getpid()} (its task {served}; CUDA "
            f"initialised: {_cuda_initialised()})"
        )
        started = time.perf_counter()
        code = run_task(runtime, runtime_api_address, token)
        for signum, handler in own.items():  # Flower's runtime set its own per task
            signal.signal(signum, handler)
        left = len(handlers)
        if left != baseline:  # a handler registered outside flwr_exit's reach
            del handlers[baseline:]
            _say(f"dropped {left - baseline} exit handlers Flower's runtime left behind")
        counts = model_cache.COUNTS
        _say(
            f"task {task_id} ended with code {code} in {time.perf_counter() - started:.3f} "
            f"s (models built {counts.built}, reused {counts.reused})"
        )
        os.write(done_fd, f"{task_id} {code}\n".encode())
    return 0


def _read_line(descriptor: int, server_pid: int) -> str:
    """The next line from the server's pipe; '' when the server closed it or is gone. It
    waits in short slices: a signal (the parent monitor's SIGINT, raised in its own
    thread) is handled between them, and a server gone is seen without it."""
    data = bytearray()
    while True:
        ready, _, _ = select.select([descriptor], [], [], 0.5)
        if not ready:
            if os.getppid() != server_pid:
                return ""
            continue
        byte = os.read(descriptor, 1)
        if not byte:
            return ""
        if byte == b"\n":
            return data.decode()
        data += byte


@dataclass
class ResidentWorker:
    """The warm server's side of its resident worker: `run` hands it a task (forking it
    first where there is none, or it served another run), `poll` learns which tasks
    ended and whether it died, `busy` says whether a task runs in it now."""

    runtime_api_address: str
    failed: Callable[[str, str], None]  # (token, why): report a lost task failed
    process: Forked | None = None
    run_id: int | None = None  # the run it serves
    current: tuple[int, str, float] | None = None  # task id, token, when handed over
    _tasks: int = -1  # the pipe's write end (to the worker)
    _done: int = -1  # the read end (from the worker)
    _buffer: bytes = field(default=b"", repr=False)

    @property
    def busy(self) -> bool:
        return self.current is not None

    def run(self, task_id: int, token: str, run_id: int) -> int:
        """Hand the task to the worker (idle: `busy` is False); its pid."""
        assert self.current is None
        if self.process is not None and self.run_id != run_id:
            log.info(
                "warm: task %s is of run %s, the resident worker (pid %d) served run %s: "
                "it ends, a fresh one serves the new run",
                task_id,
                run_id,
                self.process.pid,
                self.run_id,
            )
            self.close()
        if self.process is None:
            self._fork()
            assert self.process is not None
            self.run_id = run_id
        pid = self.process.pid
        self.current = (task_id, token, time.perf_counter())
        try:
            os.write(self._tasks, f"{task_id} {token}\n".encode())
        except OSError as error:  # it died in between: `poll` reports the task failed
            log.warning("warm: could not hand task %s to the resident worker: %s", task_id, error)
        log.info("warm: task %s %s %d", task_id, RUNS_IN, pid)
        return pid

    def _fork(self) -> None:
        tasks_read, self._tasks = os.pipe()
        self._done, done_write = os.pipe()
        os.set_blocking(self._done, False)
        server, address = os.getpid(), self.runtime_api_address
        ends = (self._tasks, self._done)

        def worker() -> int:
            for end in ends:  # the server's ends: a child of the worker's never holds them
                os.close(end)
            return serve_tasks(address, server, tasks_read, done_write)

        self.process = Forked(worker, RESIDENT_NAME)
        os.close(tasks_read)
        os.close(done_write)
        log.info(
            "%s %d started (forked from the server; it runs this silo's ClientApp tasks one "
            "after another and keeps its CUDA context and model between them)",
            STARTED,
            self.process.pid,
        )

    def poll(self) -> None:
        """Collect the tasks the worker finished; if it died, report its task failed."""
        if self.process is None:
            return
        code = self.process.poll()
        self._read_ends()
        if code is None:
            return
        if code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        if self.current is not None:
            task_id, token, _ = self.current
            log.warning(
                "warm: the resident worker (pid %d) %s during task %s; the task fails as a "
                "crashed app's process does, and the next task gets a fresh worker",
                self.process.pid,
                how,
                task_id,
            )
            self.failed(token, f"its process (the silo's resident worker) {how}")
            self.current = None
        else:
            log.warning(
                "warm: the resident worker (pid %d) %s between tasks; the next task gets a "
                "fresh worker",
                self.process.pid,
                how,
            )
        self._forget()

    def _read_ends(self) -> None:
        while True:
            try:
                chunk = os.read(self._done, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            task_id, code = line.decode().split()
            if self.current is None or str(self.current[0]) != task_id:
                continue
            took = time.perf_counter() - self.current[2]
            if code != "0":
                log.warning(
                    "warm: task %s ended with code %s in the resident worker (its log is above)",
                    task_id,
                    code,
                )
            else:
                log.info("warm: task %s ended in the resident worker in %.2f s", task_id, took)
            self.current = None

    def _forget(self) -> None:
        for end in (self._tasks, self._done):
            with contextlib.suppress(OSError):
                os.close(end)
        self.process, self.run_id, self._buffer = None, None, b""
        self._tasks = self._done = -1

    def close(self) -> None:
        """End the worker (between tasks: it holds nothing of a task)."""
        if self.process is None:
            return
        process = self.process
        process.terminate()
        try:
            process.wait(5)
        except Exception:
            process.kill()
            with contextlib.suppress(Exception):
                process.wait(5)
        self._forget()
