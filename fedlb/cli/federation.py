"""`fedlb server`: option parsing over fedlb.deploy's run_server, and `serve`, which runs a
federation and shows it round by round (on the console and the live page) and its outcome
(`fedlb demo`, in demo.py, runs its own through it; the silos: `fedlb silo`, in silo.py;
one option per run setting: run_options.py)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from fedlb._markup import plain
from fedlb.deploy import (
    ConfigError,
    DeployError,
    RunConfig,
    RunOutcome,
    ServerReady,
    ServerSettings,
    SiloSettings,
    resume_settings,
    run_server,
    server_settings,
)
from fedlb.flower import (
    RUN_FILES,
    CheckpointError,
    RoundRecord,
    load_checkpoint,
    records_from_json_lines,
)
from fedlb.page import PageState

from .common import UsageError, app, console
from .live import PageHostOrFile, PageOnOrFile, PagePortOrFile, PageToken, live_page
from .run_options import with_run_options


def serve(
    settings: ServerSettings,
    run: RunConfig,
    silos: list[SiloSettings] | None = None,
    overwrite: bool = False,
    page: PageState | None = None,
    name: str = "fedlb server",
) -> RunOutcome:
    """Run the server (and local silos), show every round (on the console and on the
    live `page`, where there is one), exit non-zero unless it completed every round.
    SIGTERM stops everything it started."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    ready: list[ServerReady] = []
    app = settings.user_app()
    # a user's app names its own rounds (its run config, where a usual key does)
    rounds = app.num_rounds if app else run.num_rounds
    if page is not None:
        page.start_run(name, num_rounds=rounds, num_silos=run.num_silos)

    def announced(where: ServerReady) -> None:
        ready.append(where)
        announce(where)
        if page is not None:
            page.start_run(
                name,
                address=where.address,
                out_dir=str(where.out_dir),
                num_rounds=planned_rounds(where, rounds),
                num_silos=where.run.num_silos,
                local_silos=where.local_silos,
            )
            page_rounds_before(page, where.out_dir / RUN_FILES.rounds)

    def shown(record: RoundRecord) -> None:
        console.print(record)
        if page is not None:
            page.add_round(record)

    try:
        outcome = run_server(
            settings,
            run,
            local_silos=silos or [],
            on_ready=announced,
            on_round=shown,
            overwrite=overwrite,
        )
    except KeyboardInterrupt:
        if page is not None:
            page.finish("stopped")
        if ready:  # the SuperLink was up: a run may have checkpointed rounds to go on from
            console.print(
                f"stopped (Ctrl-C); everything it started is stopped. `fedlb server --resume "
                f"{plain(ready[0].out_dir)}` goes on after the last checkpointed round"
            )
        raise typer.Exit(130) from None
    except ConfigError as error:  # checked before anything started
        raise UsageError(str(error)) from error
    except DeployError as error:
        console.print(f"[red]could not run the federation:[/] {plain(error)}")
        raise typer.Exit(1) from error
    finally:
        signal.signal(signal.SIGTERM, previous)
    if page is not None:
        page.finish("completed" if outcome.problem is None else f"failed: {outcome.problem}")
    finish(outcome)
    return outcome


def planned_rounds(ready: ServerReady, rounds: int | None) -> int | None:
    """The rounds the run plans: fedlb's own run's setting; a user's app's as its
    checkpoint says them when it goes on after a stop, else as its run config names them
    (None: not known before its first checkpoint)."""
    if ready.app is None:
        return ready.run.num_rounds
    if ready.run.resume:
        try:
            return load_checkpoint(Path(ready.run.resume)).num_rounds
        except CheckpointError:
            return None
    return rounds


def page_rounds_before(page: PageState, path: Path) -> None:
    """A resumed run's page starts with the rounds its stopped server finished (the run
    has kept them in rounds.jsonl by now; a fresh run's file is empty)."""
    try:
        for record in records_from_json_lines(path.read_text().splitlines(), True):
            page.add_round(record, live=False)
    except (OSError, ValueError):  # none, or damaged: the run itself says so
        return


def announce(ready: ServerReady) -> None:
    console.print(
        f"[bold]fedlb server[/]: SuperLink on {plain(ready.address)}; waiting for "
        f"{ready.run.num_silos} silos; results in {plain(ready.out_dir)}"
    )
    if ready.app is not None:
        overrides = " ".join(f"{k}={v!r}" for k, v in ready.app.overrides.items())
        console.print(
            f"  your app: {plain(ready.app.folder)} (serverapp {plain(ready.app.serverapp)}, "
            f"FAB sha256 "
            f"{ready.app_digest[:12]}; silos: fedlb silo --app <their copy>)"
            + (f"; run-config {plain(overrides)}" if overrides else "")
        )
    if ready.control_address:
        console.print(
            f"  Control API (runs, nodes, `flwr ls`) on {plain(ready.control_address)}, this "
            f"machine only: FLWR_HOME={plain(ready.out_dir / 'processes' / 'home-cli')} flwr ls"
        )
    if ready.tls_ca is not None:
        console.print(f"  TLS on: silos need {plain(ready.tls_ca)} (--root-certificates)")
    if ready.silo_keys is not None:
        console.print(f"  SuperNode authentication on: {ready.silo_keys} registered silo key(s)")
    if ready.run.he_context:
        console.print(
            f"  HE on: updates averaged as CKKS ciphertexts under {plain(ready.run.he_context)}"
            " (no secret key at the server; evaluation federated only)"
        )
    for name, emulation in ready.local_silos:
        console.print(f"  local {plain(name)}: {plain(emulation)}")  # curve names


def finish(outcome: RunOutcome) -> None:
    first, last = (
        (outcome.records[0].round, outcome.records[-1].round) if outcome.records else (0, 0)
    )
    rounds = (
        "no rounds" if not last else f"round {last}" if first == last else f"rounds {first}-{last}"
    )
    problem = outcome.problem
    if problem is None:
        model = plain(outcome.model_path.name) if outcome.model_path else "no model"
        if outcome.app is not None:  # a user's app saves its model where it does
            model = "the app's own files where it writes them"
        console.print(
            f"[green]run {outcome.run_id} completed[/]: {rounds}. Results: "
            f"{plain(outcome.out_dir)}/rounds.jsonl, summary.json, {model}; ServerApp log: "
            f"{plain(outcome.log_path)}"
        )
        events = outcome.out_dir / RUN_FILES.tensorboard if outcome.out_dir else None
        if events is not None and events.is_dir():
            console.print(f"each round's scalars: tensorboard --logdir {plain(events)}")
        return
    console.print(
        f"[red]run {outcome.run_id} failed[/] ({rounds} on record): {plain(problem)}. "
        f"The ServerApp log: {plain(outcome.log_path)}"
        + (f", which ends with:\n{plain(outcome.log_tail)}" if outcome.log_tail else "")
    )
    raise typer.Exit(1)


@app.command()
@with_run_options
def server(
    config: Annotated[
        Path | None, typer.Option("--config", help=escape("TOML file ([server] and [run] tables)."))
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address the SuperLink listens on.")] = None,
    port: Annotated[
        int | None,
        typer.Option(help="Its port (default 8000; 0: a free one, printed once it is up)."),
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out-dir", help="Results folder (default runs/<time>).")
    ] = None,
    run_timeout: Annotated[
        float | None, typer.Option(help="Give up on the whole run after this many seconds.")
    ] = None,
    certs: Annotated[
        Path | None,
        typer.Option(help="TLS: the folder of `fedlb certs` (ca.crt, server.crt, server.key)."),
    ] = None,
    silo_keys: Annotated[
        Path | None,
        typer.Option(help="Only silos whose public key (*.pub, fedlb silo-key) is here join."),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="A stopped run's out-dir: go on after its last checkpointed round, with its "
            "settings, on its port (--num-rounds may extend it)."
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Replace the results of an earlier run in --out-dir (deleted)."
        ),
    ] = False,
    warm: Annotated[
        bool | None,
        typer.Option(
            "--warm/--cold",
            help="The ServerApp starts warm (torch and fedlb imported once, a fork per run; "
            "the default), or --cold: Flower's own fresh process per run.",
        ),
    ] = None,
    page: PageOnOrFile = None,
    page_host: PageHostOrFile = None,
    page_port: PagePortOrFile = None,
    page_token: PageToken = None,
    user_app: Annotated[
        Path | None,
        typer.Option(
            "--app",
            help="Run your own Flower app (the folder of its pyproject.toml) instead of "
            "fedlb's: its strategy wrapped in LoadBalanced, its ClientApp with balance_mod; "
            "of the run settings only --num-silos applies (the docs: How-to, "
            "'Make your Flower app balanced').",
        ),
    ] = None,
    run_config: Annotated[
        str | None,
        typer.Option(
            "--run-config",
            help='With --app: overrides of its run config, as `flwr run` takes them ("num-'
            'server-rounds=5 learning-rate=0.01").',
        ),
    ] = None,
    *,
    run_flags: dict[str, Any],
) -> None:
    """Start a SuperLink, wait for the silos, run load-balanced FedAvg (or your own
    Flower app: --app), write the results.

    Every setting can come from --config (server.toml; the docs: Reference, Settings) or
    a flag; flags win. After every round the run's out-dir gets a checkpoint: if the
    server stops, `fedlb server --resume OUT_DIR` goes on from there. Exits non-zero when
    the run fails.
    """
    flags = given(
        {
            "host": host,
            "port": port,
            "out-dir": out_dir,
            "run-timeout": run_timeout,
            "certs": certs,
            "silo-keys": silo_keys,
            "warm": warm,
            "page": page,
            "page-host": page_host,
            "page-port": page_port,
            "app": user_app,
            "run-config": run_config,
        }
    )
    try:
        if resume is not None:
            others = sorted(set(run_flags) - {"num-rounds"})
            if others:
                raise UsageError(
                    "--resume takes the run's settings from its checkpoint; drop "
                    + ", ".join(others)
                    + " (only --num-rounds may be given, to extend the run)"
                )
            if overwrite:
                raise UsageError("--overwrite starts a fresh run; --resume goes on with one")
            settings, run = resume_settings(resume, run_flags.get("num-rounds"), flags, config)
            out = Path(settings.out_dir)
            checkpoint = load_checkpoint(out)
            app = settings.user_app()  # a user's app plans its own rounds
            rounds = checkpoint.num_rounds if app else run.num_rounds
            story = checkpoint.story(rounds, out)
            console.print(f"resuming {plain(settings.out_dir)}: {plain(story)}")
            changed = app.changed_since(out) if app else None
            if changed:
                console.print(f"[yellow]note:[/] {plain(changed)}")
        else:
            settings, run = server_settings(config, flags, run_flags)
    except (ConfigError, CheckpointError) as error:
        raise UsageError(str(error)) from error
    with live_page(
        settings.page, settings.page_host, settings.page_port, page_token, "fedlb server"
    ) as state:
        serve(settings, run, overwrite=overwrite, page=state)


def given(flags: dict[str, Any]) -> dict[str, Any]:
    """The flags given on the command line, paths as text (settings take TOML's types)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in flags.items() if v is not None}
