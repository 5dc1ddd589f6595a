"""Each private detail of Flower that fedlb relies on (fedlb/_flower_internals/), checked
against the installed Flower by name: a new Flower release fails one named test per broken
assumption here, in seconds, instead of a timeout deep in a deployed run.

The quick tier (no test here is marked slow): Flower is imported, its modules read, its node
state and its SuperNode loop's steps driven in this process; one test starts a Python that
runs the SuperLink's entry point up to its `uvicorn.run`. `scripts/check-flower-nightly.sh`
runs this file against the newest flwr-nightly (docs/flower.md, "Flower versions")."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest

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


# --- the SuperLink's and SuperNode's processes ------------------------------------------


def test_flower_supernode_and_superlink_are_the_entry_functions_fedlb_runs_in_process():
    """`flower-supernode` is `flwr.supernode.cli:flower_supernode` and `flower-superlink`
    `flwr.superlink.cli:flower_superlink` (fedlb runs them in its own processes, forked)."""
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["flower-supernode"] == f"{flower.SUPERNODE_CLI}:flower_supernode"
    assert scripts["flower-superlink"] == f"{flower.SUPERLINK_CLI}:flower_superlink"
    assert callable(importlib.import_module(flower.SUPERNODE_CLI).flower_supernode)


SUPERLINK_PROBE = """
import json
from fedlb._flower_internals import run_superlink_cli

class Uvicorn:  # what the entry module's global `uvicorn` is replaced with
    def run(self, **options):
        app = options["app"]
        kind = f"{type(app).__module__}.{type(app).__name__}"
        print("PROBE " + json.dumps({"options": sorted(options), "app": kind}), flush=True)

run_superlink_cli(["--insecure", "--host", "127.0.0.1", "--port", "9"], uvicorn=Uvicorn())
"""


def test_the_superlink_serves_its_fastapi_app_with_its_entry_modules_uvicorn_run(tmp_path):
    """flwr/superlink/cli/flower_superlink.py has a module-level `uvicorn` whose
    `run(app=..., host=..., port=..., ...)` serves the SuperLink's FastAPI app: replaced,
    the entry point hands the replacement its app (what fedlb's gate serves through two
    doors), with the options the gate reads."""
    entry = importlib.import_module(flower.SUPERLINK_ENTRY)
    import uvicorn

    assert entry.uvicorn is uvicorn
    env = {**os.environ, "FLWR_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SUPERLINK_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, f"uvicorn.run was not called (code {done.returncode}):\n{done.stderr[-3000:]}"
    probe = json.loads(lines[0][len("PROBE ") :])
    assert probe["app"] == "fastapi.applications.FastAPI"
    assert set(flower.UVICORN_RUN_OPTIONS) <= set(probe["options"]), probe["options"]


def test_the_superlink_serves_fleet_runtime_and_health_under_the_paths_the_gate_admits():
    """The Fleet API's router has prefix /v1/fleet, the Runtime API's /v1/runtime, and the
    health check is GET /health (fedlb's gate admits these at the public door)."""

    def prefixes(name: str) -> set[str]:
        return {str(getattr(v, "prefix", "")) for v in vars(importlib.import_module(name)).values()}

    assert flower.FLEET_PATH.rstrip("/") in prefixes("flwr.superlink.routers.fleet.router")
    assert flower.RUNTIME_PATH.rstrip("/") in prefixes("flwr.supercore.routers.runtime.router")
    health = importlib.import_module("flwr.supercore.routers.health.router").router
    assert flower.HEALTH_PATH in {route.path for route in health.routes}


def test_acquire_task_is_the_method_the_superexec_interceptor_signs():
    """RuntimeHttpClient.AcquireTask calls the RPC method ACQUIRE_TASK, the name fedlb's
    warm server lists in SuperExecAuthHttpInterceptor's protected methods."""
    from flwr.supercore.runtime import RuntimeHttpClient

    assert f'rpc_method="{flower.ACQUIRE_TASK}"' in inspect.getsource(RuntimeHttpClient.AcquireTask)


# --- the SuperNode's loop -----------------------------------------------------------------


def test_the_supernode_loop_pauses_3_s_idle_and_half_a_second_waiting_through_its_module_time():
    """flwr/supernode/start_client_internal.py imports the `time` module and pauses with
    `time.sleep(3)` after an empty pull and `time.sleep(0.5)` while a reply or an object is
    not there yet; set_supernode_clock replaces that module global."""
    loop = flower.module(flower.SUPERNODE_LOOP)
    text = inspect.getsource(loop)
    assert f"time.sleep({flower.SUPERNODE_IDLE_SLEEP_S})" in text
    assert f"time.sleep({flower.SUPERNODE_WAIT_SLEEP_S})" in text
    assert loop.time is time
    clock = object()
    try:
        flower.set_supernode_clock(clock)
        assert loop.time is clock
    finally:
        loop.time = time


@pytest.mark.parametrize(
    ("owner", "name", "bind"),
    [
        (flower.SUPERNODE_LOOP, "pull_objects", flower.supernode_object_pulls),
        (
            flower.CLIENTAPP_RUNTIME,
            "pull_and_inflate_object_from_tree",
            flower.clientapp_object_pulls,
        ),
        (flower.SERVERAPP_GRID, "pull_objects", flower.serverapp_reply_pulls),
    ],
)
def test_object_pulls_go_through_a_module_global_that_takes_initial_backoff(owner, name, bind):
    """The SuperNode loop, the ClientApp runtime and the ServerApp's grid pull objects
    through a function their module imported by name, which takes `initial_backoff` (1 s by
    default); binding it twice leaves one partial over Flower's function."""
    module = flower.module(owner)
    original = getattr(module, name)
    assert "initial_backoff" in parameters(original)
    assert f"{name}(" in inspect.getsource(module)
    try:
        bind(0.05)
        bind(0.02)
        bound = getattr(module, name)
        assert bound.keywords == {"initial_backoff": 0.02}
        assert bound.func is original
    finally:
        setattr(module, name, original)


def test_the_supernode_loop_calls_its_pull_and_push_steps_by_module_global_name():
    """`start_client_internal` calls `_pull_and_store_message(...)` (-> the run id of the
    message it pulled, None: none) and `_push_messages(state=, object_store=, send=,
    push_object=)` through its module's globals, which fedlb wraps."""
    loop = flower.module(flower.SUPERNODE_LOOP)
    body = inspect.getsource(loop.start_client_internal)
    for name in (flower.SUPERNODE_PULL_STEP, flower.SUPERNODE_PUSH_STEP):
        assert f"{name}(" in body
    assert {"state", "object_store", "send", "push_object"} <= parameters(
        getattr(loop, flower.SUPERNODE_PUSH_STEP)
    )
    assert {"state", "object_store", "receive", "pull_object"} <= parameters(
        getattr(loop, flower.SUPERNODE_PULL_STEP)
    )


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


# --- the runtime API, as fedlb's warm server drives it ----------------------------------


def test_the_runtime_api_hands_tasks_to_a_signed_superexec_as_the_warm_path_asks():
    """AcquireTaskRequest(supported_task_types=[...]) -> AcquireTaskResponse(task: task_id,
    run_id; token); TaskType's values are the task types fedlb asks for;
    SuperExecAuthHttpInterceptor(master_secret, protected_methods) signs; the ClientApp
    runtime pulls its message with pull_and_inflate_object_from_tree (runtime_api_gaps)."""
    from flwr.proto.runtime_pb2 import AcquireTaskResponse
    from flwr.supercore.constant import TaskType

    assert flower.runtime_api_gaps() is None
    assert {f.name for f in AcquireTaskResponse.DESCRIPTOR.fields} >= {"task", "token"}
    task_fields = AcquireTaskResponse.DESCRIPTOR.fields_by_name["task"].message_type.fields
    assert {"task_id", "run_id"} <= {f.name for f in task_fields}
    types = (TaskType.CLIENT_APP.value, TaskType.SERVER_APP.value, TaskType.SIMULATION.value)
    assert types == flower.TASK_TYPES
    client = flower.superexec_client("127.0.0.1:9", b"x" * 32)
    client.close()


def test_acquire_task_reads_a_task_and_its_token_from_the_reply():
    """acquire_task returns (task id, run id, token), None when the reply has no task."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest, AcquireTaskResponse
    from flwr.proto.task_pb2 import Task

    asked: list[object] = []

    class Client:
        def __init__(self, reply):
            self.reply = reply

        def AcquireTask(self, request):  # noqa: N802 (Flower's name)
            assert isinstance(request, AcquireTaskRequest)
            asked.append(list(request.supported_task_types))
            return self.reply

    task = Task(task_id=3, run_id=4, type="flwr-clientapp")
    assert flower.acquire_task(
        Client(AcquireTaskResponse(task=task, token="t")), "flwr-clientapp"
    ) == (3, 4, "t")
    assert flower.acquire_task(Client(AcquireTaskResponse()), "flwr-serverapp") is None
    assert asked == [["flwr-clientapp"], ["flwr-serverapp"]]


def test_a_task_is_finished_failed_with_push_task_output_and_its_token():
    """PushTaskOutputRequest(sub_status=, details=) and RuntimeTokenHttpInterceptor(token)
    exist as push_task_failed calls them; a runtime API that is not there raises."""
    from flwr.proto.runtime_pb2 import PushTaskOutputRequest
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor

    PushTaskOutputRequest(sub_status="failed", details="x")
    RuntimeTokenHttpInterceptor("token")
    with pytest.raises(Exception):  # noqa: B017, PT011 (nothing listens on port 9)
        flower.push_task_failed("127.0.0.1:9", None, "token", "killed")


def test_run_clientapp_takes_what_flwr_clientapp_passes_and_ends_through_its_flwr_exit():
    """`run_clientapp(runtime_api_address, token, insecure, certificates, parent_pid)` of
    flwr/supernode/runtime/run_clientapp.py ends a task through its module global
    `flwr_exit` (what a resident worker replaces: end_tasks_with)."""
    runtime = flower.module(flower.CLIENTAPP_RUNTIME)
    assert {"runtime_api_address", "token", "insecure", "certificates", "parent_pid"} <= (
        parameters(runtime.run_clientapp)
    )
    assert "flwr_exit(" in inspect.getsource(runtime.run_clientapp)
    original = runtime.flwr_exit
    try:
        flower.end_tasks_with(runtime, print)
        assert runtime.flwr_exit is print
    finally:
        runtime.flwr_exit = original
    called = {}
    fake = type("Runtime", (), {"run_clientapp": staticmethod(lambda **kw: called.update(kw))})
    flower.run_clientapp("127.0.0.1:9", "token", 42, fake)
    assert called == {
        "runtime_api_address": "127.0.0.1:9",
        "token": "token",
        "insecure": True,
        "certificates": None,
        "parent_pid": 42,
    }


@pytest.mark.parametrize("task", ["flwr-serverapp", "flwr-simulation"])
def test_server_side_runtimes_take_what_their_processes_pass(task):
    """run_serverapp and run_simulation_process take (runtime_api_address, log_queue,
    token, insecure, certificates, parent_pid, runtime_dependency_install), and their
    modules use flwr.supercore.logger's log uploader by name (flush_logs_without_pause)."""
    from flwr.supercore import logger

    runtime, run = flower.server_side_runtime(task)
    assert {
        "runtime_api_address",
        "log_queue",
        "token",
        "insecure",
        "certificates",
        "parent_pid",
        "runtime_dependency_install",
    } <= parameters(run)
    assert runtime.start_log_uploader is logger.start_log_uploader
    assert runtime.flush_logs is logger.flush_logs
    assert runtime.stop_log_uploader is logger.stop_log_uploader


MIRROR_PROBE = """
import sys
from queue import Queue
from fedlb._flower_internals import output_mirrored_to

queue = Queue()
with output_mirrored_to(queue):
    print("a line of the run", flush=True)
seen = []
while not queue.empty():
    seen.append(str(queue.get()))
restored = sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__
sys.__stderr__.write(f"MIRRORED {'a line of the run' in ''.join(seen)} RESTORED {restored}\\n")
"""


def test_a_processs_output_is_mirrored_to_a_runs_log_queue():
    """mirror_output_to_queue: what the process prints meanwhile reaches the queue (the
    run's log); restore_output puts sys.__stdout__ / sys.__stderr__ back (in a process of
    its own: it does not restore what a test runner had put there)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", MIRROR_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert "MIRRORED True RESTORED True" in done.stderr, done.stderr[-3000:]


def test_flowers_flush_logs_pauses_a_second_after_the_queue_empties():
    """The pause flush_logs_without_pause removes is there in this Flower (else drop it)."""
    from queue import Queue

    from flwr.supercore import logger

    started = time.monotonic()
    assert logger.flush_logs(Queue())
    assert time.monotonic() - started >= 0.9 * flower.LOG_FLUSH_PAUSE_S


def test_a_runs_log_is_flushed_without_flowers_pause():
    """The log uploader Flower starts (start_log_uploader: a thread that pushes what the
    queue holds and ends at a None) and flush_logs, replaced: the flush returns once every
    line is pushed and the uploader has ended, without calling Flower's flush_logs (whose
    pause the test above measures), and Flower's stop afterwards is a no-op."""
    import types
    from queue import Queue

    from flwr.supercore import logger

    pushed: list[str] = []
    flowers_flush: list[object] = []

    class Client:  # the runtime client's one call the uploader makes
        def PushLogs(self, request):  # noqa: N802 (Flower's name)
            time.sleep(0.05)  # a round trip
            pushed.extend(request.logs)

    def flush_logs(*args, **kwargs):  # Flower's, with its pause: it must not be called
        flowers_flush.append(args)
        return logger.flush_logs(*args, **kwargs)

    runtime = types.SimpleNamespace(
        start_log_uploader=logger.start_log_uploader, flush_logs=flush_logs
    )
    flower.flush_logs_without_pause(runtime)
    queue: Queue[str | None] = Queue()
    uploader = runtime.start_log_uploader(queue, node_id=0, run_id=1, client=Client())
    for i in range(5):
        queue.put(f"line {i}\n")
    assert runtime.flush_logs(queue)
    assert pushed == [f"line {i}\n" for i in range(5)]  # every line, pushed, in order
    assert not uploader.is_alive()
    assert flowers_flush == []  # no pause: the wait was for the uploader, nothing more
    logger.stop_log_uploader(queue, uploader, timeout=0.1)  # Flower's stop: done


def test_the_parent_process_monitor_takes_a_pid():
    """start_parent_process_monitor(parent_pid) (flwr/supercore/app_utils.py)."""
    from flwr.supercore.app_utils import start_parent_process_monitor

    assert list(inspect.signature(start_parent_process_monitor).parameters) == ["parent_pid"]


def test_flowers_exit_handlers_run_in_two_phases_and_leave_the_list():
    """add_exit_handler(fn, run_before_force_exit=) appends to the module-level list
    registered_exit_handlers; run_exit_handlers runs both phases (early first) and the list
    is back where it was."""
    from flwr.supercore.exit import exit_handler

    assert flower.exit_handlers() is exit_handler.registered_exit_handlers
    before = len(flower.exit_handlers())
    ran: list[str] = []
    exit_handler.add_exit_handler(lambda: ran.append("late"), run_before_force_exit=False)
    exit_handler.add_exit_handler(lambda: ran.append("early"), run_before_force_exit=True)
    flower.run_exit_handlers()
    assert ran == ["early", "late"]
    assert len(flower.exit_handlers()) == before


# --- the Control API and the flwr CLI's helpers -----------------------------------------


def test_the_control_api_client_has_the_calls_fedlb_makes():
    """ControlHttpClient (with the CLI's interceptors) has StartRun, ListRuns, StopRun,
    StreamLogs and RegisterNode; cli_errors is the CLI's translation into ClickException."""
    import click

    client = flower.control_client("127.0.0.1:9", None)
    try:
        for call in ("StartRun", "ListRuns", "StopRun", "StreamLogs", "RegisterNode"):
            assert callable(getattr(client, call))
    finally:
        client.close()
    with pytest.raises(click.ClickException), flower.cli_errors():
        flower.control_client("127.0.0.1:9", None).ListRuns(flower.list_runs_request())


def test_a_run_is_submitted_as_flwr_run_builds_it():
    """build_fab (load_and_validate, build_fab_from_disk) of fedlb's app, parse_config
    (Flower's --run-config syntax) and start_run_request (fab_to_proto, Fab,
    user_config_to_proto, simulation_config_from_json)."""
    import hashlib

    app = ROOT / "fedlb" / "deploy" / "app"
    fab = flower.build_fab(app)
    assert fab[:2] == b"PK"  # a zip
    config = flower.parse_config("num-rounds=3 dataset='mnist' lr=0.5")
    assert config == {"num-rounds": 3, "dataset": "mnist", "lr": 0.5}
    digest = hashlib.sha256(fab).hexdigest()
    request = flower.start_run_request(digest, fab, config, {"num_supernodes": 3})
    assert request.fab.hash_str == digest
    assert request.HasField("override_federation_config")
    plain = flower.start_run_request(digest, fab, {}, None)
    assert not plain.HasField("override_federation_config")


def test_building_a_users_fab_leaves_none_of_its_modules_imported(tmp_path):
    """Flower's check imports the app's package (find_spec of its module refs); a later
    app of the same package name, or a changed copy, must be imported from its own folder."""
    import shutil
    import sys

    app = tmp_path / "app"
    shutil.copytree(ROOT / "tests" / "apps" / "quickstart_pytorch", app)
    flower.build_fab(app)
    assert not [m for m in sys.modules if m.split(".")[0] == "pytorchexample"]


def test_runs_are_listed_stopped_and_streamed_with_these_requests():
    """ListRunsRequest(run_id), run_from_proto's status (status, sub_status) as `flwr ls`
    writes it, StopRunRequest(run_id), StreamLogsRequest(run_id, after_timestamp)."""
    from flwr.common.serde import run_to_proto
    from flwr.proto.control_pb2 import ListRunsResponse
    from flwr.supercore.run import Run

    assert flower.list_runs_request("3").run_id == 3
    assert flower.stop_run_request("4").run_id == 4
    assert flower.stream_logs_request("5").run_id == 5
    done, running = Run.create_empty(1), Run.create_empty(2)
    done.status.status, done.status.sub_status = "finished", "completed"
    running.status.status = "running"
    reply = ListRunsResponse(run_dict={1: run_to_proto(done), 2: run_to_proto(running)})
    assert flower.run_statuses(reply) == {"1": "finished:completed", "2": "running"}


def test_a_silo_key_is_registered_as_flwr_supernode_register_reads_it(tmp_path):
    """register_node_request reads a silo's public key (fedlb silo-key: an EC key in
    OpenSSH form) as `flwr supernode register` does; the SuperLink's refusal of a known key
    says ALREADY_REGISTERED."""
    from fedlb.security import make_silo_key

    _, public = make_silo_key(tmp_path, "silo-0")
    assert flower.register_node_request(public).public_key
    assert flower_says(f'"{flower.ALREADY_REGISTERED}')


# --- lines Flower logs --------------------------------------------------------------------


def test_the_lines_fedlb_reads_in_a_supernodes_log_are_flowers():
    """The SuperNode loop logs "SuperNode ID: %s" once connected; flwr_exit writes
    "Exit Code: N", the reason and "For more information, visit: <...>"; the connection
    errors' generic lines, the ClientApp runtime's "%s raised an exception" (its entity:
    "ClientApp") and the API error codes 2001 and 2004 are Flower's."""
    from flwr.supercore.error.base import ApiErrorCode

    assert 'log(INFO, "SuperNode ID: %s", node_id)' in source(flower.SUPERNODE_LOOP)
    assert flower.SUPERNODE_CONNECTED.search("INFO :      SuperNode ID: 123").group(1) == "123"
    exit_source = source("flwr.supercore.exit.exit")
    assert 'f"Exit Code: {code}\\n"' in exit_source
    assert f"{flower.EXIT_MORE_INFORMATION}, visit: " in exit_source
    assert flower.EXIT_CODE.search("Exit Code: 305").group(1) == "305"
    for line in flower.EXIT_GENERIC_LINES:
        assert flower_says(line), line
    runtime = source(flower.CLIENTAPP_RUNTIME)
    assert '"%s raised an exception"' in runtime
    assert '"ClientApp"' in runtime
    assert flower.CLIENTAPP_RAISED == "ClientApp raised an exception"
    disabled = int(ApiErrorCode.FLEET_SUPERNODE_REGISTRATION_DISABLED)
    assert f"[code: {disabled}]" == flower.REGISTRATION_DISABLED
    not_activated = int(ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED)
    assert f"[code: {not_activated}]" == flower.NODE_ACTIVATION_FAILED
    assert flower_says("[code: {")  # how Flower writes a code into a reason


# --- outside a run ------------------------------------------------------------------------


def test_messages_are_built_outside_a_run_once_the_task_identity_is_set():
    """Message(...) reads TaskIdentity, which raises while unset; task_identity sets it
    and puts back what was there (its class attributes _run_id, _task_id, _node_id)."""
    from flwr.app import Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    with flower.task_identity(run_id=3, task_id=4, node_id=0):
        message = Message(RecordDict(), dst_node_id=2, message_type="train")
        assert message.metadata.run_id == 3
    assert (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id) == saved


def test_aggregate_arrayrecords_is_fedavgs_weighted_average():
    """strategy_utils.aggregate_arrayrecords(records, weighting_key): the arrays of each
    RecordDict weighted by its MetricRecord value."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

    records = [
        RecordDict({"a": ArrayRecord({"w": Array(np.full(2, v))}), "m": MetricRecord({"n": n})})
        for v, n in ((1.0, 1), (4.0, 3))
    ]
    average = flower.aggregate_arrayrecords(records, "n")
    np.testing.assert_allclose(average["w"].numpy(), np.full(2, 3.25))


def test_a_clientapps_call_chain_and_mod_types_are_flowers():
    """ClientAppCallable and Mod (flwr/clientapp/typing.py), through this module."""
    from flwr.clientapp import typing as clientapp_typing

    assert flower.ClientAppCallable is clientapp_typing.ClientAppCallable
    assert flower.Mod is clientapp_typing.Mod
    with pytest.raises(AttributeError):
        _ = flower.NoSuchName
