"""The private details of a SuperNode's own state that fedlb relies on
(fedlb/_flower_internals/), driven in this process: how a failed or expired ClientApp
task's message is answered where the push step finds it, a one-run state, a reply from an
offline node, heartbeats at the module globals fedlb sets. Quick tier; run against the
newest flwr-nightly by scripts/check-flower-nightly.sh."""

from __future__ import annotations

import importlib
import inspect
import time

import pytest

from fedlb import _flower_internals as flower
from tests.flower_internals_helpers import Node, parameters


@pytest.fixture
def quiet_flower(monkeypatch):
    """The loop's pauses short (a push step waiting for a reply polls every 0.5 s)."""
    loop = flower.module(flower.SUPERNODE_LOOP)

    class Clock:
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, seconds):
            time.sleep(min(seconds, 0.01))

    monkeypatch.setattr(loop, "time", Clock())


def test_a_failed_clientapp_tasks_message_is_answered_where_the_push_step_finds_it(quiet_flower):
    """A ClientApp took its message (PullMessages) and its task then FAILED without a
    reply (PushTaskOutput): answer_with_error stores a CLIENT_APP_CRASHED reply to that
    message where this Flower's push step looks (1.42: the node state's own store; the
    nightly: the store it shares with the SuperLink's), once however often it is called;
    the push step pushes it. `unfinished_clientapp_task` and `is_failed` read the task."""
    from flwr.common.constant import ErrorCode, SubStatus

    node = Node()
    message, task = node.receive(run_id=7)
    node.clientapp_pulls(task)
    assert flower.is_failed(SubStatus.FAILED)
    assert not flower.is_failed(SubStatus.COMPLETED)
    found = flower.unfinished_clientapp_task(node.state, task.task_id)
    assert found is not None
    assert found.run_id == 7
    flower.answer_with_error(node.state, 7, "ClientApp failed: killed")
    flower.answer_with_error(node.state, 7, "ClientApp failed: killed")  # answered already
    node.fail(task, "killed")
    assert flower.unfinished_clientapp_task(node.state, task.task_id) is None  # finished
    sent = node.push()
    assert len(sent) == 1, sent
    assert sent[0].has_error()
    assert sent[0].error.code == ErrorCode.CLIENT_APP_CRASHED
    assert sent[0].error.reason == "ClientApp failed: killed"
    assert sent[0].metadata.reply_to_message_id == message.metadata.message_id
    assert flower.waiting_replies(node.state) == []


def test_flower_itself_leaves_a_failed_clientapp_tasks_message_unanswered(quiet_flower):
    """The gap answer_with_error fills is there in this Flower (else drop it): a ClientApp
    task that reports FAILED without a reply leaves its message unanswered (Flower answers
    only when a task's token expires, and FAILED revokes it)."""
    node = Node()
    _, task = node.receive(run_id=7)
    node.clientapp_pulls(task)
    node.fail(task, "killed")
    assert flower.waiting_replies(node.state) == []


def test_a_clientapp_task_whose_token_expired_has_its_message_answered(quiet_flower):
    """A running ClientApp task (claimed, activated) whose token expires is marked
    FINISHED:FAILED and its message answered with CLIENT_APP_CRASHED ("ClientApp stopped
    responding.") where the push step finds it: 1.42 by itself, a nightly with
    answer_expired_clientapp_tasks (installed here, as fedlb's SuperNodes install it)."""
    from datetime import UTC, datetime, timedelta

    from flwr.common.constant import ErrorCode, Status

    state_class = flower.node_state_class()
    original = state_class._on_task_tokens_expired
    try:
        flower.answer_expired_clientapp_tasks()
        flower.answer_expired_clientapp_tasks()  # twice: one wrapper
        assert state_class._on_task_tokens_expired.__wrapped__ is original
        node = Node()
        message, task = node.receive(run_id=7)
        assert node.state.claim_task(task.task_id)
        assert node.state.activate_task(task.task_id)
        node.clientapp_pulls(task)
        record = node.state.task_token_store[task.task_id]  # its heartbeats stopped
        record.active_until = datetime.now(UTC) - timedelta(seconds=1)
        (expired,) = node.state.get_tasks(task_ids=[task.task_id])  # Flower cleans up
        assert expired.status.status == Status.FINISHED
        sent = node.push()
    finally:
        state_class._on_task_tokens_expired = original
    assert len(sent) == 1, sent
    assert sent[0].error.code == ErrorCode.CLIENT_APP_CRASHED
    assert sent[0].metadata.reply_to_message_id == message.metadata.message_id


def test_finish_task_is_the_node_states_method_push_task_output_calls():
    """PushTaskOutput finishes a task through `state.finish_task(task_id=, sub_status=,
    details=)` -> bool, a method of the node state class (InMemoryNodeState) fedlb wraps."""
    state_class = flower.node_state_class()
    assert {"self", "task_id", "sub_status", "details"} <= parameters(state_class.finish_task)
    handlers = importlib.import_module("flwr.supernode.servicer.runtime.runtime_handlers")
    assert "state.finish_task(" in inspect.getsource(handlers.push_task_output)
    from flwr.supernode.nodestate import NodeStateFactory

    assert "InMemoryNodeState(" in inspect.getsource(NodeStateFactory)


def test_a_one_run_state_shows_the_push_step_only_its_runs_reply(quiet_flower):
    """Replies of two runs wait (a stale one of run 7, the current run 8's): the push step
    given OneRunState(state, 8) pushes run 8's only; waiting_replies then names run 7's,
    and drop_messages removes it and the message it answers."""
    node = Node()
    stale, stale_task = node.receive(run_id=7)
    node.clientapp_pulls(stale_task)
    current, current_task = node.receive(run_id=8)
    node.clientapp_pulls(current_task)
    node.clientapp_replies(stale)
    reply = node.clientapp_replies(current)
    sent = node.push(flower.OneRunState(node.state, 8))
    assert [m.metadata.message_id for m in sent] == [reply.metadata.message_id]
    left = flower.waiting_replies(node.state)
    assert [m.metadata.run_id for m in left] == [7]
    flower.drop_messages(
        node.state, node.store, [left[0].metadata.message_id, stale.metadata.message_id]
    )
    assert flower.waiting_replies(node.state) == []


def test_a_serverapp_asking_for_a_reply_from_an_offline_node_gets_node_unavailable():
    """A ServerApp's PullMessages for the reply to a message whose node's heartbeats
    stopped gets Flower's NODE_UNAVAILABLE error reply (1.42's SuperLink answers it
    itself; with answer_messages_to_offline_nodes a nightly's does too)."""
    from flwr.app import Message, RecordDict
    from flwr.common.constant import ErrorCode
    from flwr.common.serde import message_from_proto
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID, TaskType
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        get_object_tree,
    )
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager

    handlers = importlib.import_module("flwr.superlink.servicer.runtime.runtime_handlers")
    factory = ObjectStoreFactory()
    state = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), factory).state()
    original = flower.linkstate_class().get_messages
    try:
        flower.answer_messages_to_offline_nodes()
        flower.answer_messages_to_offline_nodes()  # twice: one wrapper
        assert flower.linkstate_class().get_messages.__wrapped__ is original
        node = state.create_node("aid", "owner", b"key", 10)
        state.activate_node(node, 10)
        run_id = state.create_run(
            None, None, None, {}, NOOP_FEDERATION_ID, None, "aid", TaskType.SERVER_APP
        )
        task = state.get_tasks(run_ids=[run_id])[0]
        with flower.task_identity(run_id=run_id, task_id=1, node_id=flower.superlink_node_id()):
            message = Message(RecordDict(), dst_node_id=node, message_type="train")
        message.metadata.__dict__["_message_id"] = message.object_id
        stored, _ = state.store_message_and_object_tree(
            message, get_object_tree(message), state.start_session(run_id)
        )
        assert stored
        for object_id, item in get_all_nested_objects(message).items():
            factory.store().put(object_id, item.deflate())
        state.nodes[node].online_until = time.time() - 1  # its heartbeats stopped
        fields = PullAppMessagesRequest.DESCRIPTOR.fields_by_name
        wanted = [message.metadata.message_id]
        if "reply_to_message_ids" in fields:  # the nightly's request
            from flwr.proto.recorddict_pb2 import StringList

            request = PullAppMessagesRequest(reply_to_message_ids=StringList(vals=wanted))
        else:
            request = PullAppMessagesRequest(message_ids=wanted)
        replies = handlers.pull_messages(request, state, task).messages_list
        assert len(replies) == 1
        reply = message_from_proto(replies[0])
        assert reply.error.code == ErrorCode.NODE_UNAVAILABLE
        assert reply.metadata.reply_to_message_id == message.metadata.message_id
    finally:
        flower.linkstate_class().get_messages = original


# --- heartbeats ---------------------------------------------------------------------------


def test_a_supernode_announces_and_beats_at_the_module_globals_fedlb_sets():
    """A SuperNode may announce 10..1800 s (default 30); the SuperLink gives up on it after
    2 intervals. flwr.supernode.fleet_http_connection announces its module global
    HEARTBEAT_DEFAULT_INTERVAL (ActivateNode, SendNodeHeartbeat) and
    flwr.supercore.heartbeat's HeartbeatSender paces itself by its own."""
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection

    assert flower.heartbeat_limits_s() == (10, 30, 1800)
    assert flower.heartbeat_patience() == 2
    assert "heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL" in inspect.getsource(
        fleet_http_connection
    )
    assert "HEARTBEAT_DEFAULT_INTERVAL" in inspect.getsource(heartbeat.HeartbeatSender._run)
    saved = (fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL, heartbeat.HEARTBEAT_DEFAULT_INTERVAL)
    try:
        flower.set_node_heartbeat_interval(10)
        assert fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL == 10
        assert heartbeat.HEARTBEAT_DEFAULT_INTERVAL == 10
    finally:
        fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL, heartbeat.HEARTBEAT_DEFAULT_INTERVAL = (
            saved
        )
