"""No text from a silo or a file is ever rich markup (issue 51, item 2): a silo label, a
curve name, a failure, a run's folder or an error's text holding `[/x]` or `[bold]` prints
as it is, on the server's round table and on every command's console."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from rich.console import Console

from fedlb._markup import plain
from fedlb.cli import common
from fedlb.deploy import RunOutcome
from fedlb.flower import Keeping, RoundRecord, compare_runs
from fedlb.flower.records import SiloRound

MARKUP = "[/x] [bold]loud[/bold] [red]"


def printed(*renderables: object) -> str:
    """What a wide console shows for `renderables` (rich's MarkupError is raised here)."""
    console = Console(record=True, width=400)
    for renderable in renderables:
        console.print(renderable)
    return console.export_text()


def record(silo: str = "silo-0", clock: str = "measured", **lists: list[str]) -> RoundRecord:
    silos = [SiloRound(silo, 1, 16, 5, 1.0, 0.0, 1.0, 0.0, 0.5, 100, 0.0, 16)]
    return RoundRecord(2, clock, silos, 1.0, 1.0, 1.0, 0.0, 1.0, **lists)


def test_plain_text_prints_as_it_is():
    assert printed(plain(MARKUP)).strip() == MARKUP
    trailing = "ends with a backslash \\"
    assert printed(f"[red]{plain(trailing)}[/]").strip() == trailing
    assert plain(Path("/runs/[b]")) == "/runs/\\[b]"


def test_a_round_record_shows_silo_strings_literally():
    """A silo's label, the curve it emulated (in the clock), why it sent nothing, why its
    report was dropped and the events: each held `[/x]`, which crashed the ServerApp
    (exit 201) and `fedlb server` with MarkupError in round 2."""
    shown = printed(
        record(
            silo=f"silo-{MARKUP}",
            clock=f"model (curves: silo-0 h200{MARKUP}/cnn)",
            failed=[f"node-{MARKUP}: ClientApp raised {MARKUP}"],
            rejected=[f"silo-0: a curve named {MARKUP}"],
            events=[f"silo-0 left: {MARKUP}"],
        )
    )
    assert f"silo-{MARKUP}" in shown  # the silo's cell
    assert f"h200{MARKUP}/cnn" in shown  # the title
    assert f"no update: node-{MARKUP}: ClientApp raised {MARKUP}" in shown
    assert f"report dropped: silo-0: a curve named {MARKUP}" in shown
    assert f"silo-0 left: {MARKUP}" in shown
    assert f"node-{MARKUP}" in shown.split("no update")[0]  # the failed silo's row


def test_runs_compared_by_names_with_brackets():
    assert f"run {MARKUP}" in printed(compare_runs({f"run {MARKUP}": [record()]}))


def test_a_failed_runs_problem_and_paths_print_literally(monkeypatch):
    from fedlb.cli.federation import finish

    outcome = RunOutcome(
        "7",
        f"finished:failed {MARKUP}",
        [record()],
        out_dir=Path(f"/runs/{MARKUP}"),
        log_path=Path(f"/runs/{MARKUP}/serverapp.log"),
    )
    with common.console.capture() as captured, pytest.raises(typer.Exit):
        finish(outcome)
    text = " ".join(captured.get().split())
    assert f"it ended as finished:failed {MARKUP}" in text
    assert f"/runs/{MARKUP}/serverapp.log" in text


def test_fedlb_stopped_by_a_folder_with_brackets_says_it_literally(monkeypatch):
    import fedlb.cli as cli

    def fails() -> None:
        raise PermissionError(13, "Permission denied", f"/runs/{MARKUP}")

    monkeypatch.setattr(cli, "app", fails)
    with common.console.capture() as captured, pytest.raises(SystemExit):
        cli.main()
    assert f"no permission to write /runs/{MARKUP}" in captured.get()


@pytest.mark.usefixtures("task_identity")
def test_a_silo_replying_a_curve_name_of_markup_does_not_stop_the_server(tmp_path):
    """The probe's case through the strategy: a silo whose replies name a step-time curve
    `[/x]...` from round 1 on; the server's round tables (a real console) show it as it
    is, round after round, and the run completes."""
    import io

    from fedlb.flower import Balancing, LoadBalancedFedAvg, RoundReporter
    from fedlb.flower.protocol import EMULATED_CURVE
    from tests.strategy_helpers import is_train_from, make_grid, start, with_metrics

    grid = make_grid()
    curve = list(f"{MARKUP}h200/cnn".encode())
    grid.intercept = lambda r: (
        with_metrics(r, **{EMULATED_CURVE: curve}) if is_train_from(r, 101) else r
    )
    screen = io.StringIO()
    strategy = LoadBalancedFedAvg(
        min_available_nodes=3,
        balancing=Balancing(batch_size=16, local_steps=3),
        keeping=Keeping(reporter=RoundReporter(tmp_path, Console(file=screen, width=300))),
    )
    start(strategy, grid, rounds=3)
    assert len(strategy.reporter.records) == 3
    assert screen.getvalue().count(MARKUP) >= 3  # in each round's clock, literally
