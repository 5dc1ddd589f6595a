"""`fedlb silo`: one silo's SuperNode, joined to a `fedlb server`."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from fedlb._markup import plain
from fedlb.deploy import (
    ClientAppFailures,
    ConfigError,
    DeployError,
    FlowerProcess,
    JoinError,
    SiloSettings,
    silo_settings,
    start_silo,
    supernode_join,
)
from fedlb.training import STEP_CURVES

from .common import UsageError, app, console, holding
from .federation import given

QUICK_EXIT_S = 30.0  # a SuperNode that leaves this soon after joining, again and again,
REJOINS_IN_A_ROW = 5  # this many times: something else is wrong, the silo gives up


def _join(
    settings: SiloSettings,
    name: str,
    address: str,
    connect_timeout: float,
    waiting: Callable[[str], None],
) -> FlowerProcess | None:
    """Start the silo's SuperNode and wait until it joined (None: stopped meanwhile)."""
    try:
        node = start_silo(settings, connect_timeout or None, on_wait=waiting)
    except ConfigError as error:
        raise UsageError(str(error)) from error
    except JoinError as error:
        console.print(f"[red]{plain(name)} did not join {plain(address)}:[/] {plain(error)}")
        raise typer.Exit(1) from error
    except DeployError as error:
        console.print(f"[red]could not start the silo:[/] {plain(error)}")
        raise typer.Exit(1) from error
    except KeyboardInterrupt:
        console.print(f"{plain(name)} stopped before it joined")
        return None
    clock = settings.emulation
    node_id = supernode_join(node.log_path).node_id
    console.print(
        f"[bold]{plain(name)}[/] joined {plain(address)} as node {node_id} (pid {node.pid}, "
        f"{plain(clock)}); log {plain(node.log_path)}"
    )
    return node


def _rejoin_or_exit(node: FlowerProcess, name: str, address: str, quick_exits: int) -> None:
    """After a joined SuperNode exited by itself: say it and join again, or end (exit 1)."""
    code = node.process.returncode
    forgotten = "401 Unauthorized" in node.log_tail(40)  # a new SuperLink's answer
    if code != 0 and not forgotten:  # killed or crashed: say so and end
        console.print(
            f"[red]{plain(name)}: its SuperNode exited (code {code}); its log "
            f"({plain(node.log_path)}) ends with:[/]\n{plain(node.log_tail())}"
        )
        raise typer.Exit(1)
    # Flower's SuperNode leaves cleanly (code 0), or on a 401, when its server is gone
    # or no longer knows it (a server restarted on the same address): join again.
    if quick_exits >= REJOINS_IN_A_ROW:
        console.print(
            f"[red]{plain(name)}: its SuperNode left {plain(address)} {quick_exits} times in a "
            f"row within {QUICK_EXIT_S:.0f} s of joining (code {code}); giving up. Its log "
            f"({plain(node.log_path)}) ends with:[/]\n{plain(node.log_tail())}"
        )
        raise typer.Exit(1)
    console.print(
        f"{plain(name)}: its SuperNode left {plain(address)} (code {code}: the server restarted "
        "or no longer knows this silo); rejoining"
    )


@app.command()
def silo(
    config: Annotated[
        Path | None, typer.Option("--config", help=escape("TOML file ([silo] table)."))
    ] = None,
    server: Annotated[str | None, typer.Option(help="The server's address, host:port.")] = None,
    partition_id: Annotated[int | None, typer.Option(help="This silo's partition.")] = None,
    data_path: Annotated[
        Path | None,
        typer.Option(help="This silo's own data (.npz with x and y) instead of a partition."),
    ] = None,
    num_partitions: Annotated[int | None, typer.Option(help="Partitions in all.")] = None,
    slowdown: Annotated[
        float | None, typer.Option(help="Emulate a machine this many times slower (>= 1).")
    ] = None,
    emulated_speed: Annotated[
        float | None, typer.Option(help="Emulate this many samples/s (overrides slowdown).")
    ] = None,
    base_speed: Annotated[float | None, typer.Option(help="Samples/s of slowdown 1.")] = None,
    emulated_curve: Annotated[
        str | None,
        typer.Option(
            help="Emulate a measured step-time curve instead (NAME*K: its times x K), one of "
            + ", ".join(STEP_CURVES)
            + "; the run must train its model."
        ),
    ] = None,
    threads: Annotated[int | None, typer.Option(help="torch threads (0: torch's default).")] = None,
    device: Annotated[
        str | None,
        typer.Option(help="Where it trains: auto (its GPU if any), cpu, cuda, cuda:N."),
    ] = None,
    port: Annotated[int | None, typer.Option(help="Local port of this SuperNode's API.")] = None,
    workdir: Annotated[Path | None, typer.Option(help="Logs and Flower home.")] = None,
    he_context: Annotated[
        Path | None,
        typer.Option(help="The silos' secret CKKS context (fedlb keygen's silo.context)."),
    ] = None,
    root_certificates: Annotated[
        Path | None,
        typer.Option(help="TLS: the federation's CA certificate (fedlb certs' ca.crt)."),
    ] = None,
    auth_key: Annotated[
        Path | None,
        typer.Option(help="This silo's private key (fedlb silo-key) when the server checks."),
    ] = None,
    warm: Annotated[
        bool | None,
        typer.Option(
            "--warm/--cold",
            help="Start ClientApps warm: torch and fedlb imported once, a fork per message "
            "(--cold: Flower's own fresh process per message). Default warm.",
        ),
    ] = None,
    resident: Annotated[
        bool | None,
        typer.Option(
            "--resident/--no-resident",
            help="Run the warm ClientApps one after another in one resident worker, which "
            "keeps its CUDA context and model between rounds (--no-resident: a fork per "
            "message, each isolated from the last). Default: resident where it trains on "
            "a GPU.",
        ),
    ] = None,
    connect_timeout: Annotated[
        float,
        typer.Option(
            help="Give up (exit 1) when not connected to the server after this many seconds "
            "(0: wait for ever)."
        ),
    ] = 60.0,
    emulated_clock: Annotated[
        str | None,
        typer.Option(
            help="The clock its emulation runs on: measured (steps padded with sleep) or "
            "model (no sleeping: it reports the emulated seconds; tests). Default measured."
        ),
    ] = None,
    user_app: Annotated[
        Path | None,
        typer.Option(
            "--app",
            help="The folder of the Flower app the server runs (fedlb server --app): its "
            "ClientApp module is imported once by the warm silo, so each message forks it "
            "ready (the ClientApp that runs is the one the server submits).",
        ),
    ] = None,
) -> None:
    """Start this silo's SuperNode against the server and keep it up until Ctrl-C."""
    flags = given(
        {
            "server": server,
            "data-path": data_path.resolve() if data_path is not None else None,
            "partition-id": partition_id,
            "num-partitions": num_partitions,
            "slowdown": slowdown,
            "emulated-speed": emulated_speed,
            "base-speed": base_speed,
            "emulated-curve": emulated_curve,
            "threads": threads,
            "device": device,
            "port": port,
            "workdir": workdir,
            "he-context": he_context,
            "root-certificates": root_certificates,
            "auth-key": auth_key,
            "warm": warm,
            "resident": None if resident is None else ("on" if resident else "off"),
            "emulated-clock": emulated_clock,
            "app": user_app.absolute() if user_app is not None else None,  # UserApp.read: a loop
        }
    )
    if not connect_timeout >= 0:  # NaN too
        raise UsageError(f"connect-timeout must be >= 0 (0: wait for ever), got {connect_timeout}")
    try:  # its data file, read and checked now, not when its first message fails
        settings = silo_settings(config, flags)
    except ConfigError as error:
        raise UsageError(str(error)) from error
    with holding(settings.work_dir, "workdir"):  # one silo per work dir (its Flower home)
        _run_silo(settings, connect_timeout)


def _run_silo(settings: SiloSettings, connect_timeout: float) -> None:
    """`fedlb silo` with its work dir held: join, and join again, until it is stopped."""
    if settings.he_context:
        console.print(
            f"HE on: key fingerprint {settings.he_fingerprint()} ({plain(settings.he_context)})"
        )
    app = settings.user_app()
    if app is not None:
        try:
            digest = app.fab_digest()
        except ConfigError as error:
            raise UsageError(str(error)) from error
        console.print(
            f"app: {plain(app.folder)} (clientapp {plain(app.clientapp)}, FAB sha256 "
            f"{digest[:12]}: the server prints its own; "
            + ("imported once by the warm silo)" if settings.warm else "cold: Flower's own)")
        )
    name, address = settings.name, settings.server

    def request_stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop is enough
        raise KeyboardInterrupt  # SIGTERM stops as Ctrl-C does, joining or joined

    def waiting(message: str) -> None:
        console.print(f"{plain(name)}: {plain(message)}")

    replaced = signal.signal(signal.SIGTERM, request_stop)
    try:
        console.print(f"{plain(name)}: connecting to {plain(address)}")
        quick_exits = 0
        node: FlowerProcess | None = None
        try:
            while True:
                node = _join(settings, name, address, connect_timeout, waiting)
                if node is None:
                    return
                joined = time.monotonic()
                failures = ClientAppFailures(node.log_path)
                while node.alive():
                    time.sleep(0.5)
                    for failure in failures.new():
                        console.print(f"[red]{plain(name)}:[/] {plain(failure)}")
                node.stop()  # what it left behind
                quick_exits = quick_exits + 1 if time.monotonic() - joined < QUICK_EXIT_S else 0
                _rejoin_or_exit(node, name, address, quick_exits)
        except KeyboardInterrupt:  # asked to stop (Ctrl-C, SIGTERM): a clean end
            if node is not None:
                node.stop()
            console.print(f"{plain(name)} stopped")
    finally:
        signal.signal(signal.SIGTERM, replaced)
