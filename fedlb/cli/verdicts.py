"""`fedlb verdicts`: the stability guard's remembered verdicts, listed and forgotten."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table

from fedlb.flower.verdicts import forget, remembered, verdicts_file

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
    ($FEDLB_PROFILE_DIR; docs/flower.md, "The guard's verdict, remembered").
    """
    path = verdicts_file()
    if path is None:
        console.print("Profiles and verdicts are off here (FEDLB_PROFILE_DIR=off).")
        return
    if forget_keys and forget_all:
        raise UsageError("give --forget KEY or --forget-all, not both")
    try:
        if forget_keys or forget_all:
            dropped = forget(None if forget_all else forget_keys)
            console.print(
                f"Forgot {len(dropped)} verdict(s) in {path}: the next run of each app "
                "probes again."
            )
            return
        kept = remembered()
    except KeyError as error:
        raise UsageError(
            f"no verdict is kept under {error.args[0]} in {path}: `fedlb verdicts` lists the keys"
        ) from None
    except ValueError as error:
        raise UsageError(
            f"{path} is damaged ({error}): the server ignores it and probes every run; "
            "`fedlb verdicts --forget-all` writes it anew"
        ) from None
    if not kept:
        console.print(f"No verdicts kept in {path}.")
        return
    table = Table(title=f"The stability guard's verdicts ({path})")
    table.add_column("key", no_wrap=True)  # whole, to be copied into --forget
    for column in ("regime", "found", "evidence", "app"):
        table.add_column(column, overflow="fold")
    for key, found in sorted(kept.items(), key=lambda item: -(item[1].at if item[1] else 0)):
        if found is None:
            table.add_row(key, "damaged", "", "ignored: the next run probes", "")
            continue
        age = f"{found.age_s / 3600:.1f} h ago" + (" (too old: ignored)" if found.expired else "")
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(found.at))
        evidence = found.why + (f" ({found.silos} silos a round)" if found.silos else "")
        table.add_row(key, found.regime, f"{when}, {age}", evidence, found.app or "–")
    console.print(table)
