"""`fedlb certs` and `fedlb silo-key`: TLS certificates for a federation, and the key
pairs silos authenticate with."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedlb.flower import TlsError, make_certificates, make_silo_key

from .common import UsageError, app, console


@app.command()
def certs(
    out: Annotated[Path, typer.Option(help="Folder for the certificate files.")],
    host: Annotated[
        list[str] | None,
        typer.Option(help="The SuperLink's host name or address (repeatable)."),
    ] = None,
    days: Annotated[int, typer.Option(help="Validity in days.")] = 365,
    overwrite: Annotated[bool, typer.Option(help="Replace existing files.")] = False,
) -> None:
    """Make a federation CA and a SuperLink certificate: give the server the folder
    (fedlb server --certs DIR) and every silo ca.crt (fedlb silo --root-certificates)."""
    try:
        files = make_certificates(out, host or ["127.0.0.1", "localhost"], days, overwrite)
    except TlsError as error:
        raise UsageError(str(error)) from error
    console.print(
        f"TLS files in {out}: {files.ca.name} (every silo and the server), "
        f"{files.cert.name} and {files.key.name} (the server only), ca.key (keep it safe: "
        "it signs servers the silos will trust)"
    )


@app.command("silo-key")
def silo_key(
    out: Annotated[Path, typer.Option(help="Folder for NAME.key and NAME.pub.")],
    name: Annotated[str, typer.Option(help="The silo's name.")],
    overwrite: Annotated[bool, typer.Option(help="Replace existing files.")] = False,
) -> None:
    """Make a silo's authentication key pair: NAME.key stays at the silo (fedlb silo
    --auth-key), NAME.pub goes into the server's --silo-keys folder."""
    try:
        private, public = make_silo_key(out, name, overwrite)
    except TlsError as error:
        raise UsageError(str(error)) from error
    console.print(f"{private} (the silo's, keep it there) and {public} (give it to the server)")
