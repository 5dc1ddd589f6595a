"""Flower's app processes run in a process of fedlb's: the ClientApp's, ServerApp's and
simulation's task bodies, their parent monitor, their run's log, and Flower's exit path
(flwr/supercore/exit) as a resident worker uses it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from .modules import CLIENTAPP_RUNTIME, SERVERAPP_RUNTIME, SIMULATION_RUNTIME, module


def watch_parent(pid: int) -> None:
    """Flower's parent-process monitor (flwr/supercore/app_utils.py,
    `start_parent_process_monitor`): a daemon thread that SIGINTs this process once `pid`
    is gone."""
    from flwr.supercore.app_utils import start_parent_process_monitor

    start_parent_process_monitor(pid)


def run_clientapp(
    address: str, token: str, parent_pid: int | None, runtime: Any | None = None
) -> None:
    """Flower's `flwr-clientapp` body for one task (plain HTTP: a SuperNode's runtime API
    is on loopback): `run_clientapp(runtime_api_address, token, insecure, certificates,
    parent_pid)` of `runtime` (default: flwr/supernode/runtime/run_clientapp.py) pulls the
    message, installs the FAB, loads and calls the app, pushes the reply and ends through
    the module's `flwr_exit` (SystemExit)."""
    (runtime or module(CLIENTAPP_RUNTIME)).run_clientapp(
        runtime_api_address=address,
        token=token,
        insecure=True,
        certificates=None,
        parent_pid=parent_pid,
    )


def server_side_runtime(task: str) -> tuple[ModuleType, Callable[..., None]]:
    """The module and function of a ServerApp task ("flwr-serverapp": `run_serverapp`)
    or a simulation ("flwr-simulation": `run_simulation_process`). Both take
    (runtime_api_address, log_queue, token, insecure, certificates, parent_pid,
    runtime_dependency_install) and end through `flwr_exit`."""
    if task == "flwr-serverapp":
        runtime = module(SERVERAPP_RUNTIME)
        return runtime, runtime.run_serverapp
    runtime = module(SIMULATION_RUNTIME)
    return runtime, runtime.run_simulation_process


@contextlib.contextmanager
def output_mirrored_to(log_queue: Any) -> Iterator[None]:
    """This process's stdout and stderr copied into `log_queue` (what the run's log
    uploader pushes: `flwr log`), as `flwr-serverapp` does before `run_serverapp`:
    `mirror_output_to_queue` / `restore_output` of flwr/supercore/logger.py."""
    from flwr.supercore.logger import mirror_output_to_queue, restore_output

    mirror_output_to_queue(log_queue)
    try:
        yield
    finally:
        restore_output()


LOG_FLUSH_PAUSE_S = 1.0
"""Flower's `flush_logs` (flwr/supercore/logger.py) sleeps up to 1 s after the log queue
empties "to allow the PushLogs call to complete"."""


def flush_logs_without_pause(runtime: Any) -> None:
    """Make `runtime` (the ServerApp's or simulation process's module) flush the run's log
    at its end without Flower's fixed pause.

    Flower 1.42's modules call `start_log_uploader(log_queue, node_id, run_id, client)`
    (returns the uploader thread, which pushes what the queue holds and ends at a None)
    and `flush_logs(log_queue, timeout)`, both imported by name from flwr.supercore.logger,
    then `stop_log_uploader`. Here the uploader thread is remembered when it starts, and
    the flush puts the None and waits for exactly that thread: the logs are pushed, no
    sooner and no later; Flower's `stop_log_uploader` afterwards finds it done."""
    start, flush = runtime.start_log_uploader, runtime.flush_logs
    started: list[threading.Thread] = []

    def start_and_keep(*args: Any, **kwargs: Any) -> threading.Thread:
        thread: threading.Thread = start(*args, **kwargs)
        started.append(thread)
        return thread

    def flush_now(log_queue: Any, timeout: float = 3.0) -> bool:
        if not started:
            return bool(flush(log_queue, timeout))
        log_queue.put(None)
        started[-1].join(timeout)
        return not started[-1].is_alive()

    runtime.start_log_uploader, runtime.flush_logs = start_and_keep, flush_now


# --------------------------------------------------------------------------------------
# Flower's exit path (flwr/supercore/exit), as a resident worker uses it


def end_tasks_with(runtime: Any, ended: Callable[..., Any]) -> None:
    """Make the ClientApp runtime module's global `flwr_exit` (its end of every task:
    exit handlers, a force-exit thread, SystemExit) `ended` in this process."""
    setattr(runtime, "flwr_exit", ended)  # noqa: B010 (a module's global)


def run_exit_handlers() -> None:
    """Run Flower's registered exit handlers, both phases in `flwr_exit`'s order
    (`trigger_exit_handlers(run_before_force_exit=True)`, then False); running them removes
    them from the list."""
    from flwr.supercore.exit.exit_handler import trigger_exit_handlers

    trigger_exit_handlers(run_before_force_exit=True)
    trigger_exit_handlers(run_before_force_exit=False)


def exit_handlers() -> list[Any]:
    """Flower's list of registered exit handlers (`exit_handler.registered_exit_handlers`,
    a module-level list its runtime appends to per task)."""
    from flwr.supercore.exit import exit_handler

    handlers: list[Any] = exit_handler.registered_exit_handlers
    return handlers
