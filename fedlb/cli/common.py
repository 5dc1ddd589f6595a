"""The typer app every command registers on, and what commands share."""

from __future__ import annotations

import logging
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

app = typer.Typer(
    name="fedlb",
    help="Load-balanced cross-silo federated learning: every silo finishes its round together.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()


class UsageError(typer.BadParameter):
    """Bad input on the command line or in a config file: exit code 2 with the reason."""


@app.callback()
def _root(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log more.")] = False,
) -> None:
    level = logging.INFO if verbose else logging.WARNING
    handler = RichHandler(console=Console(stderr=True), show_path=False)
    # Records of libraries' own loggers (flwr logs DEBUG) propagate to the root's handlers
    # whatever the root's level: the handler's level is what filters them.
    handler.setLevel(level)
    logging.basicConfig(level=level, format="%(message)s", handlers=[handler])
