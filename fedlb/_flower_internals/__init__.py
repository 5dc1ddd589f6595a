"""Every private detail of Flower that fedlb relies on, in one package.

fedlb runs on Flower 1.42 (pyproject: `flwr>=1.41,<1.43`). Besides Flower's public API
(`flwr.app`, `flwr.clientapp`, `flwr.serverapp`, `flwr.simulation`, the names `flwr.common`
exports), its deployment (fedlb.deploy), experiments, benchmarks and tests reach into parts
Flower does not promise to keep: the SuperLink's and SuperNode's entry modules, the
SuperNode's loop and node state, the ClientApp and ServerApp runtimes and their runtime
API, the Control API client and the `flwr` CLI's helpers, the lines Flower logs. Each such
detail is here, once: a constant or a small function whose docstring says what Flower 1.42
does that fedlb relies on, and where in flwr it lives. tests/test_flower_internals_*.py check
each by name, so a new Flower release fails one named test per broken assumption instead of
a timeout deep in a deployed run; `scripts/check-flower-nightly.sh` runs those tests and the
deployed ones against the newest `flwr-nightly` (docs/flower/flower-versions.md).

The details, by what of Flower they are about:
- `modules`: the flwr modules fedlb imports by name, and `module(name)`;
- `superlink`: the SuperLink's entry point, the paths it serves, its node id, its state
  answering for nodes that are gone;
- `supernode`: the SuperNode's entry point, its loop's pauses and steps, its heartbeats;
- `object_pulls`: how soon a missing object is pulled again;
- `nodestate`: the SuperNode's node state, its message stores, a failed ClientApp task's
  answer;
- `superexec`: the runtime API as Flower's SuperExec drives it;
- `app_runtime`: the ClientApp's, ServerApp's and simulation's task bodies, their logs,
  Flower's exit path;
- `control_api`: the Control API client and the `flwr` CLI's helpers;
- `log_lines`: the lines Flower logs that fedlb reads;
- `messages`: Messages and records outside a run.

Rules: this package imports nothing of fedlb but its own modules, and flwr only inside its
functions (importing it costs nothing); the rest of fedlb imports these names from here
(`fedlb._flower_internals`, this face, never a module inside it) instead of flwr's private
modules (tests/test_layers.py checks it). Where a Flower nightly already differs, the detail
says how and handles both (one place to look when the next release lands).
"""

from __future__ import annotations

from .app_runtime import (
    LOG_FLUSH_PAUSE_S,
    end_tasks_with,
    exit_handlers,
    flush_logs_without_pause,
    output_mirrored_to,
    run_clientapp,
    run_exit_handlers,
    server_side_runtime,
    watch_parent,
)
from .control_api import (
    ALREADY_REGISTERED,
    build_fab,
    cli_errors,
    control_client,
    list_runs_request,
    parse_config,
    register_node_request,
    run_statuses,
    start_run_request,
    stop_run_request,
    stream_logs_request,
)
from .log_lines import (
    CLIENTAPP_RAISED,
    EXIT_CODE,
    EXIT_GENERIC_LINES,
    EXIT_MORE_INFORMATION,
    NODE_ACTIVATION_FAILED,
    REGISTRATION_DISABLED,
    SUPERNODE_CONNECTED,
)
from .messages import (
    aggregate_arrayrecords,
    set_task_identity,
    task_identity,
)
from .modules import (
    CLIENTAPP_RUNTIME,
    SERVERAPP_GRID,
    SERVERAPP_RUNTIME,
    SIMULATION_RUNTIME,
    SUPERLINK_CLI,
    SUPERLINK_ENTRY,
    SUPERNODE_CLI,
    SUPERNODE_LOOP,
    module,
)
from .nodestate import (
    OneRunState,
    answer_expired_clientapp_tasks,
    answer_with_error,
    drop_messages,
    is_failed,
    node_state_class,
    unfinished_clientapp_task,
    waiting_replies,
)
from .object_pulls import (
    clientapp_object_pulls,
    first_retry_after,
    serverapp_reply_pulls,
    supernode_object_pulls,
)
from .superexec import (
    ACQUIRE_TASK,
    TASK_TYPES,
    acquire_task,
    push_task_failed,
    runtime_api_gaps,
    superexec_client,
)
from .superlink import (
    FLEET_PATH,
    HEALTH_PATH,
    RUNTIME_PATH,
    UVICORN_RUN_OPTIONS,
    answer_messages_to_offline_nodes,
    linkstate_class,
    run_superlink_cli,
    superexec_runtime_at,
    superlink_node_id,
)
from .supernode import (
    SUPERNODE_IDLE_SLEEP_S,
    SUPERNODE_PULL_STEP,
    SUPERNODE_PUSH_STEP,
    SUPERNODE_WAIT_SLEEP_S,
    heartbeat_limits_s,
    heartbeat_patience,
    run_supernode_cli,
    set_node_heartbeat_interval,
    set_supernode_clock,
)

__all__ = [
    "ACQUIRE_TASK",
    "ALREADY_REGISTERED",
    "CLIENTAPP_RAISED",
    "CLIENTAPP_RUNTIME",
    "EXIT_CODE",
    "EXIT_GENERIC_LINES",
    "EXIT_MORE_INFORMATION",
    "FLEET_PATH",
    "HEALTH_PATH",
    "LOG_FLUSH_PAUSE_S",
    "NODE_ACTIVATION_FAILED",
    "REGISTRATION_DISABLED",
    "RUNTIME_PATH",
    "SERVERAPP_GRID",
    "SERVERAPP_RUNTIME",
    "SIMULATION_RUNTIME",
    "SUPERLINK_CLI",
    "SUPERLINK_ENTRY",
    "SUPERNODE_CLI",
    "SUPERNODE_CONNECTED",
    "SUPERNODE_IDLE_SLEEP_S",
    "SUPERNODE_LOOP",
    "SUPERNODE_PULL_STEP",
    "SUPERNODE_PUSH_STEP",
    "SUPERNODE_WAIT_SLEEP_S",
    "TASK_TYPES",
    "UVICORN_RUN_OPTIONS",
    "OneRunState",
    "acquire_task",
    "aggregate_arrayrecords",
    "answer_expired_clientapp_tasks",
    "answer_messages_to_offline_nodes",
    "answer_with_error",
    "build_fab",
    "cli_errors",
    "clientapp_object_pulls",
    "control_client",
    "drop_messages",
    "end_tasks_with",
    "exit_handlers",
    "first_retry_after",
    "flush_logs_without_pause",
    "heartbeat_limits_s",
    "heartbeat_patience",
    "is_failed",
    "linkstate_class",
    "list_runs_request",
    "module",
    "node_state_class",
    "output_mirrored_to",
    "parse_config",
    "push_task_failed",
    "register_node_request",
    "run_clientapp",
    "run_exit_handlers",
    "run_statuses",
    "run_superlink_cli",
    "run_supernode_cli",
    "runtime_api_gaps",
    "server_side_runtime",
    "serverapp_reply_pulls",
    "set_node_heartbeat_interval",
    "set_supernode_clock",
    "set_task_identity",
    "start_run_request",
    "stop_run_request",
    "stream_logs_request",
    "superexec_client",
    "superexec_runtime_at",
    "superlink_node_id",
    "supernode_object_pulls",
    "task_identity",
    "unfinished_clientapp_task",
    "waiting_replies",
    "watch_parent",
]
