"""The runtime API, driven as Flower's SuperExec drives it (fedlb.deploy.warm): the client,
the tasks it acquires, a task finished as FAILED."""

from __future__ import annotations

from typing import Any

from .modules import CLIENTAPP_RUNTIME, module

ACQUIRE_TASK = "/flwr.proto.Runtime/AcquireTask"
"""The RPC method name `SuperExecAuthHttpInterceptor` signs for AcquireTask: only a caller
holding the SuperExec secret (`--superexec-auth-secret-file`) is handed tasks."""

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
