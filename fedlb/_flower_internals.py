"""Every private detail of Flower that fedlb relies on, in one module.

fedlb runs on Flower 1.42 (pyproject: `flwr>=1.41,<1.43`). Besides Flower's public API
(`flwr.app`, `flwr.clientapp`, `flwr.serverapp`, `flwr.simulation`, the names `flwr.common`
exports), its deployment (fedlb.deploy), experiments, benchmarks and tests reach into parts
Flower does not promise to keep: the SuperLink's and SuperNode's entry modules, the
SuperNode's loop and node state, the ClientApp and ServerApp runtimes and their runtime
API, the Control API client and the `flwr` CLI's helpers, the lines Flower logs. Each such
detail is here, once: a constant or a small function whose docstring says what Flower 1.42
does that fedlb relies on, and where in flwr it lives. tests/test_flower_internals.py checks
each by name, so a new Flower release fails one named test per broken assumption instead of
a timeout deep in a deployed run; `scripts/check-flower-nightly.sh` runs those tests and the
deployed ones against the newest `flwr-nightly` (docs/flower.md, "Flower versions").

Rules: this module imports nothing of fedlb and flwr only inside its functions (importing
it costs nothing); the rest of fedlb imports these names instead of flwr's private modules
(tests/test_layers.py checks it). Where a Flower nightly already differs, the detail says
how and handles both (one place to look when the next release lands).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # type aliases only; flwr.clientapp does not export them
    from flwr.clientapp.typing import ClientAppCallable as ClientAppCallable
    from flwr.clientapp.typing import Mod as Mod

# --------------------------------------------------------------------------------------
# Modules fedlb imports by name (before a fork, or to patch one of their globals)

SUPERNODE_CLI = "flwr.supernode.cli"
"""The package of `flower-supernode`'s entry function (`flower_supernode`)."""
SUPERLINK_CLI = "flwr.superlink.cli"
"""The package of `flower-superlink`'s entry function (`flower_superlink`)."""
SUPERLINK_ENTRY = "flwr.superlink.cli.flower_superlink"
"""The module that holds `flower_superlink` (the package's attribute of the same name is
the function, hence importlib): it serves the SuperLink's app with its own `uvicorn`."""
SUPERNODE_LOOP = "flwr.supernode.start_client_internal"
"""The SuperNode's pull/run/push loop (`start_client_internal`) and its steps."""
CLIENTAPP_RUNTIME = "flwr.supernode.runtime.run_clientapp"
"""What `flwr-clientapp` runs: `run_clientapp`, `pull_and_inflate_object_from_tree`,
`flwr_exit`, all module globals."""
SERVERAPP_RUNTIME = "flwr.superlink.runtime.run_serverapp"
"""What `flwr-serverapp` runs: `run_serverapp` and its log uploader's functions (the
package `flwr.superlink.runtime` exports a function of the module's name: importlib)."""
SIMULATION_RUNTIME = "flwr.simulation.app"
"""What `flwr-simulation` runs: `run_simulation_process` and its log uploader's functions."""
SERVERAPP_GRID = "flwr.superlink.grid.http_grid"
"""The ServerApp's grid over the runtime API (`HttpGrid`) and its `pull_objects`."""


def module(name: str) -> ModuleType:
    """The flwr module `name` (one of the constants above), imported."""
    return importlib.import_module(name)


# --------------------------------------------------------------------------------------
# The SuperLink and SuperNode processes


def run_supernode_cli(arguments: Sequence[str]) -> None:
    """Flower's own `flower-supernode ARGUMENTS` in this process: `flower_supernode()` of
    `flwr.supernode.cli` reads `sys.argv` (argparse) and runs until the node stops."""
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *arguments]
    flower_supernode()


def run_superlink_cli(arguments: Sequence[str], uvicorn: object | None = None) -> None:
    """Flower's own `flower-superlink ARGUMENTS` in this process; with `uvicorn`, the
    entry module's global `uvicorn` is that object first.

    Flower 1.42's `flwr/superlink/cli/flower_superlink.py` does `import uvicorn` at module
    level and serves the SuperLink's FastAPI app (Fleet, Control and Runtime APIs on one
    port) with `uvicorn.run(app=..., host=..., port=..., reload=False, workers=1,
    ssl_keyfile=..., ssl_certfile=..., ...)`: fedlb's gate (fedlb.deploy.gate) serves the
    same app through two doors by replacing that global."""
    entry = importlib.import_module(SUPERLINK_ENTRY)
    if uvicorn is not None:
        setattr(entry, "uvicorn", uvicorn)  # noqa: B010 (a module's global)
    sys.argv = ["flower-superlink", *arguments]
    entry.flower_superlink()


UVICORN_RUN_OPTIONS = ("app", "host", "port", "reload", "workers", "ssl_keyfile", "ssl_certfile")
"""The keyword arguments Flower 1.42's SuperLink passes `uvicorn.run` that the gate reads
(the rest it passes on to uvicorn as they come)."""

FLEET_PATH = "/v1/fleet/"
"""The URL prefix of the SuperLink's Fleet API (what SuperNodes call), Flower 1.42's HTTP
transport (`flwr/superlink/routers/fleet`)."""
RUNTIME_PATH = "/v1/runtime/"
"""The URL prefix of the Runtime API (the ServerApp's and the SuperExec's calls)."""
HEALTH_PATH = "/health"
"""The SuperLink's and SuperNode's health check (200 once serving)."""
ACQUIRE_TASK = "/flwr.proto.Runtime/AcquireTask"
"""The RPC method name `SuperExecAuthHttpInterceptor` signs for AcquireTask: only a caller
holding the SuperExec secret (`--superexec-auth-secret-file`) is handed tasks."""


# --------------------------------------------------------------------------------------
# The SuperNode's loop (flwr/supernode/start_client_internal.py)

SUPERNODE_IDLE_SLEEP_S = 3
"""The loop's `time.sleep(3)` after a pull that found no message."""
SUPERNODE_WAIT_SLEEP_S = 0.5
"""Its `time.sleep(0.5)` while a reply (or an object's content) is not there yet."""
SUPERNODE_PULL_STEP = "_pull_and_store_message"
"""The loop's step that pulls one message, stores it and creates its task; it returns the
message's run id (None: none pulled). Called by name from `start_client_internal`."""
SUPERNODE_PUSH_STEP = "_push_messages"
"""The loop's step that waits for a reply and pushes it; keyword arguments `state`,
`object_store`, `send`, `push_object`. Called by name from `start_client_internal`.
(flwr-nightly 1.43.0.dev20261026's stops waiting once no task is active: see
`answer_with_error`.)"""


def superlink_node_id() -> int:
    """The SuperLink's node id: the source of every message a SuperNode receives and the
    destination of every reply it pushes (`flwr.common.constant.SUPERLINK_NODE_ID`, 1)."""
    from flwr.common.constant import SUPERLINK_NODE_ID

    return int(SUPERLINK_NODE_ID)


def set_supernode_clock(clock: object, loop: ModuleType | None = None) -> None:
    """Make the SuperNode loop's module global `time` (Flower 1.42 imports the module and
    calls `time.sleep(...)` through it) `clock`: fedlb shortens its fixed pauses."""
    setattr(loop or module(SUPERNODE_LOOP), "time", clock)  # noqa: B010 (a module)


def first_retry_after(owner: object, name: str, backoff: float) -> None:
    """Bind `initial_backoff=backoff` to Flower's object-pull function that `owner` (a
    module) imported as `name` (once: a second call replaces the first binding).

    Flower 1.42's `pull_objects` and `pull_and_inflate_object_from_tree`
    (flwr/supercore/inflatable/inflatable_utils.py) retry a missing object after
    `initial_backoff` s, 1 s by default; the modules that call them imported them by name."""
    pull = getattr(owner, name)
    original = pull.func if isinstance(pull, functools.partial) else pull
    setattr(owner, name, functools.partial(original, initial_backoff=backoff))


def supernode_object_pulls(backoff: float, loop: ModuleType | None = None) -> None:
    """The SuperNode loop pulls a message's objects through its module's `pull_objects`."""
    first_retry_after(loop or module(SUPERNODE_LOOP), "pull_objects", backoff)


def clientapp_object_pulls(backoff: float) -> None:
    """The ClientApp runtime pulls its message through its module's
    `pull_and_inflate_object_from_tree`."""
    first_retry_after(module(CLIENTAPP_RUNTIME), "pull_and_inflate_object_from_tree", backoff)


def serverapp_reply_pulls(backoff: float) -> None:
    """The ServerApp's grid (`HttpGrid.pull_messages`) pulls a reply's objects through its
    module's `pull_objects`."""
    first_retry_after(module(SERVERAPP_GRID), "pull_objects", backoff)


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
# Heartbeats


def heartbeat_limits_s() -> tuple[int, int, int]:
    """(least, default, most) heartbeat interval a SuperNode may announce, in seconds:
    Flower 1.42's `HEARTBEAT_MIN_INTERVAL`, `HEARTBEAT_DEFAULT_INTERVAL` and
    `HEARTBEAT_MAX_INTERVAL` (flwr/common/constant.py): 10, 30, 1800."""
    from flwr.common import constant

    return (
        constant.HEARTBEAT_MIN_INTERVAL,
        constant.HEARTBEAT_DEFAULT_INTERVAL,
        constant.HEARTBEAT_MAX_INTERVAL,
    )


def heartbeat_patience() -> int:
    """How many announced intervals without a heartbeat make the SuperLink declare a node
    gone (and answer its pending messages with NODE_UNAVAILABLE): `HEARTBEAT_PATIENCE`, 2."""
    from flwr.common.constant import HEARTBEAT_PATIENCE

    return int(HEARTBEAT_PATIENCE)


def set_node_heartbeat_interval(interval_s: float) -> None:
    """Make this process's SuperNode announce (ActivateNode, SendNodeHeartbeat) and beat
    at `interval_s`. Flower 1.42 reads the module globals `HEARTBEAT_DEFAULT_INTERVAL` of
    `flwr.supernode.fleet_http_connection` (what it announces) and of
    `flwr.supercore.heartbeat` (the `HeartbeatSender`'s pace: every
    (interval - 5 s) x 0.8..1.0), each imported from flwr.common.constant."""
    from flwr.supercore import heartbeat
    from flwr.supernode import fleet_http_connection

    setattr(fleet_http_connection, "HEARTBEAT_DEFAULT_INTERVAL", interval_s)  # noqa: B010
    setattr(heartbeat, "HEARTBEAT_DEFAULT_INTERVAL", interval_s)  # noqa: B010


# --------------------------------------------------------------------------------------
# The SuperNode's node state: a ClientApp task that failed without a reply


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


# --------------------------------------------------------------------------------------
# The SuperLink's state: a message whose destination node is gone


def linkstate_class() -> Any:
    """The SuperLink's state class for `--database :flwr-in-memory:` (what fedlb runs):
    `flwr.server.superlink.linkstate.in_memory_linkstate.InMemoryLinkState`."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    return InMemoryLinkState


def answer_messages_to_offline_nodes(state_class: Any | None = None) -> None:
    """Make the SuperLink answer a ServerApp's pull for the replies to messages whose
    destination node is offline (its heartbeats stopped: `online_until` passed) or gone
    with Flower's own NODE_UNAVAILABLE error reply, as Flower 1.42 does.

    Flower 1.42's ServerApp pulls replies through `state.get_message_res(message_ids,
    run_id)`, which adds such an error reply for each message to an offline node
    (`check_node_availability_for_in_message`, flwr/server/superlink/linkstate/utils.py):
    a silo whose machine died ends its round after 2 heartbeat intervals. flwr-nightly
    1.43.0.dev20261026's PullMessages reads `state.get_messages(dst_node_id=
    SUPERLINK_NODE_ID, run_id, reply_to_message_ids)` from the store the state shares
    with the SuperNode's (flwr/supercore/corestate), which checks no node: the ServerApp
    waits for its own timeout. Here `get_messages` of `state_class` (default:
    linkstate_class()), asked for the replies to given messages, first stores Flower's own
    error reply (the same helper, from the same node table) for each of them that is
    unanswered and whose node is offline. On 1.42, whose SuperLink keeps messages in its
    own stores, the shared store holds none: nothing changes."""
    from flwr.server.superlink.linkstate.utils import check_node_availability_for_in_message
    from flwr.supercore.constant import NodeStatus

    state_class = state_class or linkstate_class()
    get = state_class.get_messages
    if getattr(get, "answers_offline_nodes", False):  # already in place
        return

    @functools.wraps(get)
    def get_messages(self: Any, *, dst_node_id: int, **filters: Any) -> Any:
        asked = filters.get("reply_to_message_ids")
        if dst_node_id == superlink_node_id() and asked:  # a ServerApp's pull of replies
            waiting = _unanswered_instructions(self, filters.get("run_id"), set(asked))
            if waiting:
                with self.lock:
                    online = {
                        node_id: info.online_until
                        for node_id, info in self.nodes.items()
                        if info.status != NodeStatus.UNREGISTERED
                    }
                errors = check_node_availability_for_in_message(
                    inquired_in_message_ids=set(waiting),
                    found_in_message_dict=waiting,
                    node_id_to_online_until=online,
                )
                for reply in errors.values():
                    self._store_generated_message(reply)
                    self.store_messages([reply])
        return get(self, dst_node_id=dst_node_id, **filters)

    setattr(get_messages, "answers_offline_nodes", True)  # noqa: B010
    state_class.get_messages = get_messages


def _unanswered_instructions(state: Any, run_id: int | None, asked: set[str]) -> dict[str, Any]:
    """The messages among `asked` the ServerApp sent (of run `run_id`, None: any) that no
    reply in the state's shared store answers, rebuilt from their records (as Messages)."""
    from flwr.app import Message, RecordDict

    records = getattr(state, "message_store", None)
    if not isinstance(records, dict) or not records:
        return {}
    link = superlink_node_id()
    with state.lock_message_store:
        answered = {r.metadata.reply_to_message_id for r in records.values()}
        waiting = {
            message_id: copy.deepcopy(record.metadata)
            for message_id, record in records.items()
            if message_id in asked
            and record.metadata.src_node_id == link
            and record.metadata.dst_node_id != link
            and not record.metadata.reply_to_message_id
            and (run_id is None or record.metadata.run_id == run_id)
            and message_id not in answered
        }
    # Message(content, metadata=...): Flower's own way to rebuild one (not overloaded)
    return {
        message_id: Message(RecordDict(), metadata=metadata)  # type: ignore[call-overload]
        for message_id, metadata in waiting.items()
    }


# --------------------------------------------------------------------------------------
# The runtime API, driven as Flower's SuperExec drives it (fedlb.deploy.warm)

TASK_TYPES = ("flwr-clientapp", "flwr-serverapp", "flwr-simulation")
"""`flwr.supercore.constant.TaskType` values of the tasks a warm server runs."""


def runtime_api_gaps() -> str | None:
    """Why this Flower's runtime API cannot be driven as fedlb's warm path drives it (None:
    it can): `AcquireTaskRequest(supported_task_types=...)` in flwr/proto/runtime_pb2,
    `SuperExecAuthHttpInterceptor` in flwr/supercore/interceptors, and the ClientApp
    runtime pulling its message through `pull_and_inflate_object_from_tree`."""
    try:
        from flwr.proto.runtime_pb2 import AcquireTaskRequest
        from flwr.supercore.interceptors import SuperExecAuthHttpInterceptor  # noqa: F401

        runtime = module(CLIENTAPP_RUNTIME)
    except ImportError as error:
        return f"this Flower lacks its runtime API for an external SuperExec ({error})"
    if "supported_task_types" not in AcquireTaskRequest.DESCRIPTOR.fields_by_name:
        return "this Flower's AcquireTask takes no task types"
    if not hasattr(runtime, "pull_and_inflate_object_from_tree"):
        return "this Flower's ClientApp runtime pulls messages another way"
    return None


def _runtime_client(
    address: str, root_certificates: bytes | None, interceptor: Any, retry: bool
) -> Any:
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec"), interceptor],
        **({"retry_invoker": make_simple_http_retry_invoker()} if retry else {}),
    )


def superexec_client(address: str, secret: bytes, root_certificates: bytes | None = None) -> Any:
    """A runtime API client as Flower's SuperExec makes one (flwr/supercore/superexec):
    `RuntimeHttpClient.from_server_address` with `RuntimeVersionHttpInterceptor
    (component_name="SuperExec")` and `SuperExecAuthHttpInterceptor(master_secret,
    protected_methods={ACQUIRE_TASK})`, retrying as `make_simple_http_retry_invoker()`
    retries; `root_certificates` None: plain HTTP."""
    from flwr.supercore.interceptors import SuperExecAuthHttpInterceptor

    auth = SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods={ACQUIRE_TASK})
    return _runtime_client(address, root_certificates, auth, retry=True)


def acquire_task(client: Any, task_type: str) -> tuple[int, int, str] | None:
    """(task id, run id, token) of the next task of `task_type` the runtime API hands the
    SuperExec client `client` (None: none waiting): `AcquireTask(AcquireTaskRequest(
    supported_task_types=[...]))` answers `task` (task_id, run_id) and `token`."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest

    reply = client.AcquireTask(AcquireTaskRequest(supported_task_types=[task_type]))
    if not reply.HasField("task") or not reply.token:
        return None
    return int(reply.task.task_id), int(reply.task.run_id), str(reply.token)


def push_task_failed(
    address: str, root_certificates: bytes | None, token: str, details: str
) -> None:
    """Finish the task holding `token` as FAILED with `details`, as Flower's runtime does on
    its way out: `PushTaskOutput(PushTaskOutputRequest(sub_status=SubStatus.FAILED,
    details=...))` with `RuntimeTokenHttpInterceptor(token)`. Raises what the call raises."""
    from flwr.common.constant import SubStatus
    from flwr.proto.runtime_pb2 import PushTaskOutputRequest
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor

    token_interceptor = RuntimeTokenHttpInterceptor(token)
    client = _runtime_client(address, root_certificates, token_interceptor, retry=False)
    try:
        client.PushTaskOutput(PushTaskOutputRequest(sub_status=SubStatus.FAILED, details=details))
    finally:
        client.close()


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


# --------------------------------------------------------------------------------------
# The Control API and the `flwr` CLI's helpers (fedlb.deploy.control)

ALREADY_REGISTERED = "Public key already in use"
"""The SuperLink's words when RegisterNode gets a public key it knows
(flwr/superlink/servicer/control/control_handlers.py)."""


def control_client(address: str, root_certificates: bytes | None) -> Any:
    """A Control API client as the `flwr` CLI makes one: `ControlHttpClient.
    from_server_address` (flwr/supercore/control) with `CliClientHttpInterceptor` (the
    SuperLink serves these calls to the CLI) and `RuntimeVersionHttpInterceptor
    (component_name="flwr CLI")`."""
    from flwr.cli.cli_client_interceptor import CliClientHttpInterceptor
    from flwr.supercore.control import ControlHttpClient
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

    return ControlHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=[
            CliClientHttpInterceptor(),
            RuntimeVersionHttpInterceptor(component_name="flwr CLI"),
        ],
    )


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """The `flwr` CLI's translation of a failed Control API call into a
    `click.ClickException` with the SuperLink's reason (flwr/cli/utils.py,
    `flwr_cli_exc_handler`)."""
    from flwr.cli.utils import flwr_cli_exc_handler

    with flwr_cli_exc_handler():
        yield


def build_fab(app: Path) -> bytes:
    """The FAB `flwr run` builds from the Flower app in `app`: its pyproject.toml checked
    (`flwr.cli.config_utils.load_and_validate`, ValueError when wrong), then
    `flwr.cli.build.build_fab_from_disk`; the modules the check imported are forgotten."""
    import warnings

    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.config_utils import load_and_validate

    loaded = set(sys.modules)
    try:
        with warnings.catch_warnings():  # deprecations inside Flower's dependencies (pathspec)
            warnings.simplefilter("ignore", DeprecationWarning)
            load_and_validate(app / "pyproject.toml")
            fab: bytes = build_fab_from_disk(app)
    finally:
        # The check finds the app's modules, which imports their package into this process
        # (importlib.util.find_spec): forget it, so another app of the same package name, or
        # a changed copy, is imported from its own folder later.
        folder = str(app.resolve())
        for name in set(sys.modules) - loaded:
            where = getattr(sys.modules[name], "__file__", None) or "".join(
                getattr(sys.modules[name], "__path__", [])
            )
            if str(Path(where).resolve()).startswith(folder):
                del sys.modules[name]
    return fab


def parse_config(text: str) -> dict[str, Any]:
    """`--run-config` / `--node-config` text ("k=v k2='s'", TOML values) as Flower parses
    it (`flwr.common.config.parse_config_args`)."""
    from flwr.common.config import parse_config_args

    return dict(parse_config_args([text]))


def start_run_request(
    fab_hash: str,
    fab_bytes: bytes,
    run_config: Mapping[str, Any],
    simulation: Mapping[str, Any] | None,
) -> Any:
    """StartRun's request as `flwr run` builds it: `StartRunRequest(fab=fab_to_proto(Fab(
    hash, content, {})), override_config=user_config_to_proto(...), federation="",
    override_federation_config=simulation_config_from_json(...) or None, app_spec="")`
    (flwr/common/serde.py, flwr/supercore/fab.py, flwr/supercore/utils.py)."""
    from flwr.common.serde import fab_to_proto, user_config_to_proto
    from flwr.proto.control_pb2 import StartRunRequest
    from flwr.supercore.fab import Fab
    from flwr.supercore.utils import simulation_config_from_json

    return StartRunRequest(
        fab=fab_to_proto(Fab(fab_hash, fab_bytes, {})),
        override_config=user_config_to_proto(dict(run_config)),
        federation="",
        override_federation_config=(
            simulation_config_from_json(dict(simulation)) if simulation else None
        ),
        app_spec="",
    )


def list_runs_request(run_id: str | None = None) -> Any:
    """ListRuns' request (every run, or `run_id`'s)."""
    from flwr.proto.control_pb2 import ListRunsRequest

    return ListRunsRequest(run_id=int(run_id)) if run_id else ListRunsRequest()


def run_statuses(reply: Any) -> dict[str, str]:
    """Each run's status in a ListRuns reply, as `flwr ls` writes it ("running",
    "finished:completed", ...): `run_from_proto(...).status.status` and `.sub_status`."""
    from flwr.common.serde import run_from_proto

    statuses = {}
    for proto in reply.run_dict.values():
        run = run_from_proto(proto)
        sub = run.status.sub_status
        statuses[str(run.run_id)] = f"{run.status.status}:{sub}" if sub else run.status.status
    return statuses


def stop_run_request(run_id: str) -> Any:
    """StopRun's request."""
    from flwr.proto.control_pb2 import StopRunRequest

    return StopRunRequest(run_id=int(run_id))


def register_node_request(public_key: Path) -> Any:
    """RegisterNode's request for the SuperNode public key in `public_key`, read as
    `flwr supernode register` reads it (`flwr.cli.supernode.register.try_load_public_key`)."""
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.proto.control_pb2 import RegisterNodeRequest

    return RegisterNodeRequest(public_key=try_load_public_key(public_key))


def stream_logs_request(run_id: str) -> Any:
    """StreamLogs' request from the run's start (each reply's `log_output` is text)."""
    from flwr.proto.control_pb2 import StreamLogsRequest

    return StreamLogsRequest(run_id=int(run_id), after_timestamp=0.0)


# --------------------------------------------------------------------------------------
# Lines Flower logs that fedlb reads (fedlb.deploy.join)

SUPERNODE_CONNECTED = re.compile(r"SuperNode ID: (\d+)")
"""The SuperNode loop's INFO line once ActivateNode succeeded: "SuperNode ID: N"
(flwr/supernode/start_client_internal.py)."""
EXIT_CODE = re.compile(r"Exit Code: (\d+)")
"""`flwr_exit`'s first line of an error exit (flwr/supercore/exit/exit.py); the reason
follows, then "For more information, visit: <...>"."""
EXIT_MORE_INFORMATION = "For more information"
"""The start of `flwr_exit`'s last line."""
EXIT_GENERIC_LINES = (
    "Failed to initialize the connection to the SuperLink.",
    "The SuperNode could not establish a connection to the SuperLink.",
)
"""`flwr_exit`'s lines around a SuperNode's connection error that say nothing of its cause."""
REGISTRATION_DISABLED = "[code: 2001]"
"""How a SuperNode's exit reason names `ApiErrorCode.FLEET_SUPERNODE_REGISTRATION_DISABLED`
(flwr/supercore/error/base.py): the SuperLink admits registered nodes only."""
NODE_ACTIVATION_FAILED = "[code: 2004]"
"""... and `FLEET_NODE_ACTIVATION_FAILED`: the SuperLink does not know the node's key (or a
node with that key is still connected)."""
CLIENTAPP_RAISED = "ClientApp raised an exception"
"""The ClientApp runtime's ERROR line before an app's traceback ("%s raised an exception",
flwr/supernode/runtime/run_clientapp.py)."""


# --------------------------------------------------------------------------------------
# Outside a run: the task identity, types, helpers


@contextlib.contextmanager
def task_identity(run_id: int = 1, task_id: int = 1, node_id: int = 0) -> Iterator[None]:
    """Flower's task identity set for building Messages outside a run, then put back.
    `Message(...)` reads `TaskIdentity.run_id` / `node_id` / `task_id`
    (flwr/supercore/task_identity.py: class properties that raise while unset, backed by
    the class attributes `_run_id`, `_task_id`, `_node_id`)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    set_task_identity(run_id, task_id, node_id)
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved


def set_task_identity(run_id: int = 1, task_id: int = 1, node_id: int = 0) -> None:
    """Set Flower's task identity for the rest of this process (a benchmark's)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = run_id, task_id, node_id


def aggregate_arrayrecords(records: Sequence[Any], weighting_key: str) -> Any:
    """FedAvg's weighted average of the ArrayRecords of `records` (RecordDicts), weighted
    by each one's MetricRecord value `weighting_key`: what Flower's strategies aggregate
    with (`flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords`)."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords as aggregate

    return aggregate(list(records), weighting_key)


def __getattr__(name: str) -> Any:
    """`ClientAppCallable` and `Mod`, the types of a ClientApp's call chain and of a mod
    (flwr/clientapp/typing.py; `flwr.clientapp` does not export them), imported on use."""
    if name in ("ClientAppCallable", "Mod"):
        from flwr.clientapp import typing as clientapp_typing

        return getattr(clientapp_typing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
