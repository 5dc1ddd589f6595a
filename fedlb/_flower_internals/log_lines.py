"""Lines Flower logs that fedlb reads (fedlb.deploy.join)."""

from __future__ import annotations

import re

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
