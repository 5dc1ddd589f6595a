"""Flower's fixed pauses shortened, in fedlb's own processes: the SuperNode prompt, and a
run's log flushed without its 1 s pause (`flush_without_pause`, in warm ServerApps).

After each reply a SuperNode pulls once, finds nothing yet (the server is still
aggregating) and sleeps 3 s, so the next round reached it 1.5-3 s late, on every balanced
round's critical path. `python -m fedlb.deploy.prompt [--idle-pull S] -- ARGS` runs
Flower's own `flower-supernode ARGS` entry point in a process whose SuperNode loop sleeps
`IDLE_PULL_S` instead (a pull is one small request to the SuperLink: 5 a second per silo
is nothing for a cross-silo federation; `--idle-pull 3` restores Flower's pace). The warm
launcher (fedlb.deploy.warm) runs a silo's SuperNode this way.

The Flower details relied on (the loop's pauses and steps, its object pulls, the node
state, the heartbeat interval) are in fedlb._flower_internals, each checked by
tests/test_flower_internals_*.py.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedlb import _flower_internals as flower

from .gate import parse_gated, run_superlink
from .join import LOST_TASK

# Flower pulls a message's objects from its SuperNode with a backoff that starts at 1 s;
# the SuperNode has them a few ms after it announces the message, so the first retry
# cost ~1 s a round. Ours start at this.
PULL_BACKOFF_S = 0.02
IDLE_PULL_S = 0.2  # the SuperNode's pause after a pull that found no message (Flower: 3 s)
REPLY_WAIT_S = 0.05  # its pause while a reply or an object is not there yet (Flower: 0.5 s)
# Flower's fixed pauses in that loop, idle and reply
SUPERNODE_SLEEPS = (flower.SUPERNODE_IDLE_SLEEP_S, flower.SUPERNODE_WAIT_SLEEP_S)
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

    loop = flower.module(flower.SUPERNODE_LOOP)
    idle, reply = SUPERNODE_SLEEPS
    flower.set_supernode_clock(_ShortSleeps({idle: idle_s, reply: reply_s}), loop)
    # A prompt SuperNode often holds a message before the ServerApp has pushed all of its
    # objects to the SuperLink; Flower's object pulls then retry after 1 s. Ours: sooner.
    flower.supernode_object_pulls(PULL_BACKOFF_S, loop)
    replies_of_the_current_run(loop)
    failed_clientapps_reply()
    beat_every(NODE_HEARTBEAT_S)


def beat_every(interval_s: float) -> None:
    """Make this process's SuperNode announce a heartbeat interval of `interval_s` (and
    beat at Flower's pace for it: every ~0.8 (interval - 5 s)). The SuperLink declares a
    node gone after 2 intervals without a beat and answers the messages waiting for it
    with Flower's NODE_UNAVAILABLE error: a silo whose machine died then ends its round
    after ~20 s instead of ~60 s (Flower's 30 s interval). Flower accepts 10..1800 s."""
    flower.set_node_heartbeat_interval(interval_s)


def failed_clientapps_reply() -> None:
    """Make a SuperNode answer a message whose ClientApp ended as failed without replying
    (its process stopped by a signal, its warm server killed: Flower's runtime then
    reports the task FAILED on its way out) with an error reply, at once.

    Flower answers such a message only when the task's heartbeat expires (60 s after the
    last); a ClientApp task that reports FAILED revokes its token, so it never expires: the
    SuperNode's loop waited for a reply for ever, the server's round until its timeout,
    and the silo was never sampled again. Here the node state's `finish_task` first answers
    the task's message with Flower's own CLIENT_APP_CRASHED code and the task's details
    (`_flower_internals.answer_with_error`: the message the ClientApp took, in whichever
    store this Flower's loop pushes from), then finishes the task: a loop that stops
    waiting once no task is active (flwr-nightly's) finds the answer there. A message
    whose reply was pushed (an app's own exception: Flower pushes an error reply first) is
    not answered twice. A task whose token expired (a ClientApp killed hard, 60 s without a
    heartbeat) is answered as Flower answers it, in whichever store holds its message
    (`_flower_internals.answer_expired_clientapp_tasks`)."""
    flower.answer_expired_clientapp_tasks()
    state_class = flower.node_state_class()
    finish = state_class.finish_task
    if getattr(finish, "replies", False):  # already in place
        return

    @functools.wraps(finish)
    def answer_and_finish(self: Any, task_id: int, sub_status: str, details: str) -> bool:
        task = (
            flower.unfinished_clientapp_task(self, task_id)
            if flower.is_failed(sub_status)
            else None
        )
        if task is not None:
            print(
                f"{LOST_TASK} (task {task_id} of run {task.run_id}: {details}); "
                "its message is answered with an error, so the server goes on without "
                "this silo's reply and the next message is served",
                flush=True,
            )
            flower.answer_with_error(self, task.run_id, f"ClientApp failed: {details}")
        finished: bool = finish(self, task_id, sub_status, details)
        return finished

    setattr(answer_and_finish, "replies", True)  # noqa: B010
    state_class.finish_task = answer_and_finish


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
    pull = getattr(loop, flower.SUPERNODE_PULL_STEP)
    push = getattr(loop, flower.SUPERNODE_PUSH_STEP)
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
        push(state=flower.OneRunState(state, run_id), object_store=object_store, **kwargs)
        stale = [
            message
            for message in flower.waiting_replies(state)
            if message.metadata.run_id != run_id
        ]
        for message in stale:
            print(
                f"fedlb: dropped the reply of a ClientApp of run {message.metadata.run_id}, "
                f"a run the server no longer runs (handling run {run_id})",
                flush=True,
            )
            flower.drop_messages(
                state,
                object_store,
                [message.metadata.message_id, message.metadata.reply_to_message_id],
            )

    setattr(push_this_runs_reply, "one_run", True)  # noqa: B010
    setattr(loop, flower.SUPERNODE_PULL_STEP, pull_and_remember)
    setattr(loop, flower.SUPERNODE_PUSH_STEP, push_this_runs_reply)


def main(arguments: Sequence[str] | None = None) -> int:
    """`python -m fedlb.deploy.prompt [--idle-pull S] -- ARGS`: Flower's own
    `flower-supernode ARGS`, prompt."""
    arguments = list(sys.argv[1:] if arguments is None else arguments)
    parser = argparse.ArgumentParser(prog="python -m fedlb.deploy.prompt")
    parser.add_argument("--idle-pull", type=float, default=IDLE_PULL_S)
    split = arguments.index("--") if "--" in arguments else len(arguments)
    args = parser.parse_args(arguments[:split])
    prompt_supernode(args.idle_pull, min(REPLY_WAIT_S, args.idle_pull))
    flower.run_supernode_cli(arguments[split + 1 :])
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
        return flower.SUPERLINK_CLI, functools.partial(run_superlink, control_port, link_command)
    if program == "flower-supernode":
        return flower.SUPERNODE_CLI, lambda: main(
            ["--idle-pull", repr(idle_pull_s), "--", *arguments]
        )
    if program == "flower-superlink":

        def superlink() -> int:
            flower.answer_messages_to_offline_nodes()  # as fedlb.deploy.gate does
            flower.run_superlink_cli(arguments)
            return 0

        return flower.SUPERLINK_CLI, superlink
    return None


def fast_object_pulls(backoff: float = PULL_BACKOFF_S) -> None:
    """Make Flower's ClientApp runtime retry a message's object pulls after `backoff` s
    (doubling, capped as Flower caps it) instead of 1 s."""
    flower.clientapp_object_pulls(backoff)


def fast_reply_pulls(backoff: float = PULL_BACKOFF_S) -> None:
    """Make a ServerApp's grid retry a reply's object pulls after `backoff` s instead of
    1 s. A reply's message reaches the SuperLink a few ms before its objects; a poll that
    falls in between found the message and then slept Flower's 1 s before pulling the
    objects again: ~1 s added to one round in several (docs/benchmarks.md)."""
    flower.serverapp_reply_pulls(backoff)


def flush_without_pause(runtime: Any) -> None:
    """Make `runtime` (Flower's ServerApp or simulation process module) flush the run's
    log at its end without Flower's fixed 1 s pause (a second at the end of every run):
    `_flower_internals.flush_logs_without_pause`. A line logged after the flush (Flower
    logs one only when pushing the run's output fails) reaches the process's output, not
    the run's log."""
    flower.flush_logs_without_pause(runtime)


if __name__ == "__main__":
    sys.exit(main())
