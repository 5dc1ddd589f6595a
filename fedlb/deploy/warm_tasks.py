"""A warm server's tasks (fedlb.deploy.warm): each runs in a fork of the server while torch
there is fork-safe (fedlb.deploy.fork_safety), else in Flower's own process, started as
Flower's SuperExec starts it (cold); their ends are collected, and a killed one is
reported as failed so that its message is answered at once.

The choice is made before every task: a fork of a process that initialised CUDA or ran
autograd's backward (a --preload module that trains at import, say) cannot use CUDA or
run backward on a CUDA build, so every ClientApp would fail and every round lose that
silo. Such a server says why in its log, once, and from then on starts each task as
`flwr-clientapp --runtime-api-address A --token T --insecure --parent-pid P` (or
`flwr-serverapp`, `flwr-simulation`): what Flower's own SuperExec runs, found like the
other console scripts (fedlb.deploy.console_scripts).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedlb import _flower_internals as flower

from . import fork_safety
from .console_scripts import MissingScriptError, console_script
from .forked import Forked
from .prompt import fast_reply_pulls, flush_without_pause

CLIENTAPP, SERVERAPP, SIMULATION = "clientapp", "serverapp", "simulation"  # kinds of task
# Flower's name of each kind (flwr.supercore.constant.TaskType), its command
TASK_TYPES = dict(zip((CLIENTAPP, SERVERAPP, SIMULATION), flower.TASK_TYPES, strict=True))
TASK_NAME = "fedlb-task"  # a forked task's process name
COLD = "warm: tasks run cold"  # the log's line when a server stops forking (tests read it)
log = logging.getLogger("fedlb.warm")


@dataclass
class TaskStarter:
    """Starts one warm server's tasks of one kind: `start(task_id, token)` -> the pid of
    the process that runs it (None: it could not start, and was reported failed)."""

    runtime_api_address: str
    task: str = CLIENTAPP
    root_certificates: Path | None = None  # the runtime API's CA (None: plain HTTP)
    forking: bool = True  # False once forking was found unsafe: for good

    def forks(self) -> bool:
        """Whether the next task may run in a fork of this server; once it may not, says
        why (once) and never forks again."""
        if self.forking and (hazards := fork_safety.hazards()):
            self.forking = False
            log.warning(
                "%s from now on (Flower's own %s process per task, as with --cold): a "
                "fork of this server would fail, because of %s. To run warm again, %s",
                COLD,
                TASK_TYPES[self.task],
                "; ".join(hazards),
                fork_safety.ADVICE,
            )
        return self.forking

    def start(self, task_id: int, token: str) -> int | None:
        if self.forks():
            certificates = self.root_certificates.read_bytes() if self.root_certificates else None
            server = os.getpid()

            def run() -> None:
                _run_task(self.runtime_api_address, token, server, self.task, certificates)

            pid = Forked(run, TASK_NAME).pid
            log.info("warm: task %s runs in pid %d (forked; %s)", task_id, pid, fork_safety.state())
            return pid
        return self._start_cold(task_id, token)

    def _start_cold(self, task_id: int, token: str) -> int | None:
        try:
            script = console_script(TASK_TYPES[self.task], "a task run cold")
        except MissingScriptError as error:
            log.error("warm: task %s cannot start: %s", task_id, error)
            report_failed(self.runtime_api_address, self.root_certificates, token, str(error))
            return None
        security = (
            ["--root-certificates", str(self.root_certificates)]
            if self.root_certificates is not None and self.task != CLIENTAPP
            else ["--insecure"]  # a SuperNode's runtime API: loopback, plain HTTP
        )
        arguments = [
            str(script),
            "--runtime-api-address",
            self.runtime_api_address,
            "--token",
            token,
            *security,
            "--parent-pid",
            str(os.getpid()),
        ]
        # posix_spawn: a fresh process, no Python run between fork and exec (this one is
        # not fork-safe), and no Popen object to reap behind `reap`'s back
        pid = os.posix_spawn(str(script), arguments, fork_safety.child_environment())
        log.info("warm: task %s runs cold in pid %d (%s)", task_id, pid, script)
        return pid


def _run_task(
    runtime_api_address: str,
    token: str,
    server_pid: int,
    task: str = CLIENTAPP,
    certificates: bytes | None = None,
) -> None:
    """In the forked child (fedlb.deploy.forked: a fresh process's signals and logging, its
    own exit; torch as a fresh process has it, fedlb.deploy.fork_safety): Flower's own
    ClientApp (or ServerApp, simulation) process body."""
    if task != CLIENTAPP:
        _run_server_side(task, runtime_api_address, token, server_pid, certificates)
        return
    from fedlb.flower.protocol import TASK_STARTED_ENV

    os.environ[TASK_STARTED_ENV] = repr(time.time())  # the ClientApp's start, for its report
    flower.run_clientapp(runtime_api_address, token, server_pid)


def _run_server_side(
    task: str, runtime_api_address: str, token: str, server_pid: int, certificates: bytes | None
) -> None:
    """What `flwr-serverapp` (or `flwr-simulation`) does: the process's output mirrored to
    the run's log queue (uploaded to the SuperLink: `flwr log`), then Flower's own
    `run_serverapp` (or `run_simulation_process`: the same parameters)."""
    from queue import Queue

    runtime, run = flower.server_side_runtime(TASK_TYPES[task])
    if task == SERVERAPP:
        fast_reply_pulls()
    flush_without_pause(runtime)
    log_queue: Queue[str | None] = Queue()
    with flower.output_mirrored_to(log_queue):
        run(
            runtime_api_address=runtime_api_address,
            log_queue=log_queue,
            token=token,
            insecure=certificates is None,
            certificates=certificates,
            parent_pid=server_pid,
            runtime_dependency_install=False,  # as fedlb's SuperLink is started
        )


def report_failed(
    runtime_api_address: str, root_certificates: Path | None, token: str, details: str
) -> None:
    """Finish a task whose process was killed (or could not start) as FAILED, with its own
    token, as Flower's runtime does on its way out: its owner (a SuperNode) then answers
    its message with an error at once (fedlb.deploy.prompt.failed_clientapps_reply)
    instead of waiting for a heartbeat that never comes."""
    certificates = root_certificates.read_bytes() if root_certificates else None
    try:
        flower.push_task_failed(runtime_api_address, certificates, token, details)
    except Exception as error:  # its token then expires in 60 s: Flower's own path
        log.warning("warm: could not report the task as failed: %s", error)


def reap(
    running: dict[int, tuple[int, str]], failed: Callable[[str, str], None] | None = None
) -> None:
    """Collect finished tasks; say which ended badly (Flower reports an app's own
    exception; a killed process only this says, in this process's log) and report a
    killed one's task as failed (`failed(token, details)`). Only the tasks' own processes
    are waited for: the server's other children (a resident worker) are waited for by
    their owners."""
    for pid in list(running):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not this process's child (any more)
            running.pop(pid)
            continue
        if done == 0:
            continue
        task, token = running.pop(pid)
        if os.WIFSIGNALED(status):
            name = signal.Signals(os.WTERMSIG(status)).name
            log.warning(
                "warm: task %s (pid %d) was killed by %s; it fails as a crashed app's "
                "process does, the next one is served afresh",
                task,
                pid,
                name,
            )
            if failed is not None and token:
                failed(token, f"its process was killed by {name}")
        elif os.WEXITSTATUS(status) != 0:
            log.warning(
                "warm: task %s (pid %d) exited with code %d (its log is above)",
                task,
                pid,
                os.WEXITSTATUS(status),
            )
