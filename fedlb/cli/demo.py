"""`fedlb demo`: the whole heterogeneous federation on this machine (a server and emulated
silos through fedlb.deploy, shown by federation.py's `serve`), or with --compare plain
FedAvg first and both side by side."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from fedlb.deploy import (
    ConfigError,
    ServerSettings,
    as_settings,
    check_run_folder,
    local_silos,
    server_settings,
)
from fedlb.flower import RoundRecord, compare_runs
from fedlb.page import PageState
from fedlb.training import BASE_SPEED, STEP_CURVES, step_curve

from .common import UsageError, app, console, holding
from .federation import serve
from .live import PageHost, PageOn, PagePort, PageToken, live_page
from .run_options import with_run_options

# The run settings the demo runs with where RunConfig's (`fedlb server`'s) differ: a short
# run that ends in about a minute on a laptop. Its options' help, the CLI and settings
# reference and "Getting started" show these (tests/test_docs_site.py holds them to it).
DEMO_RUN: dict[str, Any] = as_settings(num_rounds=8, local_steps=10, batch_size=16)


@app.command()
@partial(with_run_options, defaults=DEMO_RUN)
def demo(
    slowdowns: Annotated[
        str | None,
        typer.Option(
            help=escape(
                "One emulated silo per value: how many times slower it is. [default: 1,2,4]"
            )
        ),
    ] = None,
    curves: Annotated[
        str | None,
        typer.Option(
            help="Instead of --slowdowns, one emulated silo per measured step-time curve: "
            + ", ".join(STEP_CURVES)
            + ". NAME*K: its times x K (this machine cannot pad a step below its own "
            "compute). The run trains the curves' model (--model, if given, must be it)."
        ),
    ] = None,
    base_speed: Annotated[
        float, typer.Option(help="Samples/s of an emulated silo with slowdown 1.")
    ] = BASE_SPEED,
    out_dir: Annotated[
        Path | None, typer.Option("--out-dir", help="Results folder (default runs/<time>).")
    ] = None,
    he: Annotated[
        bool, typer.Option("--he", help="Encrypt updates (CKKS; fresh keys in out-dir/keys).")
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Replace the results of an earlier run in --out-dir (deleted)."
        ),
    ] = False,
    warm: Annotated[
        bool,
        typer.Option(
            "--warm/--cold",
            help="Silos start ClientApps (and the server its ServerApp) warm: torch and "
            "fedlb imported once, a fork per message; or --cold: Flower's own fresh "
            "process per message and per run.",
        ),
    ] = True,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare",
            help="Run plain FedAvg on Flower's own silos first, then fedlb, and show both "
            "side by side on the wall clock (round wall, whole run, time to the same "
            "accuracy); results in out-dir/fedavg and out-dir/fedlb.",
        ),
    ] = False,
    page: PageOn = True,
    page_host: PageHost = "127.0.0.1",
    page_port: PagePort = 0,
    page_token: PageToken = None,
    *,
    run_flags: dict[str, Any],
) -> None:
    """The whole heterogeneous federation on this machine: a server and one silo per
    slowdown or step-time curve (real SuperLink and SuperNode processes, emulated
    hardware), then the results."""
    factors: list[float] = []
    names: list[str] = []
    if curves is not None:
        if slowdowns is not None:
            raise UsageError("give --slowdowns or --curves, not both")
        names, run_flags = _curves_and_model(curves, run_flags)
    else:
        slowdowns = slowdowns or "1,2,4"
        try:
            factors = [float(x) for x in slowdowns.split(",") if x.strip()]
        except ValueError as error:
            raise UsageError(
                f"--slowdowns must be numbers like 1,2,4, got {slowdowns!r}"
            ) from error
        if not factors:
            raise UsageError(f"--slowdowns must be numbers >= 1, got {slowdowns!r}")
    folder = (out_dir or ServerSettings().results_dir()).resolve()
    with (
        holding(folder, "--out-dir"),  # the whole demo: its reuse check, keys and runs
        live_page(page, page_host, page_port, page_token, "fedlb demo") as state,
    ):
        _demo_in(folder, factors, names, base_speed, he, overwrite, warm, compare, run_flags, state)


def _curves_and_model(curves: str, run_flags: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """--curves' names, each checked, and the run settings training their model: a curve
    is one model's, so the run's model is the curves' (a --model of another is refused)."""
    names = [c.strip() for c in curves.split(",") if c.strip()]
    if not names:
        raise UsageError(
            f"--curves must name step-time curves, e.g. h200/cnn,cpu1/cnn; got {curves!r}"
        )
    try:
        models = {step_curve(name).model for name in names}
    except ValueError as error:
        raise UsageError(f"--curves: {error}") from error
    if len(models) > 1:
        raise UsageError(
            f"--curves {curves}: curves of models {', '.join(sorted(models))}; a run trains "
            "one model, and a curve times only its own"
        )
    model = models.pop()
    given_model = run_flags.get("model")
    if given_model is not None and given_model != model:
        raise UsageError(
            f"--curves {curves} were measured on model {model}, but --model is {given_model}: "
            f"drop --model (the run then trains {model}) or give curves of {given_model}"
        )
    return names, {**run_flags, "model": model}


def _demo_in(
    folder: Path,
    factors: list[float],
    curves: list[str],
    base_speed: float,
    he: bool,
    overwrite: bool,
    warm: bool,
    compare: bool,
    run_flags: dict[str, Any],
    page: PageState | None = None,
) -> None:
    """`fedlb demo` in `folder`, which it holds; its rounds also on the live `page`."""
    try:  # before fresh keys would replace those an earlier run's model needs
        settings = ServerSettings.from_mapping({"port": 0, "out-dir": str(folder), "warm": warm})
        check_run_folder(folder, overwrite)
    except ConfigError as error:
        raise UsageError(str(error)) from error
    silo_context = None
    if he:
        if run_flags.get("he-context"):
            raise UsageError("--he makes fresh keys; give either --he or --he-context")
        from fedlb.he import write_keys

        keys = write_keys(folder / "keys")
        run_flags = {**run_flags, "he-context": str(keys.public)}
        silo_context = keys.secret
    count = len(curves or factors)
    defaults = {**as_settings(num_silos=count), **DEMO_RUN}
    try:
        silos = local_silos(factors, base_speed, silo_context, warm=warm, curves=curves)
        _, run = server_settings(None, run={**defaults, **run_flags})
    except ConfigError as error:
        raise UsageError(str(error)) from error
    if run.num_silos != count:
        given = "--curves" if curves else "--slowdowns"
        raise UsageError(f"--num-silos {run.num_silos} but {count} {given}")
    if not compare:
        serve(settings, run, silos, overwrite, page, "fedlb demo")
        return
    runs: dict[str, list[RoundRecord]] = {}
    for name, where, changes, warm_silos in (
        ("FedAvg", "fedavg", {"tuner": "static", "profiles": 0}, False),
        ("fedlb", "fedlb", {}, warm),
    ):
        try:
            each = ServerSettings.from_mapping(  # the baseline: Flower's own processes
                {"port": 0, "out-dir": str(folder / where), "warm": warm_silos}
            )
            check_run_folder(folder / where, overwrite)
            _, each_run = server_settings(None, run={**defaults, **run_flags, **changes})
            each_silos = local_silos(
                factors, base_speed, silo_context, warm=warm_silos, curves=curves
            )
        except ConfigError as error:
            raise UsageError(str(error)) from error
        console.rule(
            f"[bold]{name}[/]: "
            + ("Flower's own silos, every silo at B0" if where == "fedavg" else "fedlb's default")
            + ("" if where == "fedavg" or warm else ", cold silos")
        )
        runs[name] = serve(
            each, each_run, each_silos, overwrite, page, f"fedlb demo: {name}"
        ).records
    console.print(compare_runs(runs))
