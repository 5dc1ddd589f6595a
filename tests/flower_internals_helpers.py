"""Shared helpers of the tests of each private detail of Flower that fedlb relies on
(fedlb/_flower_internals/), tests/test_flower_internals_*.py: checked against the installed
Flower by name, a new Flower release fails one named test per broken assumption, in
seconds, instead of a timeout deep in a deployed run.

Those files are the quick tier (no test there is marked slow): Flower is imported, its
modules read, its node state and its SuperNode loop's steps driven in this process; one
test starts a Python that runs the SuperLink's entry point up to its `uvicorn.run`.
`scripts/check-flower-nightly.sh` runs them against the newest flwr-nightly
(docs/flower/flower-versions.md). Here: reading Flower's source and signatures, and
`Node`, a SuperNode in this process (also used by tests/test_warm_silo.py)."""

from __future__ import annotations

import importlib
import inspect
import threading
from pathlib import Path

from fedlb import _flower_internals as flower

ROOT = Path(__file__).resolve().parents[1]


FLWR = Path(importlib.import_module("flwr").__file__ or "").parent


def source(name: str) -> str:
    return inspect.getsource(importlib.import_module(name))


def parameters(function: object) -> set[str]:
    return set(inspect.signature(function).parameters)  # type: ignore[arg-type]


def flower_says(text: str) -> bool:
    """Whether some module of the installed flwr has `text` in its source."""
    return any(text in path.read_text(errors="replace") for path in FLWR.rglob("*.py"))


# A SuperNode in this process: Flower's own state, its loop's steps, its runtime handlers.


class Node:
    """A SuperNode's state and object store (Flower's factories, as the loop makes them),
    fed through the loop's own pull step, served through its runtime API handlers."""

    def __init__(self, node_id: int = 5) -> None:
        from flwr.supercore.object_store import ObjectStoreFactory
        from flwr.supernode.nodestate import NodeStateFactory

        factory = ObjectStoreFactory()
        self.state = NodeStateFactory(factory).state()
        self.store = factory.store()
        self.state.set_node_id(node_id)
        self.node_id = node_id
        self.loop = flower.module(flower.SUPERNODE_LOOP)
        self.handlers = importlib.import_module("flwr.supernode.servicer.runtime.runtime_handlers")

    def receive(self, run_id: int) -> tuple[object, object]:
        """A message of run `run_id` from the SuperLink through the loop's pull step, and
        the task it created."""
        from flwr.app import ConfigRecord, Message, RecordDict
        from flwr.supercore.inflatable.inflatable_object import (
            get_all_nested_objects,
            get_object_tree,
        )
        from flwr.supercore.run import Run

        with flower.task_identity(run_id=run_id, task_id=1, node_id=flower.superlink_node_id()):
            message = Message(
                RecordDict({"config": ConfigRecord({"x": run_id})}),
                dst_node_id=self.node_id,
                message_type="train",
            )
        message.metadata.__dict__["_message_id"] = message.object_id
        objects = get_all_nested_objects(message)
        if self.state.get_run(run_id) is None:
            self.state.store_run(Run.create_empty(run_id))
        pulled = getattr(self.loop, flower.SUPERNODE_PULL_STEP)(
            state=self.state,
            object_store=self.store,
            node_config={},
            receive=lambda: (message, get_object_tree(message)),
            get_run=lambda _run: None,
            get_fab=lambda _hash, _run: None,
            pull_object=lambda _run, object_id: objects[object_id].deflate(),
            confirm_message_received=lambda _run, _id: None,
            trusted_entities=None,
        )
        assert pulled == run_id
        tasks = [t for t in self.state.get_tasks(run_ids=[run_id])]
        return message, tasks[-1]

    def clientapp_pulls(self, task: object) -> object:
        """What a ClientApp's PullMessages gets (its message)."""
        from flwr.common.serde import message_from_proto
        from flwr.proto.runtime_pb2 import PullAppMessagesRequest

        reply = self.handlers.pull_messages(PullAppMessagesRequest(), self.state, task)
        assert len(reply.messages_list) == 1
        return message_from_proto(reply.messages_list[0])

    def clientapp_replies(self, message: object) -> object:
        """A ClientApp's reply stored as PushMessages and PushObject store it."""
        from flwr.app import Message, MetricRecord, RecordDict
        from flwr.supercore.inflatable.inflatable_object import (
            get_all_nested_objects,
            get_object_tree,
        )

        reply = Message(RecordDict({"m": MetricRecord({"a": 1.0})}), reply_to=message)
        reply.metadata.__dict__["_message_id"] = reply.object_id
        session = self.state.start_session(reply.metadata.run_id)
        stored, _ = self.state.store_message_and_object_tree(reply, get_object_tree(reply), session)
        assert stored
        self.state.record_message_processing_end(message.metadata.message_id)
        for object_id, item in get_all_nested_objects(reply).items():
            self.store.put(object_id, item.deflate())
        return reply

    def fail(self, task: object, details: str) -> None:
        """The ClientApp's PushTaskOutput: its task FAILED."""
        from flwr.common.constant import SubStatus
        from flwr.proto.runtime_pb2 import PushTaskOutputRequest

        request = PushTaskOutputRequest(sub_status=SubStatus.FAILED, details=details)
        self.handlers.push_task_output(request, self.state, task)

    def push(self, state: object | None = None, wait_s: float = 10.0) -> list[object]:
        """The loop's push step, once (in a thread: it waits for a reply); what it sent."""
        sent: list[object] = []

        def send(message: object, _tree: object, _runtime: float) -> tuple[set[str], str]:
            sent.append(message)
            return set(), "session"

        step = getattr(self.loop, flower.SUPERNODE_PUSH_STEP)
        thread = threading.Thread(
            target=lambda: step(
                state=state or self.state,
                object_store=self.store,
                send=send,
                push_object=lambda *_: None,
            ),
            daemon=True,
        )
        thread.start()
        thread.join(wait_s)
        assert not thread.is_alive(), "the push step found no reply to push"
        return sent
