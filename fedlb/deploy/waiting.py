"""The ServerApp `fedlb server --app` runs before a user's app (fedlb/deploy/wait_app): it
waits until the federation's silos have joined, as fedlb's own ServerApp does before
round 1, then ends; the user's app is submitted after it. A user's strategy waits only
for its own `min_available_nodes` (Flower's default: 2), so without this a run of three
silos could start its round 1 with the first two that joined.

Its run config: `num-silos` (how many to wait for) and `join-timeout` (seconds; the run
fails with the reason after them). It sends the silos nothing.
"""

from __future__ import annotations

import time

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

SAY_EVERY_S = 10.0

app = ServerApp()
client = ClientApp()  # the app's clientapp component: never sent a message


@app.main()
def main(grid: Grid, context: Context) -> None:
    count = int(context.run_config["num-silos"])
    timeout = float(context.run_config["join-timeout"])
    wait_for_silos(grid, count, timeout)


def wait_for_silos(grid: Grid, count: int, timeout: float, poll_s: float = 0.2) -> int:
    """Return once the SuperLink lists `count` silos (how many it lists then); a
    RuntimeError, saying how many joined and what to do, after `timeout` seconds."""
    started = time.monotonic()
    told = started
    while len(nodes := list(grid.get_node_ids())) < count:
        waited = time.monotonic() - started
        if waited > timeout:
            raise RuntimeError(
                f"only {len(nodes)} of {count} silos joined within {timeout:.0f} s; start "
                "the missing silos (fedlb silo --app ...), or give --num-silos the number "
                "that will join"
            )
        if time.monotonic() - told >= SAY_EVERY_S:
            print(f"fedlb: waiting for silos: {len(nodes)} of {count} joined", flush=True)
            told = time.monotonic()
        time.sleep(poll_s)
    print(f"fedlb: {len(nodes)} of {count} silos joined", flush=True)
    return len(nodes)
