"""`fedlb certs` and `fedlb silo-key`: TLS certificates for a federation, and the key
pairs silos authenticate with."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from fedlb._markup import plain
from fedlb.deploy import ConfigError, check_out_dir
from fedlb.security import TlsError, make_certificates, make_silo_key

from .common import UsageError, app, console

MAX_DAYS = 36500  # 100 years: far enough, and within the X.509 dates' range (year 9999)
SILO_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # a plain file name, no path


def writable_folder(out: Path) -> None:
    """Refuse an --out that is a file or cannot be written (before any key is made)."""
    try:
        check_out_dir(out, "--out")
    except ConfigError as error:
        raise UsageError(str(error)) from error


@app.command()
def certs(
    out: Annotated[Path, typer.Option(help="Folder for the certificate files.")],
    host: Annotated[
        list[str] | None,
        typer.Option(help="The SuperLink's host name or address (repeatable)."),
    ] = None,
    days: Annotated[int, typer.Option(help=f"Validity in days (1..{MAX_DAYS}).")] = 365,
    overwrite: Annotated[bool, typer.Option(help="Replace existing files.")] = False,
) -> None:
    """Make a federation CA and a SuperLink certificate: give the server the folder
    (fedlb server --certs DIR) and every silo ca.crt (fedlb silo --root-certificates)."""
    if not 1 <= days <= MAX_DAYS:
        raise UsageError(
            f"--days must be in 1..{MAX_DAYS} (the certificates' validity), got {days}"
        )
    hosts = host or ["127.0.0.1", "localhost"]
    for name in hosts:
        if not name or any(c.isspace() for c in name):
            raise UsageError(f"--host must be a host name or address without spaces, got {name!r}")
    if len(hosts[0]) > 64:  # the first host is the certificate's common name
        raise UsageError(
            f"--host {hosts[0]} is longer than 64 characters: give a shorter name first"
        )
    writable_folder(out)
    try:
        files = make_certificates(out, hosts, days, overwrite)
    except TlsError as error:
        raise UsageError(str(error)) from error
    except ValueError as error:  # cryptography's refusal of a name, e.g. a non-ASCII one
        raise UsageError(f"--host {', '.join(hosts)}: {error}") from error
    console.print(
        f"TLS files in {plain(out)}: {plain(files.ca.name)} (every silo and the server), "
        f"{plain(files.cert.name)} and {plain(files.key.name)} (the server only), ca.key (keep "
        "it safe: "
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
    if not SILO_NAME.fullmatch(name):
        raise UsageError(
            f"--name must be a plain file name (letters, digits, '.', '_', '-'; not starting "
            f"with '.'), got {name!r}"
        )
    writable_folder(out)
    try:
        private, public = make_silo_key(out, name, overwrite)
    except TlsError as error:
        raise UsageError(str(error)) from error
    console.print(
        f"{plain(private)} (the silo's, keep it there) and {plain(public)} (give it to the server)"
    )
