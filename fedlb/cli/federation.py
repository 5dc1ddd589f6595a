"""`fedlb server` and `fedlb demo`: a real Flower deployment from the CLI (its silos:
`fedlb silo`, in silo.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import signal
import sys
import typing
from collections.abc import Callable
from dataclasses import fields
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from fedlb.flower import (
    RUN_SETTING_HELP,
    ConfigError,
    DeployError,
    Federation,
    RunConfig,
    RunOutcome,
    TlsError,
    TlsFiles,
    check_partition,
    print_round,
    read_toml,
)

from .common import UsageError, app, console

SERVER_FILE = "server.json"  # where a resumable server listened, for --resume

SERVER_KEYS = {
    "host": str,
    "port": int,
    "out-dir": str,
    "run-timeout": float,
    "certs": str,
    "silo-keys": str,
}
BASE_SPEED = 200.0  # samples/s of an emulated silo with slowdown 1


def read_config(
    path: Path | None, sections: dict[str, dict[str, type]]
) -> dict[str, dict[str, Any]]:
    """Settings from a TOML file, by section: known sections only and, where a section's
    keys are given, known keys of the right types (the [run] keys RunConfig checks)."""
    if path is None:
        return {section: {} for section in sections}
    try:
        data = read_toml(path)
    except ConfigError as error:
        raise UsageError(str(error)) from error
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise UsageError(f"{path}: unknown section(s) {unknown}; expected {sorted(sections)}")
    values: dict[str, dict[str, Any]] = {}
    for section, keys in sections.items():
        values[section] = {}
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise UsageError(f"{path}: [{section}] must be a table")
        for key, value in table.items():
            if keys and key not in keys:
                raise UsageError(
                    f"{path}: unknown key {key!r} in [{section}]; known: {', '.join(keys)}"
                )
            kind = keys.get(key) if keys else None
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if kind is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                raise UsageError(f"{path}: {key} must be {kind.__name__}, got {value!r}")
            values[section][key] = value
    return values


RUN_TYPES = {"int": int, "float": float, "str": str}
CLI_OWNED = {"out_dir", "resume"}  # run settings the commands set themselves


def _run_options() -> list[inspect.Parameter]:
    """One --flag per run setting (default None: the config file's or RunConfig's)."""
    params = []
    for f in fields(RunConfig):
        if f.name in CLI_OWNED:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = RUN_TYPES[str(f.type)]
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[
                    kind | None,
                    typer.Option(
                        flag,
                        help=f"{RUN_SETTING_HELP[flag[2:]]} [default: {f.default}]",
                        rich_help_panel="Run settings",
                    ),
                ],
            )
        )
    return params


def with_run_options(
    function: Callable[..., None],
) -> Callable[..., None]:
    """Give a command one option per RunConfig field, collected into `run_flags`."""
    hints = typing.get_type_hints(function, include_extras=True)  # annotations are strings
    own = [
        p.replace(annotation=hints[p.name])
        for p in inspect.signature(function).parameters.values()
        if p.name != "run_flags"
    ]
    run_names = [f.name for f in fields(RunConfig) if f.name not in CLI_OWNED]

    def command(**kwargs: Any) -> None:
        flags = {n.replace("_", "-"): kwargs.pop(n) for n in run_names}
        function(run_flags={k: v for k, v in flags.items() if v is not None}, **kwargs)

    command.__signature__ = inspect.Signature(own + _run_options())  # type: ignore[attr-defined]
    command.__doc__ = function.__doc__
    command.__name__ = function.__name__
    return command


def settings(file_values: dict[str, Any], flags: dict[str, Any]) -> RunConfig:
    merged = {**file_values, **flags}
    try:
        config = RunConfig.from_mapping(merged)
        check_partition(config)
    except ConfigError as error:
        raise UsageError(str(error)) from error
    if config.he_context:
        # The ServerApp loads it again in its own process; refuse a wrong file here first,
        # before any process starts. The path must be absolute for that process.
        path = Path(config.he_context).resolve()
        check_context_file(path, "server")
        config = dataclasses.replace(config, he_context=str(path))
    return config


def check_context_file(path: Path, role: str) -> str:
    """The key file's fingerprint, or a UsageError naming the file and the fix."""
    from fedlb.he import HeKeyError, fingerprint, load_context

    try:
        return fingerprint(load_context(path, "server" if role == "server" else "silo"))
    except HeKeyError as error:
        raise UsageError(str(error)) from error


def run_federation(
    config: RunConfig,
    host: str,
    port: int | None,
    out_dir: Path,
    timeout: float | None,
    local_silos: list[float] | None = None,
    base_speed: float = BASE_SPEED,
    silo_context: Path | None = None,
    tls: TlsFiles | None = None,
    silo_keys: list[Path] | None = None,
    resumable: bool = False,
) -> RunOutcome:
    """Start a SuperLink (and local silos), run, show every round, stop what was started.

    resumable: keep the SuperLink's state in out_dir (so `fedlb server --resume` finds
    the silos under their node ids) and note where it listens in out_dir/server.json."""
    out_dir = out_dir.resolve()
    run_config = {**config.to_mapping(), "out-dir": str(out_dir)}
    database = None
    if resumable:
        database = out_dir / "superlink.db"
        if not config.resume:
            database.unlink(missing_ok=True)  # a fresh run: no silos of an older one
    # SIGTERM must unwind the `with Federation` block so the processes it started stop.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    try:
        with Federation(
            out_dir / "processes", host, port, tls=tls, silo_keys=silo_keys, database=database
        ) as federation:
            if resumable:
                (out_dir / SERVER_FILE).write_text(
                    json.dumps(
                        {
                            "host": host,
                            "port": int(federation.address.rsplit(":", 1)[1]),
                            "superlink-pid": federation.link.pid if federation.link else None,
                        }
                    )
                )
            console.print(
                f"[bold]fedlb server[/]: SuperLink on {federation.address}; waiting for "
                f"{config.num_silos} silos; results in {out_dir}"
            )
            if tls is not None:
                console.print(f"  TLS on: silos need {tls.ca} (--root-certificates)")
            if silo_keys is not None:
                console.print(
                    f"  SuperNode authentication on: {len(silo_keys)} registered silo key(s)"
                )
            if config.he_context:
                console.print(
                    f"  HE on: updates averaged as CKKS ciphertexts under {config.he_context}"
                    " (no secret key at the server; evaluation federated only)"
                )
            for i, slowdown in enumerate(local_silos or []):
                federation.add_silo(
                    f"silo-{i}",
                    {
                        "partition-id": i,
                        "num-partitions": len(local_silos or []),
                        "emulated-speed": base_speed / slowdown,
                        "threads": 1,
                        **({"he-context": str(silo_context)} if silo_context else {}),
                    },
                )
                console.print(
                    f"  local silo-{i}: emulated {base_speed / slowdown:.0f} samples/s "
                    f"(slowdown {slowdown:g}; clock: measured, sleep-padded)"
                )
            outcome = federation.run(
                run_config, on_round=lambda record: print_round(console, record), timeout=timeout
            )
    except DeployError as error:
        console.print(f"[red]could not run the federation:[/] {escape(str(error))}")
        raise typer.Exit(1) from error
    return outcome


def finish(outcome: RunOutcome) -> None:
    if outcome.ok:
        encrypted = outcome.out_dir is not None and (outcome.out_dir / "model.ckks.npz").exists()
        model = "model.ckks.npz" if encrypted else "model.pt"
        console.print(
            f"[green]run {outcome.run_id} completed[/]: {len(outcome.records)} rounds. Results: "
            f"{outcome.out_dir}/rounds.jsonl, summary.json, {model}; ServerApp log: "
            f"{outcome.log_path}"
        )
        return
    console.print(
        f"[red]run {outcome.run_id} ended as {outcome.status}[/]; see the ServerApp log "
        f"{outcome.log_path}"
    )
    raise typer.Exit(1)


def default_out_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


@app.command()
@with_run_options
def server(
    config: Annotated[
        Path | None, typer.Option("--config", help="TOML file ([server] and [run] tables).")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address the SuperLink listens on.")] = None,
    port: Annotated[int | None, typer.Option(help="Its port (default 8000).")] = None,
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
    *,
    run_flags: dict[str, Any],
) -> None:
    """Start a SuperLink, wait for the silos, run load-balanced FedAvg, write the results.

    Every setting can come from --config (see server/server.toml) or a flag; flags win.
    After every round the run's out-dir gets a checkpoint: if the server stops, `fedlb
    server --resume OUT_DIR` goes on from there. Exits non-zero when the run fails.
    """
    sections = read_config(config, {"server": SERVER_KEYS, "run": {}})
    values = sections["server"]
    if resume is not None:
        run, listened = resumed_settings(resume, sections["run"], run_flags)
        values = {**listened, **values}
        out_dir = resume
    else:
        run = settings(sections["run"], run_flags)
    tls = None
    folder = certs or (Path(values["certs"]) if values.get("certs") else None)
    if folder is not None:
        try:
            tls = TlsFiles.from_folder(folder.resolve())
        except TlsError as error:
            raise UsageError(str(error)) from error
    keys_folder = silo_keys or (Path(values["silo-keys"]) if values.get("silo-keys") else None)
    keys = None
    if keys_folder is not None:
        keys = sorted(keys_folder.resolve().glob("*.pub"))
        if not keys:
            raise UsageError(f"--silo-keys {keys_folder}: no *.pub files (fedlb silo-key)")
        if tls is None:
            raise UsageError("--silo-keys needs --certs: keys are only worth it over TLS")
    outcome = run_federation(
        run,
        host or values.get("host", "127.0.0.1"),
        port or values.get("port", 8000),
        out_dir or Path(values.get("out-dir") or default_out_dir()),
        run_timeout or values.get("run-timeout"),
        tls=tls,
        silo_keys=keys,
        resumable=True,
    )
    finish(outcome)


def resumed_settings(
    run_dir: Path, file_run: dict[str, Any], flags: dict[str, Any]
) -> tuple[RunConfig, dict[str, Any]]:
    """The settings of the run in `run_dir` (from its checkpoint) and where its server
    listened; only --num-rounds may be given, to extend the run."""
    from fedlb.flower import CheckpointError, load_checkpoint

    others = sorted(set(flags) - {"num-rounds"}) + sorted(file_run)
    if others:
        raise UsageError(
            "--resume takes the run's settings from its checkpoint; drop "
            + ", ".join(others)
            + " (only --num-rounds may be given, to extend the run)"
        )
    run_dir = run_dir.resolve()
    try:
        checkpoint = load_checkpoint(run_dir)
    except CheckpointError as error:
        raise UsageError(str(error)) from error
    run = settings({**checkpoint.settings, "out-dir": str(run_dir), "resume": str(run_dir)}, flags)
    if run.num_rounds < checkpoint.round:
        raise UsageError(
            f"--num-rounds {run.num_rounds} is below the {checkpoint.round} rounds done"
        )
    console.print(f"resuming {run_dir} after round {checkpoint.round} of {run.num_rounds}")
    listened: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        listened = dict(json.loads((run_dir / SERVER_FILE).read_text()))
    return run, listened


@app.command()
@with_run_options
def demo(
    slowdowns: Annotated[
        str, typer.Option(help="One emulated silo per value: how many times slower it is.")
    ] = "1,2,4",
    base_speed: Annotated[
        float, typer.Option(help="Samples/s of an emulated silo with slowdown 1.")
    ] = BASE_SPEED,
    out_dir: Annotated[
        Path | None, typer.Option("--out-dir", help="Results folder (default runs/<time>).")
    ] = None,
    he: Annotated[
        bool, typer.Option("--he", help="Encrypt updates (CKKS; fresh keys in out-dir/keys).")
    ] = False,
    *,
    run_flags: dict[str, Any],
) -> None:
    """The whole heterogeneous federation on this machine: a server and one silo per
    slowdown (real SuperLink and SuperNode processes, emulated speeds), then the results."""
    try:
        factors = [float(x) for x in slowdowns.split(",") if x.strip()]
    except ValueError as error:
        raise UsageError(f"--slowdowns must be numbers like 1,2,4, got {slowdowns!r}") from error
    if not factors or any(f < 1 for f in factors):
        raise UsageError(f"--slowdowns must be numbers >= 1, got {slowdowns!r}")
    if not base_speed > 0:
        raise UsageError(f"--base-speed must be > 0, got {base_speed}")
    defaults = {
        "num-silos": len(factors),
        "num-rounds": 8,
        "local-steps": 10,
        "batch-size": 16,
    }
    folder = out_dir or default_out_dir()
    silo_context = None
    if he:
        if run_flags.get("he-context"):
            raise UsageError("--he makes fresh keys; give either --he or --he-context")
        from fedlb.he import write_keys

        keys = write_keys(folder / "keys")
        run_flags = {**run_flags, "he-context": str(keys.public)}
        silo_context = keys.secret.resolve()
    run = settings(defaults, run_flags)
    if run.num_silos != len(factors):
        raise UsageError(f"--num-silos {run.num_silos} but {len(factors)} --slowdowns")
    outcome = run_federation(
        run, "127.0.0.1", None, folder, None, factors, base_speed, silo_context
    )
    finish(outcome)
