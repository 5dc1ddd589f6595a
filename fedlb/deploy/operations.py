"""Deployment as a library: run a fedlb server, start a silo, from Python.

    from fedlb.deploy import run_server, server_settings, silo_settings, start_silo

    server, run = server_settings(Path("server/server.toml"), run={"num-rounds": 20})
    outcome = run_server(server, run)          # blocks until the run ends
    silo = start_silo(silo_settings(Path("silos/silo-0.toml")))   # returns once it is up
    ...
    silo.stop()

`fedlb server`, `fedlb silo` and `fedlb demo` are option parsing over these. Everything
started is stopped by PID when `run_server` returns or raises; a process that may be
SIGTERMed should turn SIGTERM into an exception (`fedlb server` does) so that happens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from fedlb.flower import (
    RUN_FILES,
    CheckpointError,
    RoundRecord,
    RoundReporter,
    check_resume,
    load_checkpoint,
    start_run_identity,
)
from fedlb.security import (
    FolderInUseError,
    StoredFileError,
    claim_folder,
    cut_command,
    digest_path,
    read_json,
)

from .federation import Federation, RunOutcome
from .leftovers import SHOWN_CHARS
from .processes import (
    SUPERLINK,
    FlowerProcess,
    JoinError,
    check_port_free,
    leftover,
    process_start_time,
    start_supernode,
    stop_leftover,
    wait_joined,
)
from .run_config import ConfigError, RunConfig
from .settings import (
    RUN,
    SERVER,
    ServerSettings,
    SiloSettings,
    check_out_dir,
    checked_run,
    read_sections,
)
from .user_app import APP_FILE, UserApp, kept_app, same_app

log = logging.getLogger("fedlb.flower")

SERVER_FILE = "server.json"  # where the server listened and the processes it started
# Where earlier fedlb kept its SuperLink's state (SQLite); a folder holding one holds a run.
# The SuperLink now keeps its state in memory: Flower 1.42's SQL state cost 0.8-2.5 s a
# round (docs/benchmarks.md), and a resumed run finds its silos by partition instead
# (fedlb.flower.round_balance: RoundBalance._carry_over).
DATABASE_FILE = "superlink.db"


@dataclass(frozen=True)
class ServerReady:
    """What `run_server` tells its caller once the SuperLink is up, before round 1."""

    address: str
    out_dir: Path
    run: RunConfig
    tls_ca: Path | None
    silo_keys: int | None  # registered keys (None: authentication off)
    local_silos: list[tuple[str, str]]  # (name, what it emulates in words) of silos here
    control_address: str = ""  # the SuperLink's Control API (loopback only), for `flwr`
    app: UserApp | None = None  # the user's app it runs (None: fedlb's own)
    app_digest: str = ""  # the sha256 of that app's FAB (a silo's copy prints its own)


def run_server(
    server: ServerSettings,
    run: RunConfig,
    *,
    local_silos: Sequence[SiloSettings] = (),
    on_ready: Callable[[ServerReady], None] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    overwrite: bool = False,
) -> RunOutcome:
    """Start a SuperLink (and `local_silos` on this machine), run fedlb's ServerApp with
    `run`'s settings until it ends, stop everything started; the run's outcome. With
    `server.app`, the user's own Flower app instead (fedlb.deploy.user_app): submitted
    once `run.num_silos` silos have joined, with the out-dir in its environment.

    Results go to server.out_dir (default runs/<date-time>): rounds.jsonl, summary.json,
    the final model, and a checkpoint after every round; the SuperLink's state and the
    address it listens on are kept there too, so `resume_settings(out_dir)` can go on
    after a stop. `run.resume` set: go on from that run's checkpoint (its silos
    reconnect under their node ids). A fresh run refuses a folder that holds an earlier
    run unless `overwrite` (then that run's results are deleted). The folder is this
    process's while it runs: another run into it, fresh or resumed, is refused. Raises
    ConfigError for settings that cannot run (checked before anything starts) and
    DeployError when a process will not start."""
    if not server.app:  # a user's app has its own settings, checked when it runs
        run = checked_run(run.to_mapping())
    out_dir = Path(run.out_dir) if run.out_dir and not server.out_dir else server.results_dir()
    with claimed(out_dir) as out_dir:  # first: two starts must not both find it free
        return _run_claimed(server, run, out_dir, local_silos, on_ready, on_round, overwrite)


@contextlib.contextmanager
def claimed(folder: Path, what: str = "out-dir") -> Iterator[Path]:
    """`claim_folder(folder)` (resolved, yielded) once check_out_dir says it can be
    written; ConfigError when another run holds it."""
    check_out_dir(folder, what)
    try:
        stack = contextlib.ExitStack()
        held = stack.enter_context(claim_folder(folder))
    except FolderInUseError as error:
        raise ConfigError(str(error)) from None
    with stack:
        yield held


def _run_claimed(
    server: ServerSettings,
    run: RunConfig,
    out_dir: Path,
    local_silos: Sequence[SiloSettings],
    on_ready: Callable[[ServerReady], None] | None,
    on_round: Callable[[RoundRecord], None] | None,
    overwrite: bool,
) -> RunOutcome:
    """run_server's run, its out-dir claimed."""
    if server.port:  # before anything is written or stopped (a live server may hold it)
        check_port_free(server.host, server.port, "the SuperLink")
    app = server.user_app()
    if app is not None and run.resume:  # the overrides it was started with, as kept
        app = (kept_app(Path(run.resume)) or (app, 0))[0]
    run_config = app.overrides if app else {**run.to_mapping(), "out-dir": str(out_dir)}
    digest = app.fab_digest() if app else ""  # before anything starts: Flower builds it
    tls, keys = server.tls(), server.registered_keys()
    first_round = 1
    if run.resume:
        stop_left_behind(out_dir)
        (out_dir / RUN_FILES.progress).unlink(missing_ok=True)  # the stopped run's round
        try:
            checkpoint = load_checkpoint(Path(run.resume))
            first_round = checkpoint.first_unpublished_round
            # Rounds the stopped server wrote after its checkpoint go now (the ServerApp
            # would drop them too, but the console must not show them first), and what
            # that drops and runs again is said here, once.
            RoundReporter(
                out_dir,
                None,
                keep_before=first_round,
                done=checkpoint.round,
                num_rounds=checkpoint.num_rounds if app else run.num_rounds,
            )
        except ValueError as error:  # CheckpointError, or a rounds.jsonl line (named) damaged
            raise ConfigError(str(error)) from error
    else:
        check_run_folder(out_dir, overwrite)
        clear_run_folder(out_dir)  # a fresh run: no results, no silos of an older one
        # its digest leaves out resume; a user's app keeps no fedlb settings in its
        # checkpoints (fedlb.flower.run_dir), so its identity is of none
        start_run_identity(out_dir, {} if app else run.to_mapping())
        if app is not None:
            app.keep(out_dir, run.num_silos)
    resume = Path(run.resume) if run.resume else None
    with Federation(
        out_dir / "processes",
        server.host,
        server.port or None,
        tls=tls,
        silo_keys=keys,
        warm=server.warm,
        env=app.env(out_dir, resume) if app else None,
    ) as federation:
        port = int(federation.address.rsplit(":", 1)[1])

        def record_processes() -> None:
            # Whoever resumes this run after a crash stops what is still listed here.
            started = [federation.link, *federation.silos.values()]
            (out_dir / SERVER_FILE).write_text(
                json.dumps(
                    {
                        "host": server.host,
                        "port": port,
                        "control": federation.control_address,
                        "server": {
                            "pid": os.getpid(),
                            "started": process_start_time(os.getpid()),
                        },
                        "processes": [p.identity() for p in started if p is not None],
                    },
                    indent=2,
                )
            )

        record_processes()
        for warm in (True, False):  # each kind started at once: their start-ups overlap
            federation.add_silos(
                {s.name: s.node_config() for s in local_silos if s.warm == warm}, warm=warm
            )
        record_processes()
        if on_ready is not None:
            on_ready(
                ServerReady(
                    federation.address,
                    out_dir,
                    run,
                    tls.ca if tls is not None else None,
                    len(keys) if keys is not None else None,
                    [(silo.name, silo.emulation) for silo in local_silos],
                    federation.control_address,
                    app,
                    digest,
                )
            )
        began = time.monotonic()
        if app is not None:  # its strategy waits only for its own min_available_nodes
            federation.wait_for_silos(run.num_silos, server.run_timeout or None)
        left = server.run_timeout - (time.monotonic() - began) if server.run_timeout else None
        outcome = federation.run(
            run_config,
            on_round=on_round,
            timeout=left if left is None else max(left, 1.0),
            app=app.folder if app else None,
            first_round=first_round,
            out_dir=out_dir,
        )
        if app is not None and outcome.num_rounds is None:
            with contextlib.suppress(CheckpointError):  # the rounds its strategy planned
                outcome.num_rounds = load_checkpoint(out_dir).num_rounds
        return outcome


# What a run leaves in its out-dir; any of them means the folder holds a run.
RUN_RESULTS = (
    RUN_FILES.rounds,
    RUN_FILES.summary,
    RUN_FILES.model,
    RUN_FILES.encrypted_model,
    RUN_FILES.checkpoint,
    RUN_FILES.run,
    DATABASE_FILE,
    APP_FILE,
)


def check_run_folder(out_dir: Path, overwrite: bool = False) -> None:
    """Refuse (ConfigError) to start a fresh run in a folder that holds an earlier one,
    unless `overwrite`; a folder results cannot be written to is refused either way."""
    check_out_dir(out_dir)
    found = [name for name in RUN_RESULTS if (out_dir / name).exists()]
    if found and not overwrite:
        raise ConfigError(
            f"{out_dir} holds an earlier run ({', '.join(found)}); a fresh run there would "
            f"replace its results. Give a new out-dir, go on with that run (--resume "
            f"{out_dir}), or replace it (--overwrite)"
        )


def clear_run_folder(out_dir: Path) -> None:
    """Remove an earlier run's results (and their digests) and its SuperLink state."""
    for name in (*RUN_RESULTS, SERVER_FILE, RUN_FILES.progress):
        (out_dir / name).unlink(missing_ok=True)
        digest_path(out_dir / name).unlink(missing_ok=True)


def stop_left_behind(out_dir: Path) -> None:
    """Before a resume: ConfigError if the server that ran `out_dir` still runs; stop the
    SuperLink and silos it started if they outlived it (server.json lists them). A
    process is stopped only when its command line is the one fedlb started it with, on
    its own port (`processes.leftover`): whatever else a damaged or stale server.json
    names is left alone, and that is said."""
    listed = read_server_file(out_dir)
    owner = listed.get("server") or {}
    pid = owner.get("pid")
    if pid not in (None, os.getpid()) and process_start_time(int(pid)) == owner.get("started"):
        raise ConfigError(
            f"the server of {out_dir} still runs (pid {pid}, `{command_of(int(pid))}`, "
            f"as its {SERVER_FILE} says): stop it first if it is that server, then resume; "
            f"if it is not, {SERVER_FILE} is stale: delete it and resume with the run's --port"
        )
    for identity in listed.get("processes", []):
        name, pid = identity.get("name"), identity.get("pid")
        # the SuperLink's own port is the one the file says the server listened on
        port = listed.get("port") if name == SUPERLINK else None
        why = leftover(identity, port)
        if why:
            log.warning("left alone pid %s, which %s names as %s: %s", pid, SERVER_FILE, name, why)
        elif why is None and stop_leftover(identity, port=port):
            log.warning("stopped %s (pid %s), left running by the server that stopped", name, pid)


def command_of(pid: int) -> str:
    """A process's command line, short, for a message ("?" where it cannot be read)."""
    try:
        return cut_command(psutil.Process(pid).cmdline(), SHOWN_CHARS) or "?"
    except psutil.Error:
        return "?"


def read_server_file(out_dir: Path) -> dict[str, Any]:
    """out_dir/server.json: where the stopped server listened and the processes it
    started ({}: no such file). ConfigError, naming it and what to do, where it is
    damaged (fedlb.security.stored's bounds: size, depth, finite numbers): resuming
    without it would leave those processes running and the silos reconnecting to a port
    nothing listens on."""
    path = out_dir / SERVER_FILE
    try:
        listed = read_json(path, max_bytes=SERVER_FILE_BYTES)
        why = _server_file_problem(listed)
    except FileNotFoundError:
        return {}
    except StoredFileError as error:  # too large, not UTF-8, not JSON, too deep
        why = error.reason
    except OSError as error:
        why = error.strerror or str(error)
    if why:
        raise ConfigError(
            f"{path} is damaged ({why}): it lists the port the stopped server listened on "
            "and the processes it started; stop those still running (its SuperLink and "
            f"local silos), delete {SERVER_FILE}, and resume with the run's --port"
        )
    return dict(listed)


SERVER_FILE_BYTES = 2**20  # a server and its processes: a few hundred bytes each


def _server_file_problem(listed: Any) -> str | None:
    """What is wrong with server.json's content (None: nothing)."""
    if not isinstance(listed, dict):
        return "not a JSON object"
    if "host" in listed and not isinstance(listed["host"], str):
        return "its host is not text"
    if "port" in listed and not (_whole(listed["port"]) and 0 < listed["port"] < 65536):
        return f"its port is {listed['port']!r:.40}"
    processes = listed.get("processes", [])
    if not isinstance(processes, list):
        return "its processes are not a list"
    for owner in [listed.get("server") or {}, *processes]:
        if not isinstance(owner, dict):
            return f"a process is listed as {owner!r:.40}"
        if "pid" in owner and not (_whole(owner["pid"]) and owner["pid"] > 0):
            return f"a process's pid is {owner['pid']!r:.40}"
        started = owner.get("started")
        if started is not None and not isinstance(started, (int, float)):
            return f"a process's start time is {started!r:.40}"
    return None


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resume_settings(
    run_dir: Path,
    num_rounds: int | None = None,
    server: Mapping[str, Any] | None = None,
    path: Path | None = None,
) -> tuple[ServerSettings, RunConfig]:
    """The settings to go on with the stopped run in `run_dir`: its own (from its
    checkpoint), where its server listened (a settings file's [server] table at `path`,
    then `server` values, on top), and `num_rounds` to extend it. ConfigError when there
    is no usable checkpoint, num_rounds is below the rounds done, or the file has [run]
    settings (a resumed run keeps its own)."""
    tables = read_sections(path, (SERVER, RUN)) if path is not None else {SERVER: {}, RUN: {}}
    if tables[RUN]:
        raise ConfigError(
            f"{path}: a resumed run takes its settings from its checkpoint; drop "
            + ", ".join(sorted(tables[RUN]))
            + " from [run] (only num-rounds may be given, to extend the run)"
        )
    server = {**tables[SERVER], **(server or {})}  # a page-token: ServerSettings refuses it
    run_dir = run_dir.resolve()
    kept = kept_app(run_dir)
    if kept is not None:
        return _resume_app(run_dir, kept, num_rounds, server)
    if server.get("app"):
        raise ConfigError(
            f"{run_dir} holds a run of fedlb's own app, not of an app of yours: drop app "
            "(--app) to resume it"
        )
    try:
        checkpoint = load_checkpoint(run_dir)
        values = {**checkpoint.settings, "out-dir": str(run_dir), "resume": str(run_dir)}
        if num_rounds is not None:
            values["num-rounds"] = num_rounds
        run = RunConfig.from_mapping(values)  # run_server checks its data and keys
        check_resume(checkpoint, run.to_mapping(), run.num_rounds, run_dir)
    except CheckpointError as error:
        raise ConfigError(str(error)) from error
    if run.num_rounds <= checkpoint.round:  # else "rounds 6-5 to go", and a SuperLink
        raise ConfigError(
            f"{run_dir}: its checkpoint is of round {checkpoint.round}, the last of the "
            f"{run.num_rounds} rounds "
            + ("asked for" if num_rounds is not None else "the run was started with")
            + f": nothing is left to run; give --num-rounds above {checkpoint.round} to "
            "train it further"
        )
    listened = read_server_file(run_dir)
    settings = ServerSettings.from_mapping(
        {
            **{k: listened[k] for k in ("host", "port") if k in listened},
            **(server or {}),
            "out-dir": str(run_dir),
        }
    )
    return settings, run


def _resume_app(
    run_dir: Path,
    kept: tuple[UserApp, int],
    num_rounds: int | None,
    server: Mapping[str, Any],
) -> tuple[ServerSettings, RunConfig]:
    """resume_settings of a run of a user's app: the app and run-config it was started
    with (its app.json), its silos, where its server listened."""
    app, num_silos = kept
    if num_rounds is not None:
        raise ConfigError(
            f"{run_dir} is a run of your app, whose rounds are its own run config's: it "
            "goes on to the rounds it was started with (drop --num-rounds)"
        )
    given = str(server.get("app", ""))
    if (given or server.get("run-config")) and not same_app(
        given or str(app.folder), str(server.get("run-config", "")), app
    ):
        raise ConfigError(
            f"{run_dir} goes on with the app and run-config it was started with ({app.folder}, "
            f"{app.overrides or 'no overrides'}; kept in its {APP_FILE}): drop app and "
            "run-config, or give those"
        )
    try:
        checkpoint = load_checkpoint(run_dir)  # a CheckpointError names what is missing
    except CheckpointError as error:
        raise ConfigError(str(error)) from error
    run = RunConfig.from_mapping(
        {"num-silos": num_silos, "out-dir": str(run_dir), "resume": str(run_dir)}
    )
    if checkpoint.round >= checkpoint.num_rounds:
        raise ConfigError(
            f"{run_dir}: its checkpoint is of round {checkpoint.round} of "
            f"{checkpoint.num_rounds}, the run's last: nothing is left to run"
        )
    listened = read_server_file(run_dir)
    settings = ServerSettings.from_mapping(
        {
            **{k: listened[k] for k in ("host", "port") if k in listened},
            **server,
            "out-dir": str(run_dir),
            "app": str(app.folder),
            "run-config": "",  # run_server takes the overrides as kept, parsed
        }
    )
    return settings, run


def start_silo(
    settings: SiloSettings,
    connect_timeout: float | None = 60.0,
    on_wait: Callable[[str], None] | None = None,
) -> FlowerProcess:
    """Start the silo's SuperNode against its server and return once it has connected
    (its `.stop()` ends it, `.alive()` says whether it still runs, `.log_path` is its log).
    The silo trains whenever the server's run sends it work; it stays up between runs.
    With `settings.app`, its warm server imports that app's clientapp module once, from
    the app's folder (a module that trains or touches CUDA at import leaves the silo
    running cold, as its log says: fedlb.deploy.fork_safety).

    Raises ConfigError, before anything starts, for settings it cannot run with (its own
    data file is read and checked), and JoinError, with the reason, when the server
    refuses it (a certificate its CA did not sign, no or an unknown key), its SuperNode
    exits, or it has not connected in `connect_timeout` seconds (None: wait for ever). A
    key the server does not know yet is tried again, the SuperNode restarted with backoff
    until `connect_timeout`: a server registers its silos' keys only once its SuperLink is
    up, and Flower gives up for good on the first refusal. `on_wait` is told how it stands
    while it waits."""
    settings.check()
    work = settings.work_dir
    ca = Path(settings.root_certificates).resolve() if settings.root_certificates else None
    key = Path(settings.auth_key).resolve() if settings.auth_key else None
    began = time.monotonic()
    deadline = None if connect_timeout is None else began + connect_timeout
    pause = FIRST_PAUSE_S
    app = settings.user_app()
    while True:
        node = None
        try:
            node = start_supernode(
                work,
                settings.name,
                settings.server,
                settings.node_config(),
                settings.port or None,  # None: a free one (start_supernode finds it)
                root_certificates=ca,
                extra_args=["--auth-supernode-private-key", str(key)] if key else None,
                warm=settings.warm,
                resident=settings.resident,
                # a user's app: its ClientApp's module imported once from its folder
                preload=[app.clientapp_module] if app else (),
                import_paths=[app.folder] if app else (),
            )
            wait_joined(
                node, settings.server, ca is not None, connect_timeout, on_wait, since=began
            )
            return node
        except JoinError as error:
            if node is not None:
                node.stop()
            if not error.unregistered or (
                deadline is not None and time.monotonic() + pause >= deadline
            ):
                raise
            if on_wait is not None:  # Flower's reason once, then how long it waits
                why = str(error) if pause == FIRST_PAUSE_S else "refused again"
                on_wait(
                    f"{why}; waiting for the server to register this silo's key, "
                    f"trying again in {pause:.0f} s"
                )
        except BaseException:  # Ctrl-C, SIGTERM turned into an exception: stop it too
            if node is not None:
                node.stop()
            raise
        time.sleep(pause)
        pause = min(2 * pause, 15.0)


FIRST_PAUSE_S = 2.0  # before a silo refused as unregistered starts its SuperNode again
