"""The `fedlb` command: `fedlb --help` lists its subcommands."""

from __future__ import annotations

from . import cluster, experiment, federation, he, tune  # noqa: F401 (the modules register their commands)
from .common import app


def main() -> None:
    app()


__all__ = ["app", "main"]
