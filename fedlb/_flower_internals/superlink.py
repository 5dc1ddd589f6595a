"""The SuperLink: its entry point run in this process, the paths its one port serves, its
node id, and its state answering for a destination node that is gone."""

from __future__ import annotations

import copy
import functools
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from .modules import SUPERLINK_ENTRY


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


def superexec_runtime_at(address: str) -> None:
    """Make the SuperExec the SuperLink starts itself (cold ServerApps, isolation
    subprocess) reach the Runtime API at `address`, plain HTTP (no certificates).

    Flower 1.42's `flower_superlink._get_superexec_command(runtime_address=...,
    runtime_certificates=..., runtime_root_certificates_path=..., ...)` builds that
    command from the SuperLink's own --host:--port (0.0.0.0 read as 127.0.0.1); its
    ServerApps take the SuperExec's address and TLS settings. Another Flower without the
    function: nothing changes (its SuperExec as it starts it)."""
    import inspect

    entry = importlib.import_module(SUPERLINK_ENTRY)
    original = getattr(entry, "_get_superexec_command", None)
    if original is None or getattr(original, "runtime_at", None) == address:
        return
    original = getattr(original, "__wrapped__", original)
    signature = inspect.signature(original)

    @functools.wraps(original)
    def command(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments.update(
            runtime_address=address,
            runtime_certificates=None,  # plain: a loopback door has no wire to protect
            runtime_root_certificates_path=None,
        )
        return original(*bound.args, **bound.kwargs)

    command.runtime_at = address  # type: ignore[attr-defined]
    setattr(entry, "_get_superexec_command", command)  # noqa: B010 (a module's global)


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


def superlink_node_id() -> int:
    """The SuperLink's node id: the source of every message a SuperNode receives and the
    destination of every reply it pushes (`flwr.common.constant.SUPERLINK_NODE_ID`, 1)."""
    from flwr.common.constant import SUPERLINK_NODE_ID

    return int(SUPERLINK_NODE_ID)


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
