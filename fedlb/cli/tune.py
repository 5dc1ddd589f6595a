"""`fedlb tune`: the what-if calculator of the balancing core."""

from __future__ import annotations

import json
import math
from typing import Annotated

import typer
from rich.table import Table

from fedlb._markup import plain
from fedlb.balance import ESTIMATORS, TUNERS, choices, defaults, make_estimator, make_tuner
from fedlb.experiments import WHATIF_CLOCK, GpuLikeTime, LinearTime, TimeModel, what_if

from .common import UsageError, app, console


def _floats(text: str | None, name: str, count: int | None = None) -> list[float] | None:
    """Parse '1,2.5,3' (one value is repeated for every worker when count is given)."""
    if text is None:
        return None
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as error:
        raise UsageError(f"{name} must be comma-separated numbers, got {text!r}") from error
    if not values:
        raise UsageError(f"{name} is empty")
    if count is not None and len(values) == 1:
        values *= count
    if count is not None and len(values) != count:
        raise UsageError(f"{name} has {len(values)} values but there are {count} workers")
    return values


@app.command()
def tune(
    speeds: Annotated[str, typer.Option(help="Measured samples/s per worker, e.g. 89,21,12,6.")],
    batch: Annotated[int, typer.Option(help="B0: every worker's starting batch size.")] = 32,
    iterations: Annotated[int, typer.Option(help="τ: iterations per round.")] = 1,
    overheads: Annotated[
        str | None, typer.Option(help="Fixed seconds per round per worker (one value: all).")
    ] = None,
    curve: Annotated[
        str, typer.Option(help="Time curve: 'linear' (CPU) or 'gpu' (launch, saturation).")
    ] = "linear",
    launch: Annotated[
        str | None, typer.Option(help="gpu curve: seconds per iteration whatever B.")
    ] = None,
    saturation: Annotated[
        str | None, typer.Option(help="gpu curve: batch below which time stops falling.")
    ] = None,
    capacity: Annotated[
        str | None, typer.Option(help="gpu curve: batch size that fills accelerator memory.")
    ] = None,
    tuners: Annotated[
        str, typer.Option(help="Comma-separated: " + choices(TUNERS, defaults.TUNER))
    ] = ",".join((defaults.TUNER, *defaults.TUNE_ALSO)),
    estimator: Annotated[
        str, typer.Option(help="Speed estimator: " + choices(ESTIMATORS, defaults.ESTIMATOR) + ".")
    ] = defaults.ESTIMATOR,
    rounds: Annotated[int, typer.Option(help="Rounds to model.")] = 10,
    noise: Annotated[float, typer.Option(help="Relative jitter of measured times.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the jitter.")] = 0,
    min_batch: Annotated[int, typer.Option(help="Smallest batch any worker gets.")] = 1,
    max_batch: Annotated[int | None, typer.Option(help="Largest batch any worker gets.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON lines instead.")] = False,
) -> None:
    """What-if: the batch sizes each tuner proposes round by round, the round time and E.

    Times are modelled (clock: model), nothing is trained: give the speeds you measured
    and see where each tuner takes the split before you start a run.
    """
    speed_values = _floats(speeds, "--speeds")
    assert speed_values is not None
    n = len(speed_values)
    if any(not (math.isfinite(v) and v > 0) for v in speed_values):
        raise UsageError(f"--speeds must all be > 0 samples/s, got {speeds}")
    if batch < 1 or iterations < 1 or rounds < 1:
        raise UsageError("--batch, --iterations and --rounds must be >= 1")
    if not math.isfinite(noise) or not 0 <= noise < 1:
        raise UsageError(f"--noise must be in [0, 1), got {noise}")
    if estimator not in ESTIMATORS:
        raise UsageError(f"--estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    fixed = _floats(overheads, "--overheads", n) or [0.0] * n
    names = [f"w{i}" for i in range(n)]
    models: dict[str, TimeModel]
    if curve == "linear":
        if launch or saturation or capacity:
            raise UsageError("--launch, --saturation and --capacity need --curve gpu")
        models = {w: LinearTime(v, o) for w, v, o in zip(names, speed_values, fixed, strict=True)}
    elif curve == "gpu":
        launches = _floats(launch, "--launch", n) or [0.0] * n
        sats = _floats(saturation, "--saturation", n) or [0.0] * n
        caps = _floats(capacity, "--capacity", n)
        models = {
            w: GpuLikeTime(
                speed_values[i],
                launches[i],
                int(sats[i]),
                None if caps is None else int(caps[i]),
                fixed[i],
            )
            for i, w in enumerate(names)
        }
    else:
        raise UsageError(f"--curve must be 'linear' or 'gpu', got {curve!r}")

    chosen = [t.strip() for t in tuners.split(",") if t.strip()]
    try:
        runs = {
            name: what_if(
                models,
                make_tuner(name, min_batch, max_batch),
                dict.fromkeys(names, batch),
                iterations=iterations,
                rounds=rounds,
                estimator=make_estimator(estimator),
                noise=noise,
                seed=seed,
            )
            for name in chosen
        }
    except ValueError as error:
        raise UsageError(str(error)) from error

    if as_json:
        for name, history in runs.items():
            for r in history:
                print(json.dumps({"clock": WHATIF_CLOCK, "tuner": name, **r.__dict__}))
        return
    console.print(
        f"[bold]fedlb tune[/] — clock: {WHATIF_CLOCK} (modelled times, nothing run); "
        f"X = {batch * n}, τ = {iterations}; estimator {plain(estimator)}; fedlb's default "
        f"controller: {defaults.controller()}"
    )
    for name, history in runs.items():
        table = Table(
            title=f"{plain(name)}{' (default)' if name == defaults.TUNER else ''}",
            title_justify="left",
        )
        table.add_column("round", justify="right")
        for w in names:
            table.add_column(f"B {plain(w)}", justify="right")
        table.add_column("round s", justify="right")
        table.add_column("T* s", justify="right")
        table.add_column("E", justify="right")
        table.add_column("idle", justify="right")
        shown = (
            history
            if len(history) <= 30
            else [
                r
                for i, r in enumerate(history)
                if i == 0 or r.sizes != history[i - 1].sizes or i == len(history) - 1
            ]
        )
        for r in shown:
            table.add_row(
                str(r.round),
                *(str(r.sizes[w]) for w in names),
                f"{r.round_s:.4g}",
                f"{r.ideal_s:.4g}",
                f"{r.efficiency:.3f}",
                f"{r.idle_fraction:.1%}",
            )
        console.print(table)
        if len(shown) < len(history):
            console.print("  (rounds where the sizes did not change are not shown)")
