"""A federation on this machine's processes: a SuperLink, optional local silos, one run.

`fedlb server` and `fedlb demo` use it; so do the end-to-end tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from fedlb.flower import RUN_FILES, RoundRecord, records_from_json_lines
from fedlb.security import TlsFiles

from . import processes
from .control import Control
from .errors import DeployError
from .gate import CONTROL_HOST
from .ray_nodes import RAY_ENV

log = logging.getLogger("fedlb.flower")

STATUS_EVERY_S = 0.25  # how often a run's status is asked (one small HTTP call)
LOG_DRAIN_S = 2.0  # how long a finished run's log may take to arrive in full
JOIN_TIMEOUT_S = 600.0  # silos a user's app waits for: as long as fedlb's own (Joining)
WAIT_GRACE_S = 30.0  # beyond it, for the wait app's own start and end


def log_tail(path: Path | None, lines: int = 12) -> str:
    """The last `lines` lines of a run's ServerApp log ('' : none)."""
    if path is None:
        return ""
    try:
        return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-lines:])
    except OSError:
        return ""


def last_error(path: Path | None) -> str:
    """A failed run's reason as its ServerApp log says it: the exception's line, else its
    last line."""
    tail = [line.strip() for line in log_tail(path, 40).splitlines() if line.strip()]
    for line in reversed(tail):
        if "Error" in line.split(":", 1)[0] or "Exception" in line.split(":", 1)[0]:
            return line
    return tail[-1] if tail else "(its log is empty)"


@dataclass
class RunOutcome:
    """How a run ended: Flower's status, and the rounds it recorded (this session's:
    a resumed run's start at `first_round`)."""

    run_id: str
    status: str  # as `flwr ls` says: finished:completed, finished:failed, ...
    records: list[RoundRecord] = field(default_factory=list)
    out_dir: Path | None = None
    log_path: Path | None = None
    first_round: int = 1
    num_rounds: int | None = None  # rounds asked for (None: not known, not checked)
    app: Path | None = None  # the app submitted (None: fedlb's own)

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def problem(self) -> str | None:
        """Why the run failed (None: it did not): Flower says it did not complete, or
        it completed without training every round asked for (no silo's update came)."""
        if self.status != "finished:completed":
            return f"it ended as {self.status}"
        untrained = [r for r in self.records if not r.silos]
        if untrained:
            why = sorted({line for r in untrained for line in r.failed})
            return (
                f"{len(untrained)} of {len(self.records)} rounds trained nothing (rounds "
                f"{', '.join(str(r.round) for r in untrained)}; no silo sent a usable "
                f"update{': ' + '; '.join(why[:5]) if why else ''})"
            )
        if self.num_rounds is not None:
            missing = sorted(
                set(range(self.first_round, self.num_rounds + 1)) - {r.round for r in self.records}
            )
            if missing:
                return f"rounds {missing} have no record in {RUN_FILES.rounds}"
        return None

    @property
    def log_tail(self) -> str:
        """The last lines of the run's ServerApp log ('' : none): a failed run's reason
        in its own words."""
        return log_tail(self.log_path)

    @property
    def model_path(self) -> Path | None:
        """The final model the run wrote (encrypted under HE), if it wrote one."""
        if self.out_dir is None:
            return None
        for name in (RUN_FILES.encrypted_model, RUN_FILES.model):
            if (self.out_dir / name).exists():
                return self.out_dir / name
        return None


class RoundWatcher:
    """Reads rounds.jsonl as the ServerApp appends to it; yields each round from
    `first_round` on once all its lines are there, each round once."""

    def __init__(self, path: Path, first_round: int = 1) -> None:
        self.path = path
        self.first_round = first_round
        self.offset = 0
        self.buffer: list[str] = []
        self.shown: set[int] = set()

    def poll(self) -> list[RoundRecord]:
        if self.path.exists():
            if self.path.stat().st_size < self.offset:  # rewritten (a resume trims it)
                self.offset, self.buffer = 0, []
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offset += len(complete)
            self.buffer += [line for line in complete.decode().splitlines() if line.strip()]
        ready = records_from_json_lines(self.buffer, complete_only=True)
        new = [r for r in ready if r.round >= self.first_round and r.round not in self.shown]
        self.shown |= {r.round for r in new}
        return new


class Federation:
    """SuperLink (and local silos) for the life of a `with` block; all stopped at exit.

    Args:
        workdir: logs and Flower homes go here.
        host: where the SuperLink listens.
        port: its port (None: a free one).
        tls: the SuperLink's certificate files (`fedlb certs`); local silos and the `flwr`
            CLI then trust its CA. None: plain HTTP (loopback tests, demos).
        silo_keys: public keys of the silos allowed to join (`fedlb silo-key`'s .pub
            files): SuperNode authentication is on and only these are registered. None:
            any SuperNode that reaches the SuperLink may join.
        database: the SuperLink's state file (SQLite). A SuperLink restarted on the same
            file knows the silos' node ids, so running SuperNodes carry on under the ids a
            checkpoint's balancer state is keyed by. None: state in memory.
        simulation: a simulation SuperLink: runs bring their own virtual SuperNodes
            (`run(federation_config=...)`), on Flower's Simulation Engine (Ray).
        ray_address: with `simulation`, the Ray cluster every run joins (host:port of its
            head: `start_ray_head`, or a cluster of several machines). None: each run
            starts a private Ray of its own (fedlb.deploy.ray_nodes says why sharing one
            is faster).
        warm: the SuperLink's ServerApps (simulations) start warm: torch, flwr, (Ray) and
            fedlb's app imported once, a fork per run (fedlb.deploy.warm); False:
            Flower's own process per run.
        env: more environment for the SuperLink, which its ServerApps inherit (a user's
            app run by `fedlb server --app`: the run's folder, fedlb.deploy.user_app).
    """

    def __init__(
        self,
        workdir: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        tls: TlsFiles | None = None,
        silo_keys: list[Path] | None = None,
        database: Path | None = None,
        simulation: bool = False,
        ray_address: str | None = None,
        warm: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if ray_address is not None and not simulation:
            raise ValueError("ray_address is for a simulation SuperLink (simulation=True)")
        self.workdir = workdir
        self.simulation = simulation
        self.warm = warm
        self.ray_address = ray_address
        self.database = database
        self.host = host
        self.port = port
        self.tls = tls
        self.silo_keys = silo_keys
        self.env = dict(env or {})
        self.link: processes.FlowerProcess | None = None
        self.silos: dict[str, processes.FlowerProcess] = {}
        self.home = workdir / "home-cli"
        self.control: Control | None = None

    @property
    def address(self) -> str:
        """Where silos reach the SuperLink (its Fleet API)."""
        assert self.link is not None
        return f"{self.host}:{self.link.port}"

    @property
    def control_address(self) -> str:
        """Its Control API: loopback on this machine only (fedlb.deploy.gate)."""
        assert self.link is not None
        assert self.link.control_port is not None
        return f"{CONTROL_HOST}:{self.link.control_port}"

    def __enter__(self) -> Federation:
        self.workdir.mkdir(parents=True, exist_ok=True)
        extra = ["--enable-supernode-auth"] if self.silo_keys is not None else []
        if self.database is not None:
            extra += ["--database", str(self.database)]
        env = dict(self.env)
        if self.simulation:
            extra.append("--simulation")
            env.update(RAY_ENV)
            if self.ray_address is not None:  # inherited by every run's flwr-simulation
                env["RAY_ADDRESS"] = self.ray_address
        self.link = processes.start_superlink(
            self.workdir,
            self.host,
            self.port,
            env=env or None,
            extra_args=extra,
            tls=self.tls,
            warm=self.warm,
        )
        try:
            processes.write_connection(self.home, self.control_address)
            self.control = Control(self.control_address)
            for key in self.silo_keys or []:
                self.control.register_supernode(key)
                log.info("registered silo key %s", key)
        except BaseException:  # __exit__ does not run when __enter__ fails
            if self.control is not None:
                self.control.close()
            self.link.stop()
            raise
        log.info(
            "SuperLink listening on %s, its Control API on %s (pid %d)",
            self.address,
            self.control_address,
            self.link.pid,
        )
        return self

    def add_silo(
        self,
        name: str,
        node_config: Mapping[str, Any],
        auth_key: Path | None = None,
        warm: bool = True,
    ) -> processes.FlowerProcess:
        """A SuperNode on this machine (a demo or test silo); `auth_key`: its private key
        when SuperNode authentication is on; `warm` (the default, as for `fedlb silo`):
        its ClientApps start warm and its SuperNode pulls promptly (fedlb.deploy.warm),
        else Flower's own process per message."""
        return self.add_silos({name: node_config}, {name: auth_key} if auth_key else None, warm)[0]

    def add_silos(
        self,
        node_configs: Mapping[str, Mapping[str, Any]],
        auth_keys: Mapping[str, Path] | None = None,
        warm: bool = True,
        preload: Sequence[str] = (),
        resident: str = "auto",
    ) -> list[processes.FlowerProcess]:
        """`add_silo` for several silos (name -> node config, name -> private key), all
        started before any is waited for: their start-ups (torch imported, the SuperNode
        up) overlap; `preload`: more modules their warm servers import once. If one
        fails, those started here are stopped and the error raised."""
        ca = self.tls.ca if self.tls is not None else None
        launched: list[processes.FlowerProcess] = []
        ports: set[int] = {self.link.port} if self.link is not None else set()
        try:
            for name, node_config in node_configs.items():
                key = (auth_keys or {}).get(name)
                node = processes.launch_supernode(
                    self.workdir,
                    name,
                    self.address,
                    node_config,
                    root_certificates=ca,
                    extra_args=["--auth-supernode-private-key", str(key)] if key else None,
                    warm=warm,
                    preload=preload,
                    resident=resident,
                    avoid=ports,  # each its own local API, though none is bound yet
                )
                launched.append(node)
                ports.add(node.port)
            for node in launched:
                processes.supernode_ready(node)
        except BaseException:
            for node in launched:
                node.stop()
            raise
        for name, node in zip(node_configs, launched, strict=True):
            self.silos[name] = node
        return launched

    def run(
        self,
        run_config: Mapping[str, Any],
        on_round: Callable[[RoundRecord], None] | None = None,
        timeout: float | None = None,
        app: Path | None = None,
        federation_config: Mapping[str, Any] | None = None,
        first_round: int = 1,
        out_dir: Path | None = None,
    ) -> RunOutcome:
        """Submit fedlb's app (or `app`), follow its rounds, and return how it ended.
        `federation_config`: a simulation's virtual SuperNodes and their resources;
        `first_round`: the first round this run trains (a resumed run's is after its
        checkpoint): earlier rounds in rounds.jsonl are not reported again; `out_dir`:
        where the run writes rounds.jsonl (None: run_config's out-dir, if any)."""
        if out_dir is None and run_config.get("out-dir"):
            out_dir = Path(str(run_config["out-dir"]))
        assert self.control is not None, "run() inside `with Federation(...)`"
        control = self.control
        if self.database is not None:
            for old in control.stop_unfinished_runs():
                log.warning("stopped run %s, left unfinished by an earlier server", old)
        run_id = control.submit_run(app or processes.app_dir(), run_config, federation_config)
        log_path = self.workdir / f"serverapp-{run_id}.log"
        streamer = control.stream_log(run_id, log_path)
        watcher = RoundWatcher(out_dir / RUN_FILES.rounds, first_round) if out_dir else None
        # fedlb's own app's rounds (a user's app names its own: its checkpoint says them)
        asked_rounds = run_config.get("num-rounds") if app is None else None
        outcome = RunOutcome(
            run_id,
            "unknown",
            out_dir=out_dir,
            log_path=log_path,
            first_round=first_round,
            num_rounds=int(asked_rounds) if isinstance(asked_rounds, int) else None,
            app=app,
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                if self.link is not None and not self.link.alive():
                    outcome.status = "superlink-died"
                    return outcome
                # one small Control API call (the SuperLink's own process, not a new one)
                outcome.status = control.run_status(run_id)
                if watcher is not None:
                    for record in watcher.poll():
                        outcome.records.append(record)
                        if on_round is not None:
                            on_round(record)
                if outcome.status.startswith("finished"):
                    return outcome
                if deadline is not None and time.monotonic() > deadline:
                    outcome.status = "timed-out"
                    return outcome
                time.sleep(STATUS_EVERY_S)
        finally:
            streamer.wait(LOG_DRAIN_S)  # the stream ends with the run: its last lines

    def wait_for_silos(self, count: int, timeout: float | None = None) -> None:
        """Return once `count` silos have joined the SuperLink: fedlb's wait app
        (fedlb.deploy.waiting) submitted and run to its end, before a user's app whose
        strategy would start with fewer. DeployError, with the reason, when they have not
        joined in `timeout` seconds (None: JOIN_TIMEOUT_S) or the SuperLink died."""
        assert self.control is not None, "wait_for_silos() inside `with Federation(...)`"
        limit = JOIN_TIMEOUT_S if timeout is None else timeout
        run_id = self.control.submit_run(
            processes.wait_app_dir(), {"num-silos": count, "join-timeout": float(limit)}
        )
        log_path = self.workdir / f"serverapp-{run_id}.log"
        streamer = self.control.stream_log(run_id, log_path)
        deadline = time.monotonic() + limit + WAIT_GRACE_S
        status = "unknown"
        try:
            while not status.startswith("finished"):
                if self.link is not None and not self.link.alive():
                    raise DeployError(
                        f"the SuperLink exited while waiting for {count} silos; its log "
                        f"({self.link.log_path}) ends with:\n{self.link.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    self.control.stop_run(run_id)
                    raise DeployError(f"{count} silos had not joined after {limit:.0f} s")
                time.sleep(STATUS_EVERY_S)
                status = self.control.run_status(run_id)
        finally:
            streamer.wait(LOG_DRAIN_S)
        if status != "finished:completed":
            raise DeployError(
                f"waiting for {count} silos ended as {status}: {last_error(log_path)}"
            )

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for node in self.silos.values():
            node.stop()
        if self.control is not None:
            self.control.close()
        if self.link is not None:
            self.link.stop()
