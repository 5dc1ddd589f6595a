"""The `fedlb` command: `fedlb --help` lists its subcommands."""

from __future__ import annotations

# Importing a module registers its commands; `fedlb --help` lists them in this order.
from . import cluster, experiment, federation, silo, security, he, tune  # noqa: F401 # isort: skip
from .common import app


def main() -> None:
    app()


__all__ = ["app", "main"]
