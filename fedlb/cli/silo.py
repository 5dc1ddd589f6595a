"""`fedlb silo`: one silo's SuperNode, joined to a `fedlb server`."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from fedlb.flower import DeployError, free_port, start_supernode

from .common import UsageError, app, console
from .federation import BASE_SPEED, check_context_file, read_config

SILO_KEYS = {
    "server": str,
    "data-path": str,
    "partition-id": int,
    "num-partitions": int,
    "emulated-speed": float,
    "slowdown": float,
    "base-speed": float,
    "threads": int,
    "port": int,
    "workdir": str,
    "he-context": str,
    "root-certificates": str,
    "auth-key": str,
}


@app.command()
def silo(
    config: Annotated[
        Path | None, typer.Option("--config", help="TOML file ([silo] table).")
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
    threads: Annotated[int | None, typer.Option(help="torch threads (0: torch's default).")] = None,
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
) -> None:
    """Start this silo's SuperNode against the server and keep it up until Ctrl-C."""
    values = read_config(config, {"silo": SILO_KEYS})["silo"]
    flags = {
        "server": server,
        "data-path": None if data_path is None else str(data_path.resolve()),
        "partition-id": partition_id,
        "num-partitions": num_partitions,
        "slowdown": slowdown,
        "emulated-speed": emulated_speed,
        "base-speed": base_speed,
        "threads": threads,
        "port": port,
        "workdir": workdir,
        "he-context": None if he_context is None else str(he_context),
        "root-certificates": None if root_certificates is None else str(root_certificates),
        "auth-key": None if auth_key is None else str(auth_key),
    }
    values.update({k: v for k, v in flags.items() if v is not None})
    if "data-path" in values:
        path = Path(values["data-path"])
        if not path.is_file():
            raise UsageError(f"--data-path {path} is not a file")
    elif "partition-id" not in values or "num-partitions" not in values:
        raise UsageError(
            "a silo needs --partition-id and --num-partitions, or --data-path (or a --config)"
        )
    if (
        "num-partitions" in values
        and not 0 <= values.get("partition-id", 0) < values["num-partitions"]
    ):
        raise UsageError(
            f"partition-id {values.get('partition-id')} is outside "
            f"0..{values['num-partitions'] - 1}"
        )
    speed = float(values.get("emulated-speed", 0.0))
    if speed == 0.0 and "slowdown" in values:
        if values["slowdown"] < 1:
            raise UsageError(f"--slowdown must be >= 1, got {values['slowdown']}")
        speed = float(values.get("base-speed", BASE_SPEED)) / values["slowdown"]
    if speed < 0:
        raise UsageError(f"--emulated-speed must be >= 0, got {speed}")
    node_config: dict[str, Any] = {
        "emulated-speed": speed,
        "threads": int(values.get("threads", 0)),
    }
    for key in ("partition-id", "num-partitions"):
        if key in values:
            node_config[key] = values[key]
    if "data-path" in values:
        node_config["data-path"] = str(Path(values["data-path"]).resolve())
    if values.get("he-context"):
        path = Path(values["he-context"]).resolve()
        print_ = check_context_file(path, "silo")  # before anything starts
        node_config["he-context"] = str(path)
        console.print(f"HE on: key fingerprint {print_} ({path})")
    name = f"silo-{values.get('partition-id', Path(values.get('data-path', 'x')).stem)}"
    work = Path(values.get("workdir") or Path("runs") / name).resolve()
    address = values.get("server", "127.0.0.1:8000")
    ca = Path(values["root-certificates"]).resolve() if values.get("root-certificates") else None
    if ca is not None and not ca.is_file():
        raise UsageError(f"--root-certificates {ca} is not a file: fedlb certs makes ca.crt")
    private_key = Path(values["auth-key"]).resolve() if values.get("auth-key") else None
    if private_key is not None and not private_key.is_file():
        raise UsageError(f"--auth-key {private_key} is not a file: fedlb silo-key makes it")
    try:
        node = start_supernode(
            work,
            name,
            address,
            node_config,
            values.get("port") or free_port(),
            root_certificates=ca,
            extra_args=["--auth-supernode-private-key", str(private_key)] if private_key else None,
        )
    except DeployError as error:
        console.print(f"[red]could not start the silo:[/] {escape(str(error))}")
        raise typer.Exit(1) from error
    clock = (
        f"emulated {speed:.0f} samples/s (clock: measured, sleep-padded)" if speed else "real speed"
    )
    console.print(
        f"[bold]{name}[/] joined {address} (pid {node.pid}, {clock}); log {node.log_path}"
    )
    stop = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    try:
        while not stop and node.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        node.stop()
    console.print(f"{name} stopped")
