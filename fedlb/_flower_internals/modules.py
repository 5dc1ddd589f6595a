"""The flwr modules fedlb imports by name (before a fork, or to patch one of their globals),
and `module(name)`, which imports one."""

from __future__ import annotations

import importlib
from types import ModuleType

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
