"""Shared helpers of the silo-joining tests (tests/test_flower_join_*.py): Flower's own
SuperNode log lines (started, connected, retrying, and the refusals it gives up on) and a
silo folder whose log holds them."""

from __future__ import annotations

from fedlb.deploy.join import SUPERNODE_START

# Flower 1.41's own lines (colour codes included), as flower-supernode logs them.
STARTED = (
    "\x1b[92mINFO \x1b[0m:      Starting Flower SuperNode\n"
    "INFO:     Uvicorn running on http://127.0.0.1:41611 (Press CTRL+C to quit)\n"
)


CONNECTED = STARTED + "\x1b[92mINFO \x1b[0m:      SuperNode ID: 6868470573225693217\n"


RETRYING = STARTED + "\x1b[93mWARNING \x1b[0m:   Connection attempt failed, retrying in 0.37 s\n"


def gave_up(reason: str) -> str:
    return STARTED + (
        "\x1b[91mERROR \x1b[0m:     Exit Code: 305\n"
        "Failed to initialize the connection to the SuperLink.\n"
        f"{reason}\n"
        "The SuperNode could not establish a connection to the SuperLink.\n\n"
        "For more information, visit: <https://flower.ai/docs/framework/1.41/en/"
        "ref-exit-codes/305.html>\n"
        "INFO:     Shutting down\n"
    )


WRONG_CA = gave_up(
    "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: certificate signature "
    "failure (_ssl.c:1006)"
)


UNREGISTERED = gave_up("[code: 2004] Failed to activate SuperNode.")


NO_KEY = gave_up(
    "[code: 2001] SuperNode authentication is enabled. All SuperNodes must be registered "
    "via the CLI."
)


NOT_TLS = gave_up("[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)")


def started(log: str) -> str:
    return f"{SUPERNODE_START} silo-0 for 127.0.0.1:1 at 2026-01-01 00:00:00\n{log}"
