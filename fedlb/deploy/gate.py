"""The SuperLink's two doors: the public port serves silos only, the Control API listens
on loopback.

Flower 1.42 serves its Fleet API (silos), Control API (submit, list and stop runs, list
nodes, register keys) and Runtime API (the ServerApp's) on one HTTP port. The Control
API has no authentication in Flower's open-source build (its account login, OIDC, is an
enterprise plugin), so anyone who reaches a federation's public port could list its runs
and nodes and stop the live run, TLS or not: a silo's CA certificate is all it took.

Here the SuperLink's app is served through two doors from one process:
- the public door (the server's --host/--port, TLS when the federation has it) passes
  the Fleet API and /health, and the Runtime API to loopback callers only (it is signed
  or token-bound too, but nothing needs it there: the SuperExec and the ServerApps,
  warm or cold, reach it at the control door, see `superexec_at_control_door`; a
  caller on one of this machine's other addresses is as far away as any other);
  anything else gets 403 with a line saying where the Control API is;
- the control door (127.0.0.1 on a port of its own, plain HTTP: loopback has no wire to
  protect) serves everything, for fedlb's own Control client and the `flwr` CLI on the
  server's machine. Reaching it from elsewhere is an SSH tunnel (`ssh -L`), i.e. the
  authentication the operator already set up for the machine.

`python -m fedlb.deploy.gate --control-port N -- flower-superlink ARGS` runs Flower's own
`flower-superlink ARGS` this way (what `processes.start_superlink` starts; the warm
launcher forks the same call, see `gated_entry`). Flower behaviour relied on
(fedlb._flower_internals, checked by tests/test_flower_internals_*.py; the deployed tests
exercise it on real processes): `flwr.superlink.cli.flower_superlink` serves its FastAPI
app with its module's `uvicorn.run(app=..., host=..., port=..., ...)`, and the URL
prefixes of its APIs.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from fedlb import _flower_internals as flower

MODULE = "fedlb.deploy.gate"
CONTROL_HOST = "127.0.0.1"
FLEET_PATH, HEALTH_PATH = flower.FLEET_PATH, flower.HEALTH_PATH  # silos, health checks
RUNTIME_PATH = flower.RUNTIME_PATH  # the ServerApp's API: callers on this machine only

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def gated_command(control_port: int, superlink: Sequence[str]) -> list[str]:
    """The command that runs `superlink` (flower-superlink and its arguments) with its
    Control API on 127.0.0.1:`control_port` only."""
    return [sys.executable, "-m", MODULE, "--control-port", str(control_port), "--", *superlink]


def parse_gated(command: Sequence[str]) -> tuple[int, list[str]] | None:
    """(control port, the flower-superlink command) of a `gated_command`; None for any
    other command."""
    if list(command[1:3]) != ["-m", MODULE] or "--" not in command:
        return None
    split = list(command).index("--")
    args = _parser().parse_args(list(command[3:split]))
    return args.control_port, list(command[split + 1 :])


def loopback(host: str) -> bool:
    """Whether `host` (a peer's IP address) is a loopback address (an IPv4 one mapped
    into IPv6 too)."""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class PublicDoor:
    """An ASGI app: `app` as the silos' port shows it (see the module's docstring)."""

    def __init__(self, app: App, control_port: int) -> None:
        self.app = app
        self.refusal = json.dumps(
            {
                "detail": (
                    "not served on this port: the SuperLink's Control API listens on "
                    f"{CONTROL_HOST}:{control_port} of the server's machine only (fedlb); "
                    "call it there, or through an SSH tunnel to that port"
                )
            }
        ).encode()

    def admits(self, scope: Scope) -> bool:
        path = str(scope.get("path", ""))
        if path.startswith(FLEET_PATH) or path == HEALTH_PATH:
            return True
        if path.startswith(RUNTIME_PATH):
            client = scope.get("client") or ("",)
            return loopback(str(client[0]))
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.admits(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await send(
                {
                    "type": "http.response.start",
                    "status": 403,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(self.refusal)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": self.refusal})


class TwoDoors:
    """The `uvicorn` module as Flower's SuperLink entry point sees it: `run` serves the
    app through the public door at (host, port) and the control door at 127.0.0.1:
    `control_port`, in one event loop; everything else is uvicorn's."""

    def __init__(self, control_port: int) -> None:
        self.control_port = control_port

    def __getattr__(self, name: str) -> Any:
        import uvicorn

        return getattr(uvicorn, name)

    def run(self, app: App, host: str, port: int, **options: Any) -> None:
        import uvicorn

        options.pop("reload", None)
        options.pop("workers", None)  # one process: both doors share the SuperLink's state
        ssl = {key: options.pop(key, None) for key in ("ssl_keyfile", "ssl_certfile")}
        public = uvicorn.Server(
            uvicorn.Config(
                PublicDoor(app, self.control_port), host=host, port=port, **ssl, **options
            )
        )
        # the app's lifespan (the SuperExec, Flower's gRPC servers) is the public door's
        control = uvicorn.Server(
            uvicorn.Config(
                app, host=CONTROL_HOST, port=self.control_port, lifespan="off", **options
            )
        )

        async def serve() -> None:
            # Each server catches SIGINT/SIGTERM and passes it on when it has stopped
            # (uvicorn's capture_signals), so one signal stops both, control first.
            doors = asyncio.create_task(control.serve())
            try:
                await public.serve()
            finally:
                control.should_exit = True
                await doors

        asyncio.run(serve())


def run_superlink(control_port: int, superlink: Sequence[str]) -> int:
    """Flower's own `flower-superlink` entry point in this process, with the Control API
    behind the control door; a message to a silo whose heartbeats stopped answered with
    Flower's NODE_UNAVAILABLE error (`_flower_internals.answer_messages_to_offline_nodes`:
    what Flower 1.42's SuperLink does itself, and flwr-nightly's no longer did)."""
    flower.answer_messages_to_offline_nodes()
    superexec_at_control_door(control_port)
    flower.run_superlink_cli(superlink[1:], uvicorn=TwoDoors(control_port))
    return 0


def superexec_at_control_door(control_port: int) -> None:
    """Make the SuperExec that Flower's SuperLink starts itself (cold ServerApps:
    isolation subprocess) reach the Runtime API at the control door, 127.0.0.1:
    `control_port`, plain HTTP, as fedlb's warm launcher does: from a server on a public
    address, Flower points it at the SuperLink's own --host:--port, which the public
    door refuses the Runtime API (`_flower_internals.superexec_runtime_at`)."""
    flower.superexec_runtime_at(f"{CONTROL_HOST}:{control_port}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--control-port", type=int, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    parsed = parse_gated([sys.executable, "-m", MODULE, *arguments])
    if parsed is None:
        _parser().error("give the SuperLink's command after --")
    control_port, superlink = parsed
    return run_superlink(control_port, superlink)


if __name__ == "__main__":
    sys.exit(main())
