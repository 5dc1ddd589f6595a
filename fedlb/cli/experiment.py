"""`fedlb experiment`: compare policies on one federation (Flower's Simulation Engine)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedlb._markup import plain
from fedlb.data import DATASETS
from fedlb.deploy import as_settings
from fedlb.experiments import (
    POLICIES,
    PolicyResult,
    Scenario,
    ScenarioError,
    load_results,
    redraw_plots,
    run_experiment,
    summarise_results,
)
from fedlb.flower import RUN_FILES, RoundRecord
from fedlb.models import MODELS
from fedlb.training import STEP_CURVES

from .common import UsageError, app, console
from .live import PageHost, PageOn, PagePort, PageToken, live_page


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def ended_early(summary: dict[str, Any], rounds: int) -> list[str]:
    """The policies whose rounds ended well before the longest policy's clock without
    reaching the target in every seed: their time to target was cut off by the number of
    rounds, not measured against the others at equal time (a balanced policy's rounds are
    shorter), each with the rounds that would reach the longest one's clock."""
    clocks = {
        name: row["total_clock_s"]
        for name, row in summary["policies"].items()
        if row.get("total_clock_s")
    }
    if not clocks:
        return []
    longest = max(clocks, key=clocks.__getitem__)
    notes = []
    for name, clock in clocks.items():
        row = summary["policies"][name]
        hit, _, runs = str(row.get("reached_target", "")).partition("/")
        missed = int(hit) < int(runs) if runs else row.get("time_to_target_s") is None
        if missed and clock < 0.9 * clocks[longest]:
            need = math.ceil(rounds * clocks[longest] / clock)
            notes.append(
                f"{name}: its {rounds} rounds ended at {clock:.2f} s of clock, before "
                f"{longest}'s {clocks[longest]:.2f} s, short of the target in some run; "
                f"to compare time to target at equal clock, give it about {need} rounds "
                f"(--rounds {need})"
            )
    return notes


def print_summary(chosen: Scenario, summary: dict[str, Any]) -> None:
    """The console table of a comparison: each policy against fedavg."""
    seeds = f", mean of {chosen.repeats} seeds" if chosen.repeats > 1 else ""
    table = Table(
        # no rules between columns and one space of padding: ten fit in 80 characters
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1, 0, 0),
        title=f"{plain(chosen.name)} — clock: {plain(chosen.clock_label())}, target accuracy "
        f"{chosen.target_accuracy:g}{seeds}",
        title_justify="left",
        caption="target s: clock time to the target accuracy"
        + ("; hit: the seeds that reached it" if chosen.repeats > 1 else "")
        + "; speedup: fedavg's time to "
        f"target over the policy's (these speeds allow {summary['speedup_ceiling']:.2f}x at "
        "most: FedAvg's rounds over ideal T* rounds). final: the server's test accuracy "
        "after the last round; silos: the mean of the silos' own accuracies then; best: "
        "the best round's"
        + (" (± the standard deviation over seeds below)" if chosen.repeats > 1 else "")
        + ". E: mean balance efficiency T*/round time, all rounds and from round 3 on.",
        caption_justify="left",
    )
    columns = ["policy", "target s", "speedup", "final", "silos", "best", "E", "E r≥3", "idle"]
    if chosen.repeats > 1:
        columns.insert(2, "hit")
    for column in columns:  # a number cut short or wrapped says nothing
        table.add_column(column, justify="left" if column == "policy" else "right", no_wrap=True)
    for name, row in summary["policies"].items():
        ttt = row["time_to_target_s"]
        speedup = row.get("speedup_over_fedavg")  # older summaries: none
        cells = [
            plain(name),  # a summary's keys are a file's (--from-results)
            _fmt(ttt, ".2f"),
            _fmt(speedup, ".2f") + ("x" if speedup else ""),
            _fmt(row["final_accuracy"], ".3f"),
            _fmt(row.get("final_mean_silo_accuracy"), ".3f"),
            _fmt(row["best_accuracy"], ".3f"),
            _fmt(row["mean_balance_efficiency"], ".3f"),
            _fmt(row["steady_balance_efficiency"], ".3f"),
            _fmt(row["idle_fraction"], ".0%"),
        ]
        if chosen.repeats > 1:
            cells.insert(2, plain(row["reached_target"]))
        table.add_row(*cells)
        spreads = {
            key: f"±{row[f'{key}_std']:.3f}"
            for key in ("final_accuracy", "final_mean_silo_accuracy", "best_accuracy")
            if f"{key}_std" in row
        }
        if spreads:
            spread_row = [""] * len(columns)
            for key, column in (
                ("final_accuracy", "final"),
                ("final_mean_silo_accuracy", "silos"),
                ("best_accuracy", "best"),
            ):
                spread_row[columns.index(column)] = spreads.get(key, "")
            table.add_row(*spread_row, style="dim")
    console.print(table)
    for note in ended_early(summary, chosen.rounds):
        console.print(f"[yellow]{plain(note)}[/yellow]")


@app.command()
def experiment(
    scenario: Annotated[
        Path | None, typer.Argument(help="Scenario TOML file (see scenarios/).")
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(help=", ".join(DATASETS) + "."),
    ] = None,
    data_dir: Annotated[str | None, typer.Option(help="Where the dataset's files are.")] = None,
    silos: Annotated[int | None, typer.Option(help="Number of silos.")] = None,
    speeds: Annotated[
        str | None,
        typer.Option(
            help="Relative speeds 1,2,3,6 or ec2-5 or hetero-K:N; an entry curve:NAME "
            "follows a measured step-time curve (NAME*K: its times x K) of the scenario's "
            "model: " + ", ".join(STEP_CURVES) + "."
        ),
    ] = None,
    base_speed: Annotated[float | None, typer.Option(help="Samples/s of speed 1.")] = None,
    overheads: Annotated[str | None, typer.Option(help="Fixed s per round (per silo).")] = None,
    traces: Annotated[
        str | None, typer.Option(help="static, step:R:F, periodic:P:F, walk:S (per silo).")
    ] = None,
    partition: Annotated[
        str | None, typer.Option(help="iid, classes:K, dirichlet:α, natural.")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="; ".join(f"{n}: {w}" for n, w in MODELS.items()) + ".")
    ] = None,
    rounds: Annotated[int | None, typer.Option(help="Rounds per policy.")] = None,
    local_steps: Annotated[int | None, typer.Option(help="τ.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="B0.")] = None,
    learning_rate: Annotated[float | None, typer.Option(help="η.")] = None,
    batch_stream: Annotated[
        str | None, typer.Option(help="per-round (default) or carried (FLamby's).")
    ] = None,
    clock: Annotated[str | None, typer.Option(help="model or measured.")] = None,
    policies: Annotated[
        str | None, typer.Option(help="Comma list of: " + ", ".join(POLICIES))
    ] = None,
    target_accuracy: Annotated[float | None, typer.Option(help="For time-to-target.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of data, model, profiles.")] = None,
    repeats: Annotated[
        int | None, typer.Option(help="Runs per policy, seeds seed, seed+1, ...")
    ] = None,
    he: Annotated[
        bool | None,
        typer.Option("--he/--no-he", help="Encrypt updates with CKKS (fresh keys)."),
    ] = None,
    second_run: Annotated[
        bool | None,
        typer.Option(
            "--second-run/--first-run",
            help="Report each policy's second run, as a deployment run again: the guard "
            "takes up the first run's verdict, and where it was stable round 1 starts "
            "balanced from the profiles the first run stored; default the first run.",
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="host:port of a running Ray cluster's head to run the silos on (its "
            "nodes may be other machines); default: a Ray head started here for all runs."
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Results folder.")] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Replace the results of an earlier run in the results folder."
        ),
    ] = False,
    from_results: Annotated[
        Path | None,
        typer.Option(
            help="Summarise a finished experiment's folder again (e.g. at another "
            "--target-accuracy) from its rounds.jsonl, without rerunning it."
        ),
    ] = None,
    page: PageOn = True,
    page_host: PageHost = "127.0.0.1",
    page_port: PagePort = 0,
    page_token: PageToken = None,
) -> None:
    """Run every policy on the same federation (same seed, partition, initial model, τ, X,
    η) and write rounds.jsonl, summary.json, partition.json and PNG plots."""
    flags = as_settings(
        dataset=dataset,
        data_dir=data_dir,
        silos=silos,
        speeds=speeds,
        base_speed=base_speed,
        overheads=overheads,
        traces=traces,
        partition=partition,
        model=model,
        rounds=rounds,
        local_steps=local_steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        batch_stream=batch_stream,
        clock=clock,
        policies=policies,
        target_accuracy=target_accuracy,
        seed=seed,
        repeats=repeats,
        he=he,
        second_run=second_run,
        ray_address=ray_address,
        out=None if out is None else str(out),
    )
    if from_results is not None:
        if target_accuracy is None:
            raise UsageError("--from-results needs the --target-accuracy to summarise at")
        try:
            chosen, summary = summarise_results(from_results, target_accuracy)
            plots = redraw_plots(*load_results(from_results, target_accuracy), from_results)
        except ScenarioError as error:
            raise UsageError(str(error)) from error
        print_summary(chosen, summary)
        path = from_results / f"summary-target-{target_accuracy:g}.json"
        path.write_text(json.dumps(summary, indent=2))
        console.print(f"summary at target {target_accuracy:g}: {plain(path)}")
        console.print(f"plots drawn again: {plain(', '.join(p.name for p in plots))}")
        return
    try:
        chosen = Scenario.from_file(scenario, flags) if scenario else Scenario.from_mapping(flags)
    except ScenarioError as error:
        raise UsageError(str(error)) from error
    folder = Path(chosen.out or Path("runs") / f"experiment-{chosen.name}")
    on_curves = all(e.strip().startswith("curve:") for e in chosen.speeds.split(","))
    console.print(
        f"[bold]fedlb experiment[/] {plain(chosen.name)}: {chosen.silos} silos, speeds "
        f"{plain(chosen.speeds)}{'' if on_curves else f' x {chosen.base_speed:g} samples/s'}, "
        f"{plain(chosen.partition)}, {chosen.rounds} rounds, clock: "
        f"{plain(chosen.clock_label())}; policies {plain(chosen.policies)}"
        + (f"; seeds {', '.join(map(str, chosen.seeds()))}" if chosen.repeats > 1 else "")
        + ("; HE: CKKS (measured HE seconds join each silo's fixed cost)" if chosen.he else "")
        + (
            "; each policy's second run (at its first's verdict, from its profiles)"
            if chosen.second_run
            else ""
        )
        + (f"; on the Ray cluster at {plain(chosen.ray_address)}" if chosen.ray_address else "")
    )

    runs = len(chosen.policy_names()) * chosen.repeats
    with (
        live_page(page, page_host, page_port, page_token, "fedlb experiment") as state,
        Progress(
            TextColumn("  {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress,
    ):
        if state is not None:
            state.start_run(
                f"fedlb experiment {chosen.name}",
                out_dir=str(folder),
                num_rounds=chosen.rounds,
                num_silos=chosen.silos,
            )
        rounds = progress.add_task("starting Flower's simulation", total=runs * chosen.rounds)

        def round_done(record: RoundRecord) -> None:
            efficiency = "–" if record.efficiency is None else f"{record.efficiency:.2f}"
            progress.update(
                rounds, advance=1, description=f"round {record.round}: E = {efficiency}"
            )
            if state is not None:
                state.add_round(record)

        def done(name: str, result: PolicyResult) -> None:
            summary = result.summary(chosen.target_accuracy)
            progress.console.print(
                f"  {plain(name)}: {summary['rounds']} rounds in {summary['total_clock_s']:.1f} s "
                f"(clock: {plain(chosen.clock_label())}), final accuracy "
                f"{_fmt(summary['final_accuracy'], '.3f')}"
            )

        try:  # its data checks (files, the split for every seed) come before any policy runs
            summary = run_experiment(
                chosen,
                folder,
                on_policy=done,
                on_round=round_done,
                overwrite=overwrite,
                on_start=state.start_policy if state is not None else None,
            )
        except ScenarioError as error:
            raise UsageError(str(error)) from error
        except RuntimeError as error:  # a policy's run failed: its message names the log
            console.print(f"[red]experiment stopped:[/] {plain(error)}")
            raise typer.Exit(1) from error
        if state is not None:
            state.finish("completed")
    print_summary(chosen, summary)
    if any(folder.glob(f"**/{RUN_FILES.tensorboard}")):  # one per policy (and seed)
        console.print(f"each round's scalars, per policy: tensorboard --logdir {plain(folder)}")
    if chosen.repeats == 1:
        console.print(
            f"results: {plain(folder)}/rounds.jsonl, summary.json, partition.json, accuracy.png, "
            "accuracy_by_round.png, batch_sizes.png, round_time.png, idle.png"
        )
    else:
        console.print(
            f"results: {plain(folder)}/rounds.jsonl, summary.json, accuracy.png, "
            "accuracy_by_round.png (all seeds); "
            f"each seed's full set in {plain(folder)}/seed-S/"
        )
