"""The SuperNode: its entry point run in this process, its pull/run/push loop
(flwr/supernode/start_client_internal.py) and the heartbeats it announces."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import ModuleType

from .modules import SUPERNODE_LOOP, module


def run_supernode_cli(arguments: Sequence[str]) -> None:
    """Flower's own `flower-supernode ARGUMENTS` in this process: `flower_supernode()` of
    `flwr.supernode.cli` reads `sys.argv` (argparse) and runs until the node stops."""
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *arguments]
    flower_supernode()


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


def set_supernode_clock(clock: object, loop: ModuleType | None = None) -> None:
    """Make the SuperNode loop's module global `time` (Flower 1.42 imports the module and
    calls `time.sleep(...)` through it) `clock`: fedlb shortens its fixed pauses."""
    setattr(loop or module(SUPERNODE_LOOP), "time", clock)  # noqa: B010 (a module)


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
