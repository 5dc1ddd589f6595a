"""The typer app every command registers on, and what commands share."""

from __future__ import annotations

import contextlib
import errno
import inspect
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

# Where the help's "the docs: PAGE" points: the documentation site, which a wheel install
# has no copy of; a clone builds and serves it (docs/ is its source).
DOCS = "fedlb's documentation site (from a clone: ./scripts/docs.sh serve)"

app = typer.Typer(
    name="fedlb",
    help="Load-balanced cross-silo federated learning: every silo finishes its round together.",
    epilog=f"Every command: fedlb COMMAND --help. Guides and reference: {DOCS}.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()


def summaries_on_one_line(typer_app: typer.Typer) -> None:
    """Each command's help as its docstring's paragraphs, each on one line, which the
    help then wraps to the terminal: `fedlb --help` shows the first as the summary.
    Typer keeps a docstring's own line breaks, so text wrapped at 90 columns in the
    source broke mid-sentence on every terminal ("gloo, or NCCL with a" / "GPU per
    rank")."""
    for command in typer_app.registered_commands:
        if command.callback is None or command.help is not None:
            continue
        paragraphs = [
            " ".join(p.split()) for p in (inspect.getdoc(command.callback) or "").split("\n\n")
        ]
        command.help = "\n\n".join(paragraphs)
        command.short_help = command.short_help or paragraphs[0]


def file_error(error: OSError) -> str:
    """An OSError as the operator's line: what, where, and what to do."""
    if not error.filename:  # not a file's (a socket's, a process's): say what it was
        return f"{error.strerror or error} ({type(error).__name__})"
    where = error.filename
    if error.errno == errno.ENOSPC:
        return f"the disk is full at {where}: free space there, or give another folder"
    if error.errno == errno.EROFS:
        return f"{where} is on a read-only filesystem: give a folder on a writable one"
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to write {where}: give a folder you can write to"
    return f"{where}: {error.strerror or error}: give a folder it can create and write to"


class UsageError(typer.BadParameter):
    """Bad input on the command line or in a config file: exit code 2 with the reason."""


@contextlib.contextmanager
def holding(folder: Path, what: str) -> Iterator[Path]:
    """The command's folder (`what`: its option) held while the block runs, resolved: a
    usage error when results cannot be written there or another fedlb run holds it."""
    from fedlb.deploy import ConfigError, check_out_dir
    from fedlb.security import FolderInUseError, claim_folder

    try:
        check_out_dir(folder, what)
        stack = contextlib.ExitStack()
        held = stack.enter_context(claim_folder(folder))
    except (ConfigError, FolderInUseError) as error:
        raise UsageError(str(error)) from None
    with stack:
        yield held


def _version(shown: bool) -> None:
    """--version: the installed package's version (its metadata), then exit."""
    if shown:
        from importlib.metadata import PackageNotFoundError, version

        try:
            console.print(f"fedlb {version('fedlb')}", highlight=False)
        except PackageNotFoundError:  # a source tree that was never installed
            console.print("fedlb (not installed: no version)", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log more.")] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            help="Print fedlb's version and exit.",
        ),
    ] = False,
) -> None:
    level = logging.INFO if verbose else logging.WARNING
    handler = RichHandler(console=Console(stderr=True), show_path=False)
    # Records of libraries' own loggers (flwr logs DEBUG) propagate to the root's handlers
    # whatever the root's level: the handler's level is what filters them.
    handler.setLevel(level)
    logging.basicConfig(level=level, format="%(message)s", handlers=[handler])
