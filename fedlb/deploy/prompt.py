"""Flower's fixed pauses shortened, in fedlb's own processes: the SuperNode prompt, and a
run's log flushed without its 1 s pause (`flush_without_pause`, in warm ServerApps).

After each reply a SuperNode pulls once, finds nothing yet (the server is still
aggregating) and sleeps 3 s, so the next round reached it 1.5-3 s late, on every balanced
round's critical path. `python -m fedlb.deploy.prompt [--idle-pull S] -- ARGS` runs
Flower's own `flower-supernode ARGS` entry point in a process whose SuperNode loop sleeps
`IDLE_PULL_S` instead (a pull is one small request to the SuperLink: 5 a second per silo
is nothing for a cross-silo federation; `--idle-pull 3` restores Flower's pace). The warm
launcher (fedlb.deploy.warm) runs a silo's SuperNode this way.

Flower behaviours relied on (tests/test_warm_silo.py checks each): the SuperNode's loop
(`flwr.supernode.start_client_internal`) sleeps `time.sleep(3)` when a pull finds no
message and `time.sleep(0.5)` while it waits for a reply or an object's content, and
pulls a message's objects through its module's `pull_objects`, which takes
`initial_backoff`; the ClientApp runtime pulls its message through its module's
`pull_and_inflate_object_from_tree`, which takes `initial_backoff` too.
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .gate import parse_gated, run_superlink
from .join import LOST_TASK

# Flower pulls a message's objects from its SuperNode with a backoff that starts at 1 s;
# the SuperNode has them a few ms after it announces the message, so the first retry
# cost ~1 s a round. Ours start at this.
PULL_BACKOFF_S = 0.02
IDLE_PULL_S = 0.2  # the SuperNode's pause after a pull that found no message (Flower: 3 s)
REPLY_WAIT_S = 0.05  # its pause while a reply or an object is not there yet (Flower: 0.5 s)
SUPERNODE_SLEEPS = (3, 0.5)  # Flower 1.42's fixed pauses in that loop, idle and reply
NODE_HEARTBEAT_S = 10  # the SuperNode's heartbeat interval (Flower: 30 s; its least: 10)


class _ShortSleeps:
    """The `time` module as Flower's SuperNode loop sees it: its fixed pauses shortened,
    everything else untouched."""

    def __init__(self, shortened: dict[float, float]) -> None:
        self.shortened = shortened

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(self.shortened.get(seconds, seconds))


def prompt_supernode(idle_s: float = IDLE_PULL_S, reply_s: float = REPLY_WAIT_S) -> None:
    """Shorten the SuperNode loop's idle pause (3 s) to `idle_s`, its reply and object
    waits (0.5 s) to `reply_s`, and the first retry of its object pulls from the
    SuperLink (1 s) to PULL_BACKOFF_S, in this process."""

    from flwr.supernode import start_client_internal as loop

    idle, reply = SUPERNODE_SLEEPS
    setattr(loop, "time", _ShortSleeps({idle: idle_s, reply: reply_s}))  # noqa: B010 (a module)
    # A prompt SuperNode often holds a message before the ServerApp has pushed all of its
    # objects to the SuperLink; Flower's object pulls then retry after 1 s. Ours: sooner.
    _first_retry_after(loop, "pull_objects", PULL_BACKOFF_S)
    replies_of_the_current_run(loop)
    failed_clientapps_reply()
    beat_every(NODE_HEARTBEAT_S)


def beat_every(interval_s: float) -> None:
    """Make this process's SuperNode announce a heartbeat interval of `interval_s` (and
    beat at Flower's pace for it: every ~0.8 (interval - 5 s)). The SuperLink declares a
    node gone after 2 intervals without a beat and answers the messages waiting for it
    with Flower's NODE_UNAVAILABLE error: a silo whose machine died then ends its round
    after ~20 s instead of ~60 s (Flower's 30 s interval). Flower accepts 10..1800 s."""
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection as connection

    setattr(connection, "HEARTBEAT_DEFAULT_INTERVAL", interval_s)  # noqa: B010 (a module)
    setattr(heartbeat, "HEARTBEAT_DEFAULT_INTERVAL", interval_s)  # noqa: B010


def failed_clientapps_reply() -> None:
    """Make a SuperNode answer a message whose ClientApp ended as failed without replying
    (its process stopped by a signal, its warm server killed: Flower's runtime then
    reports the task FAILED on its way out) with an error reply, at once.

    Flower 1.42's node state inserts such an error reply when an AgentApp's task fails,
    and for a ClientApp only when the task's heartbeat expires (60 s after the last);
    a ClientApp task that reports FAILED revokes its token, so it never expires: the
    SuperNode's loop waited for a reply for ever, the server's round until its timeout,
    and the silo was never sampled again. Here the ClientApp's task gets the AgentApp's
    treatment, with Flower's own CLIENT_APP_CRASHED code and the task's details; a task
    that did push its reply (an app's own exception: Flower pushes an error reply first)
    is not answered twice (Flower's `_store_error_replies` skips replied messages)."""
    from flwr.app import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.constant import TaskType
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState as State

    finish = State.finish_task
    if getattr(finish, "replies", False):  # already in place
        return

    @functools.wraps(finish)
    def finish_and_reply(self: Any, task_id: int, sub_status: str, details: str) -> bool:
        finished: bool = finish(self, task_id, sub_status, details)
        if finished and sub_status == SubStatus.FAILED:
            tasks = self.get_tasks(task_ids=[task_id])
            if tasks and tasks[0].type == TaskType.CLIENT_APP:
                print(
                    f"{LOST_TASK} (task {task_id} of run {tasks[0].run_id}: {details}); "
                    "its message is answered with an error, so the server goes on without "
                    "this silo's reply and the next message is served",
                    flush=True,
                )
                error = Error(ErrorCode.CLIENT_APP_CRASHED, f"ClientApp failed: {details}")
                self._store_error_replies({tasks[0].run_id}, error)
        return finished

    setattr(finish_and_reply, "replies", True)  # noqa: B010
    State.finish_task = finish_and_reply  # type: ignore[method-assign]


class _OneRun:
    """A SuperNode's state as its push step sees it: only replies of run `run_id`."""

    def __init__(self, state: Any, run_id: int) -> None:
        self.state, self.run_id = state, run_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self.state, name)

    def get_messages_legacy(self, **filters: Any) -> Any:
        return self.state.get_messages_legacy(**{**filters, "run_ids": [self.run_id]})


def replies_of_the_current_run(loop: Any) -> None:
    """Make Flower's SuperNode loop (`loop`: its module) push the reply to the message it
    handles, not whichever reply comes first.

    The loop handles one message at a time: it pulls a message, starts its ClientApp,
    waits for *a* reply and pushes it. When the SuperLink dies while a message is being
    received, the loop ignores that message, but its ClientApp was already started; if
    the restarted server's next message arrives before that ClientApp ends (a fast
    restart: a resumed `fedlb server`), the loop takes the stale reply as the new
    message's, pushes it (the SuperLink drops it: its run is gone) and moves on, and the
    new message's reply waits until some later message: the silo misses the round.
    Here the push step sees only replies of the run it pulled a message of; a reply of
    another run is dropped after the push, as the SuperLink would drop it."""
    pull, push = loop._pull_and_store_message, loop._push_messages
    if getattr(push, "one_run", False):  # already in place
        return
    current: dict[str, int | None] = {"run": None}

    @functools.wraps(pull)
    def pull_and_remember(*args: Any, **kwargs: Any) -> int | None:
        current["run"] = pull(*args, **kwargs)
        return current["run"]

    @functools.wraps(push)
    def push_this_runs_reply(*, state: Any, object_store: Any, **kwargs: Any) -> None:
        run_id = current["run"]
        if run_id is None:  # not from this loop: Flower's own behaviour
            push(state=state, object_store=object_store, **kwargs)
            return
        push(state=_OneRun(state, run_id), object_store=object_store, **kwargs)
        stale = [
            message
            for message in state.get_messages_legacy(is_reply=True)
            if message.metadata.run_id != run_id
        ]
        for message in stale:
            print(
                f"fedlb: dropped the reply of a ClientApp of run {message.metadata.run_id}, "
                f"a run the server no longer runs (handling run {run_id})",
                flush=True,
            )
            state.delete_messages(
                message_ids=[message.metadata.message_id, message.metadata.reply_to_message_id]
            )
            object_store.delete(message.metadata.message_id)

    setattr(push_this_runs_reply, "one_run", True)  # noqa: B010
    setattr(loop, "_pull_and_store_message", pull_and_remember)  # noqa: B010
    setattr(loop, "_push_messages", push_this_runs_reply)  # noqa: B010


def main(arguments: Sequence[str] | None = None) -> int:
    """`python -m fedlb.deploy.prompt [--idle-pull S] -- ARGS`: Flower's own
    `flower-supernode ARGS`, prompt."""
    arguments = list(sys.argv[1:] if arguments is None else arguments)
    parser = argparse.ArgumentParser(prog="python -m fedlb.deploy.prompt")
    parser.add_argument("--idle-pull", type=float, default=IDLE_PULL_S)
    split = arguments.index("--") if "--" in arguments else len(arguments)
    args = parser.parse_args(arguments[:split])
    from flwr.supernode.cli import flower_supernode

    prompt_supernode(args.idle_pull, min(REPLY_WAIT_S, args.idle_pull))
    sys.argv = ["flower-supernode", *arguments[split + 1 :]]
    flower_supernode()
    return 0


def supernode_command(supernode: Sequence[str], idle_pull_s: float) -> list[str]:
    """Flower's `flower-supernode ...` run prompt (the same Flower, through
    `main`); any other command as given."""
    if not supernode or Path(supernode[0]).name != "flower-supernode":
        return list(supernode)
    return [
        sys.executable,
        "-m",
        "fedlb.deploy.prompt",
        "--idle-pull",
        repr(idle_pull_s),
        "--",
        *supernode[1:],
    ]


def node_entry(command: Sequence[str], idle_pull_s: float) -> tuple[str, Callable[[], int]] | None:
    """How to run `command` in a forked process instead of a new Python: the module that
    holds its entry point (to import before the fork) and the call that runs it; None for a
    command that is not Flower's `flower-supernode` (run prompt, as `main` does) or
    `flower-superlink`."""
    program, arguments = Path(command[0]).name if command else "", list(command[1:])
    if (gated := parse_gated(command)) is not None:  # flower-superlink behind fedlb's gate
        control_port, link_command = gated
        return "flwr.superlink.cli", functools.partial(run_superlink, control_port, link_command)
    if program == "flower-supernode":
        return "flwr.supernode.cli", lambda: main(
            ["--idle-pull", repr(idle_pull_s), "--", *arguments]
        )
    if program == "flower-superlink":

        def superlink() -> int:
            from flwr.superlink.cli import flower_superlink

            sys.argv = ["flower-superlink", *arguments]
            flower_superlink()
            return 0

        return "flwr.superlink.cli", superlink
    return None


def fast_object_pulls(backoff: float = PULL_BACKOFF_S) -> None:
    """Make Flower's ClientApp runtime retry a message's object pulls after `backoff` s
    (doubling, capped as Flower caps it) instead of 1 s."""
    from flwr.supernode.runtime import run_clientapp as runtime

    _first_retry_after(runtime, "pull_and_inflate_object_from_tree", backoff)


def fast_reply_pulls(backoff: float = PULL_BACKOFF_S) -> None:
    """Make a ServerApp's grid retry a reply's object pulls after `backoff` s instead of
    1 s. A reply's message reaches the SuperLink a few ms before its objects; a poll that
    falls in between found the message and then slept Flower's 1 s before pulling the
    objects again: ~1 s added to one round in several (docs/benchmarks.md)."""
    from flwr.superlink.grid import http_grid

    _first_retry_after(http_grid, "pull_objects", backoff)


def _first_retry_after(module: object, name: str, backoff: float) -> None:
    """Bind `initial_backoff=backoff` to Flower's pull function that `module` imported by
    `name` (once: a second call replaces the first binding, never nests it)."""

    pull = getattr(module, name)
    original = pull.func if isinstance(pull, functools.partial) else pull
    setattr(module, name, functools.partial(original, initial_backoff=backoff))


def flush_without_pause(runtime: Any) -> None:
    """Make `runtime` (Flower's ServerApp or simulation process module) flush the run's
    log at its end without Flower's fixed 1 s pause.

    Flower's `flush_logs` waits for the log queue to empty, then sleeps 1 s "to allow the
    PushLogs call to complete" before the run is reported finished: a second at the end of
    every run. Here the module's uploader thread is remembered when it starts, and the
    flush ends that thread (a None in its queue: it drains the queue, pushes, and exits)
    and waits for exactly that: the logs are pushed, no sooner and no later. Flower's
    `stop_log_uploader` afterwards finds it done. A line logged after the flush (Flower
    logs one only when pushing the run's output fails) reaches the process's output, not
    the run's log."""
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


if __name__ == "__main__":
    sys.exit(main())
