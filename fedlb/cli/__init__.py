"""The `fedlb` command: `fedlb --help` lists its subcommands."""

from __future__ import annotations

# Importing a module registers its commands; `fedlb --help` lists them in this order.
from . import cluster, experiment, federation, demo, silo, verdicts, security, he, tune  # noqa: F401 # isort: skip
from fedlb._markup import plain

from .common import app, console, file_error, summaries_on_one_line

summaries_on_one_line(app)


def main() -> None:
    try:
        app()
    except OSError as error:  # a disk or folder problem no command caught: one line, its path
        console.print(f"[red]fedlb stopped:[/] {plain(file_error(error))}")
        raise SystemExit(1) from None


__all__ = ["app", "main"]
