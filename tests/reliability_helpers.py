"""Shared helpers of the reliability tests (tests/test_flower_reliability_*.py): the CLI
runner, what a command said, a round record."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from fedlb.flower import RoundRecord

runner = CliRunner()


def said(result) -> str:
    """The output as one line, without the usage box rich draws around errors."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


def record(number, silos=True, failed=()):
    from fedlb.flower.records import SiloRound

    silo = SiloRound("silo-0", 1, 16, 5, 1.0, 0.0, 1.0, 0.0, 0.5, 100, 0.0, 16)
    return RoundRecord(
        number,
        "measured",
        [silo] if silos else [],
        1.0,
        1.0,
        1.0,
        0.0,
        1.0,
        failed=list(failed),
    )
