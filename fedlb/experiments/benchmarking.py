"""What the scripts in benchmarks/ share: Markdown tables, and one way to run sections,
print them, and keep their figures as JSON."""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable, Sequence
from typing import Any

# A section gets --quick and the figures so far, and returns (Markdown, its figures).
Section = Callable[[bool, dict[str, Any]], tuple[str, dict[str, Any]]]


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def run_benchmark(
    title: str, description: str, setting: str, sections: Sequence[tuple[str, Section]]
) -> dict[str, Any]:
    """Parse --quick, --json and --only, print `title` with the machine and `setting` (versions,
    the clock), then every section as it completes; returns all figures."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument(
        "--only", help="run only the sections whose heading contains this (any case)"
    )
    args = parser.parse_args()
    machine = platform.processor() or platform.machine()
    print(
        f"# {title}\n\nMachine: {machine}, Python {platform.python_version()}, {setting}\n",
        flush=True,
    )
    figures: dict[str, Any] = {}
    for heading, section in sections:
        if args.only and args.only.lower() not in heading.lower():
            continue
        text, data = section(args.quick, figures)
        figures.update(data)
        print(f"## {heading}\n\n{text}\n", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)
    return figures
