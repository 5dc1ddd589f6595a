"""`fedlb verdicts`: the stability guard's remembered verdicts, listed and forgotten."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from fedlb._markup import plain
from fedlb.flower.verdicts import forget, listed, verdicts_file
from fedlb.security import StoredFileError

from .common import UsageError, app, console


@app.command()
def verdicts(
    forget_keys: Annotated[
        list[str] | None,
        typer.Option("--forget", help="Forget the verdict under this key (repeatable)."),
    ] = None,
    forget_all: Annotated[bool, typer.Option("--forget-all", help="Forget every one.")] = False,
) -> None:
    """The stability guard's verdicts this machine's server keeps, one per app: stable (the
    next run starts balanced from the silos' stored profiles) or edge (it runs the app's
    own batch sizes, with no probe), each with its evidence and age.

    A verdict you doubt (a false alarm keeps an app unbalanced for 30 days) is forgotten
    with --forget KEY: that app's next run probes again. The folder is the speed profiles'
    ($FEDLB_PROFILE_DIR; the docs: Explanation, The stability guard).

    A damaged entry is listed apart, one line each, and ignored by the server; a damaged
    file (or a FIFO, a device in its place) is said in one line (exit 2, as for every
    damaged file), and --forget-all sets it aside.
    """
    path = verdicts_file()
    if path is None:
        console.print("Profiles and verdicts are off here (FEDLB_PROFILE_DIR=off).")
        return
    if forget_keys and forget_all:
        raise UsageError("give --forget KEY or --forget-all, not both")
    shown = plain(path)
    try:
        if forget_keys or forget_all:
            done = forget(None if forget_all else forget_keys)
            if done.moved_to is not None:
                console.print(
                    f"{shown} was damaged ({plain(done.why)}): set aside as "
                    f"{plain(done.moved_to.name)}; the next run of each app probes again."
                )
            else:
                console.print(
                    f"Forgot {len(done.keys)} verdict(s) in {shown}: the next run of each app "
                    "probes again."
                )
            return
        kept, damaged = listed()
    except KeyError as error:
        raise UsageError(
            f"no verdict is kept under {error.args[0]} in {path}: `fedlb verdicts` lists the keys"
        ) from None
    except StoredFileError as error:
        # the server sets it aside at its next run and probes meanwhile
        console.print(
            f"[red]{shown} is damaged[/] ({plain(error.reason)}): no verdict is read from it; "
            "`fedlb verdicts --forget-all` sets it aside (the server does at its next run)"
        )
        raise typer.Exit(2) from None  # a damaged file: exit 2, as every command's
    except OSError as error:
        console.print(f"[red]could not read {shown}:[/] {plain(error.strerror or error)}")
        raise typer.Exit(1) from None
    if not kept and not damaged:
        console.print(f"No verdicts kept in {shown}.")
        return
    if kept:
        table = Table(title=f"The stability guard's verdicts ({shown})")
        table.add_column("key", no_wrap=True)  # whole, to be copied into --forget
        for column in ("regime", "found", "evidence", "app"):
            table.add_column(column, overflow="fold")
        for key, found in sorted(kept.items(), key=lambda item: -item[1].at):
            age = f"{found.age_s / 3600:.1f} h ago" + (
                " (too old: ignored)" if found.expired else ""
            )
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(found.at))
            evidence = found.why + (f" ({found.silos} silos a round)" if found.silos else "")
            # every cell is the file's text: shown as it is, never as markup
            table.add_row(
                plain(key), found.regime, f"{when}, {age}", plain(evidence), plain(found.app or "–")
            )
        console.print(table)
    for key, why in sorted(damaged.items()):
        console.print(
            f"[yellow]damaged verdict {plain(key)}[/] ({plain(why)}): ignored, the next run of "
            "its app probes"
        )
