"""The SuperNode's node state: its message stores as the loop's push step sees them, and
the answer to a ClientApp task that failed (or was killed) without a reply."""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Any

from .superlink import superlink_node_id


class OneRunState:
    """A SuperNode's state as the loop's push step sees it: only replies of run `run_id`.

    Flower 1.42's push step waits for `state.get_messages_legacy(is_reply=True)` (the node
    state's own message store); flwr-nightly 1.43.0.dev20261026's asks
    `state.get_messages(dst_node_id=superlink_node_id(), limit=1)` (the store it shares with
    the SuperLink's, flwr/supercore/corestate) and stops waiting when no task is active.
    Both are narrowed to the run here; everything else is the state's."""

    def __init__(self, state: Any, run_id: int) -> None:
        self.state, self.run_id = state, run_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self.state, name)

    def get_messages_legacy(self, **filters: Any) -> Any:
        return self.state.get_messages_legacy(**{**filters, "run_ids": [self.run_id]})

    def get_messages(self, **filters: Any) -> Any:
        return self.state.get_messages(**{**filters, "run_id": self.run_id})


def waiting_replies(state: Any) -> list[Any]:
    """The replies a SuperNode holds that its push step has not pushed, of any run, from
    both of the node state's message stores (1.42's SuperNode uses the node state's own,
    `get_messages_legacy`, which marks what it returns as retrieved; the nightly's the
    shared one, `get_messages`, which does not)."""
    found = list(state.get_messages_legacy(is_reply=True))
    if hasattr(state, "get_messages"):
        found += state.get_messages(dst_node_id=superlink_node_id())
    return found


def drop_messages(state: Any, object_store: Any, message_ids: Sequence[str]) -> None:
    """Remove messages (a reply and the message it answers) from a SuperNode's state and
    the first one's objects from its object store, as the push step does after a push:
    `delete_messages` in 1.42's store, `cancel_messages` in the shared one."""
    state.delete_messages(message_ids=list(message_ids))
    if hasattr(state, "cancel_messages"):
        state.cancel_messages(message_ids=list(message_ids))
    object_store.delete(message_ids[0])


# --------------------------------------------------------------------------------------
# A ClientApp task that failed without a reply


def node_state_class() -> Any:
    """The SuperNode's state class (`--database :flwr-in-memory:`, what fedlb runs):
    `flwr.supernode.nodestate.in_memory_nodestate.InMemoryNodeState`. The runtime API's
    PushTaskOutput calls its `finish_task(task_id, sub_status, details) -> bool`."""
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

    return InMemoryNodeState


def unfinished_clientapp_task(state: Any, task_id: int) -> Any:
    """The task `task_id` of a SuperNode's state if it is a ClientApp's and not finished
    (None otherwise): `state.get_tasks(task_ids=[...])`, `task.type ==
    TaskType.CLIENT_APP` ("flwr-clientapp"), `task.status.status != Status.FINISHED`."""
    from flwr.common.constant import Status
    from flwr.supercore.constant import TaskType

    tasks = state.get_tasks(task_ids=[task_id])
    if not tasks or tasks[0].type != TaskType.CLIENT_APP:
        return None
    return tasks[0] if tasks[0].status.status != Status.FINISHED else None


def is_failed(sub_status: str) -> bool:
    """Whether a task's final sub-status (PushTaskOutput's) is `SubStatus.FAILED`."""
    from flwr.common.constant import SubStatus

    return bool(sub_status == SubStatus.FAILED)


def answer_with_error(state: Any, run_id: int, reason: str) -> None:
    """Answer each message of run `run_id` that a ClientApp took (pulled through the
    runtime API) and did not reply to with an error reply, CLIENT_APP_CRASHED and
    `reason`, where the SuperNode's push step will find it.

    Flower 1.42 does this itself only when a task's token expires (its node state's
    `_on_task_tokens_expired` calls `_store_error_replies(run_ids, error)`, which answers
    the retrieved, unanswered messages of its own store); a ClientApp that reports FAILED
    (PushTaskOutput) revokes its token, so it never expires. Its store is the one 1.42's
    loop uses. flwr-nightly 1.43.0.dev20261026's loop keeps messages in the store the node
    state shares with the SuperLink's (`store_messages` / `get_messages`, records kept after
    delivery) and `_store_error_replies` still writes to the old one, which nobody reads
    there: the same answer is stored in the shared store too (a message the ClientApp took
    has a processing start, `record_message_processing_start`; an answered one a record
    that replies to it). Where a store holds nothing of the run, it adds nothing."""
    from flwr.app import Error, Message, RecordDict
    from flwr.common.constant import ErrorCode

    error = Error(ErrorCode.CLIENT_APP_CRASHED, reason)
    state._store_error_replies({run_id}, error)
    records = getattr(state, "message_store", None)
    if not hasattr(state, "store_messages") or not isinstance(records, dict):
        return
    node_id = state.get_node_id()
    with state.lock_message_store:
        answered = {r.metadata.reply_to_message_id for r in records.values()}
        taken = [
            record.metadata
            for message_id, record in records.items()
            if record.metadata.run_id == run_id
            and record.metadata.dst_node_id == node_id
            and not record.metadata.reply_to_message_id
            and message_id not in answered
            and message_id in state.time_store
        ]
    for metadata in taken:
        # Message(content, metadata=...): Flower's own way to rebuild one (not overloaded)
        original = Message(RecordDict(), metadata=copy.deepcopy(metadata))  # type: ignore[call-overload]
        reply = Message(error, reply_to=original)
        reply.metadata.__dict__["_message_id"] = reply.object_id
        state._store_generated_message(reply)
        state.record_message_processing_end(metadata.message_id)
        state.store_messages([reply])


def answer_expired_clientapp_tasks(state_class: Any | None = None) -> None:
    """Make a SuperNode's node state answer the messages of ClientApp tasks whose token
    expired (no heartbeat for 60 s: a `flwr-clientapp` killed hard, which could not report
    FAILED) in whichever store holds them, as Flower 1.42 does in its own.

    Flower calls `_on_task_tokens_expired(tasks)` (copies of the tasks it just marked
    FINISHED:FAILED, under the task store's lock) and answers their runs' messages with
    `_store_error_replies(run_ids, CLIENT_APP_CRASHED_ERROR)`: on flwr-nightly
    1.43.0.dev20261026 into the store its loop no longer reads. Here Flower's own runs,
    then `answer_with_error` with Flower's own reason ("ClientApp stopped responding."),
    which adds nothing where Flower's answer is already in place (1.42)."""
    from flwr.supercore.constant import TaskType
    from flwr.supernode.nodestate import in_memory_nodestate

    state_class = state_class or node_state_class()
    expired = state_class._on_task_tokens_expired
    if getattr(expired, "answers", False):  # already in place
        return
    reason = str(in_memory_nodestate.CLIENT_APP_CRASHED_ERROR.reason)

    @functools.wraps(expired)
    def answer_expired(self: Any, tasks: list[Any]) -> None:
        expired(self, tasks)
        for run_id in {task.run_id for task in tasks if task.type == TaskType.CLIENT_APP}:
            answer_with_error(self, run_id, reason)

    setattr(answer_expired, "answers", True)  # noqa: B010
    state_class._on_task_tokens_expired = answer_expired
