"""The Control API and the `flwr` CLI's helpers (fedlb.deploy.control): the client, the
requests `flwr run` / `ls` / `stop` / `log` / `supernode register` send, the FAB it builds."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

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
