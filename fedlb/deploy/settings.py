"""Deployment settings: what `run_server` and `start_silo` take.

Each comes from a TOML file (server/server.toml: [server] and [run]; silos/silo-N.toml:
[silo]) with the caller's own values on top, and is checked whole before any process
starts: an unknown key, a wrong type, a missing file or an impossible value is a
ConfigError that names the key and what to do. The CLI only turns its flags into the
`overrides` of these readers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from fedlb.data import load_npz
from fedlb.flower.identity import silo_label
from fedlb.flower.protocol import (
    EMULATED_CLOCKS,
    NODE_DATA_PATH,
    NODE_DEVICE,
    NODE_EMULATED_CLOCK,
    NODE_EMULATED_CURVE,
    NODE_EMULATED_SPEED,
    NODE_HE_CONTEXT,
    NODE_NUM_PARTITIONS,
    NODE_PARTITION_ID,
    NODE_THREADS,
)
from fedlb.security import TlsError, TlsFiles
from fedlb.training import BASE_SPEED

from .resident import RESIDENT_SETTINGS
from .run_config import ConfigError, RunConfig, dataclass_arguments, read_toml
from .silo_app import SiloConfigError, node_settings
from .task import check_partition
from .user_app import APP_RUN_SETTINGS, UserApp

SERVER, RUN, SILO = "server", "run", "silo"  # the settings files' sections


def read_sections(path: Path, sections: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """A settings file's tables by section (every section present, empty where the file
    has none); an unknown section or a section that is not a table is a ConfigError.
    The keys inside are checked by the settings they are for (`dataclass_arguments`)."""
    data = read_toml(path)
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {unknown}; expected {sorted(sections)}")
    tables: dict[str, dict[str, Any]] = {}
    for section in sections:
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{section}] must be a table")
        tables[section] = table
    return tables


@dataclass(frozen=True)
class ServerSettings:
    """Where and how the server runs (the run itself: a RunConfig). Keys in files: '-'.

    Attributes:
        host: where the SuperLink listens (a routable address for silos on other machines).
        port: its one port for Flower's Fleet, Control and Runtime APIs (0: a free one, chosen
            by the OS when the SuperLink starts: `run_server` reports it in ServerReady.address
            and keeps it in out_dir/server.json, where `resume_settings` finds it).
        out_dir: the results folder ('' : runs/<date-time> under the working directory).
        run_timeout: give up on the whole run after this many seconds (0: never).
        certs: TLS, the folder `fedlb certs` wrote (ca.crt, server.crt, server.key); '' : plain.
        silo_keys: a folder of silos' public keys (`fedlb silo-key`'s *.pub): only those silos
            may join (needs certs); '' : any silo that reaches the server.
        warm: the run's ServerApp starts warm: torch, flwr and fedlb's ServerApp imported once,
            a fork per run (fedlb.deploy.warm); false: Flower's own fresh process per run.
        page, page_host, page_port: `fedlb server`'s live page (fedlb.page): served or not,
            where it listens (this machine only by default; another address needs a token)
            and its port (0: a free one). Its token is a secret and never comes from a file:
            --page-token or FEDLB_PAGE_TOKEN.
        app: a user's own Flower app to run instead of fedlb's: the folder of its
            pyproject.toml ('' : fedlb's own app, on the [run] settings). Its settings are
            its own run config; of fedlb's [run] settings only num-silos (the silos to wait
            for before it is submitted) and out-dir apply (fedlb.deploy.user_app).
        run_config: with app, overrides of the app's run config in Flower's `--run-config`
            syntax ("num-server-rounds=5 learning-rate=0.01").
    """

    host: str = "127.0.0.1"
    port: int = 8000
    out_dir: str = ""
    run_timeout: float = 0.0
    certs: str = ""
    silo_keys: str = ""
    warm: bool = True
    page: bool = True
    page_host: str = "127.0.0.1"
    page_port: int = 0
    app: str = ""
    run_config: str = ""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ServerSettings:
        no_page_token(values)
        settings = cls(**dataclass_arguments(cls, values, "[server] key"))
        settings.check()
        return settings

    def check(self) -> None:
        for key, port in (("port", self.port), ("page-port", self.page_port)):
            if not 0 <= port <= 65535:
                raise ConfigError(f"[server] {key} must be in 0..65535, got {port}")
        if not self.page_host.strip():
            raise ConfigError("[server] page-host is empty: give an address (127.0.0.1: here)")
        if not (math.isfinite(self.run_timeout) and self.run_timeout >= 0):
            raise ConfigError(
                f"[server] run-timeout must be >= 0 (0: none), got {self.run_timeout}"
            )
        check_out_dir(Path(self.out_dir or "runs"), "out-dir")  # '' : runs/<date-time>
        self.tls()
        self.registered_keys()
        if self.run_config and not self.app:
            raise ConfigError(
                "[server] run-config overrides the run config of your own app: give its "
                "folder too (--app DIR); fedlb's own app takes its settings as flags or [run]"
            )
        self.user_app()

    def user_app(self) -> UserApp | None:
        """The user's app this server runs (None: fedlb's own), checked: a ConfigError
        for a folder that holds no Flower app or a run-config it cannot take."""
        return UserApp.read(self.app, self.run_config) if self.app else None

    def results_dir(self) -> Path:
        """out_dir, or a new runs/<date-time> when it is ''."""
        return Path(self.out_dir or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))

    def tls(self) -> TlsFiles | None:
        if not self.certs:
            return None
        try:
            files = TlsFiles.from_folder(Path(self.certs).resolve())
            files.check(self.host)  # before a SuperLink starts that no silo would accept
            return files
        except TlsError as error:
            raise ConfigError(str(error)) from error

    def registered_keys(self) -> list[Path] | None:
        if not self.silo_keys:
            return None
        keys = sorted(Path(self.silo_keys).resolve().glob("*.pub"))
        if not keys:
            raise ConfigError(f"silo-keys {self.silo_keys}: no *.pub files (fedlb silo-key)")
        if not self.certs:
            raise ConfigError("silo-keys needs certs: keys are only worth it over TLS")
        return keys


def check_out_dir(path: Path, what: str = "out-dir") -> None:
    """Refuse, before anything starts, a folder that results cannot be written to: a file,
    a path through a file, or a place without write permission (ConfigError naming `what`
    and the fix). Nothing is created: the run makes the folder when it starts."""
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{what} {path} is a file, not a folder: give a folder")
        there = path.absolute()
        while not there.exists():  # the folder it would be made in
            there = there.parent
        if not there.is_dir():
            raise ConfigError(f"{what} {path}: {there} is a file, not a folder: give a folder")
        if not os.access(there, os.W_OK | os.X_OK):
            raise ConfigError(
                f"{what} {path}: no permission to write in {there}; give a folder you can write to"
            )
    except OSError as error:  # e.g. a parent folder it may not look into
        raise ConfigError(f"{what} {path} cannot be used: {error.strerror or error}") from error


def no_page_token(values: Mapping[str, Any], path: Path | None = None) -> None:
    """A ConfigError for a page token among settings: a secret, never read from a file."""
    if "page-token" in values:
        raise ConfigError(
            f"{path or 'settings'}: [server] page-token: the page's token is a secret and is "
            "not read from a settings file; give it with --page-token or FEDLB_PAGE_TOKEN"
        )


def server_settings(
    path: Path | None = None,
    server: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
) -> tuple[ServerSettings, RunConfig]:
    """The settings of `path` ([server] and [run] tables; None: none) with `server` and
    `run` values on top, every key checked (the run's data split and HE key file are
    checked by `run_server`, before it starts anything)."""
    tables = read_sections(path, (SERVER, RUN)) if path is not None else {SERVER: {}, RUN: {}}
    no_page_token(tables[SERVER], path)
    in_file(path, ServerSettings, tables[SERVER], "[server] key")
    in_file(path, RunConfig, tables[RUN], "setting")
    settings = ServerSettings.from_mapping({**tables[SERVER], **(server or {})})
    if settings.app:
        meaningless = sorted((set(tables[RUN]) | set(run or {})) - APP_RUN_SETTINGS)
        if meaningless:
            raise ConfigError(
                f"{', '.join(meaningless)}: settings of fedlb's own app, which mean nothing "
                "to yours under app (it takes its settings from its pyproject.toml and "
                'run-config, e.g. --run-config "num-server-rounds=5"); drop them (of '
                "fedlb's run settings only num-silos, the silos to wait for, and out-dir apply)"
            )
    config = RunConfig.from_mapping({**tables[RUN], **(run or {})})
    if config.out_dir and not settings.out_dir:  # a file's [run] out-dir is the results'
        check_out_dir(Path(config.out_dir), "out-dir")
    return settings, config


def in_file(path: Path | None, cls: type, table: Mapping[str, Any], what: str) -> None:
    """A file's keys checked on their own first, so that an error names the file."""
    if path is not None:
        try:
            dataclass_arguments(cls, table, what)
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from error


def checked_run(values: Mapping[str, Any]) -> RunConfig:
    """A RunConfig whose dataset split and HE context file are checked too (the run's
    ServerApp loads the context again in its own process: its path is made absolute)."""
    config = RunConfig.from_mapping(values)
    check_partition(config)
    if config.he_context:
        path = Path(config.he_context).resolve()
        he_key_fingerprint(path, "server")
        config = dataclasses.replace(config, he_context=str(path))
    return config


def he_key_fingerprint(path: Path, role: str) -> str:
    """The key file's fingerprint, or a ConfigError naming the file and the fix. A file
    is loaded once while unchanged: contexts are megabytes, and a silo's settings are
    checked, fingerprinted and checked again before its SuperNode starts."""
    path = path.resolve()
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        stamp = -1  # load_context says what is wrong with it
    return _fingerprint(str(path), "server" if role == "server" else "silo", stamp)


@functools.lru_cache(maxsize=8)
def _fingerprint(path: str, role: Literal["server", "silo"], stamp: int) -> str:
    from fedlb.he import HeKeyError, fingerprint, load_context

    try:
        return fingerprint(load_context(Path(path), role))
    except HeKeyError as error:
        raise ConfigError(str(error)) from error


def check_silo_data(path: Path) -> None:
    """A silo's own data file, read and checked as its ClientApp will read it (load_npz),
    or a ConfigError naming the file, what is wrong and what to do. A file is read once
    while unchanged: a silo's settings are checked more than once before it starts."""
    try:
        stat = path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        stamp = (-1, -1)  # load_npz says what is wrong with it
    _read_silo_data(str(path), stamp)


@functools.lru_cache(maxsize=8)
def _read_silo_data(path: str, stamp: tuple[int, int]) -> None:
    try:
        load_npz(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"data-path {error}") from None


@dataclass(frozen=True)
class SiloSettings:
    """One silo's SuperNode. Keys in files: '-'.

    Attributes:
        server: the server's host:port.
        partition_id, num_partitions: this silo's part of the federation's dataset; or
        data_path: its own data (an .npz with x and y) instead.
        emulated_speed: samples/s this silo emulates by padding its steps with sleep (0: its
            real speed); or slowdown: emulate a machine this many times slower than base_speed.
        emulated_curve: or a measured step-time curve to pad its steps to ('' : none):
            "h200/cnn" (fedlb.training's STEP_CURVES), "h200/cnn*20" (its times × 20). One
            model's curve: the run must train that model.
        emulated_clock: the clock the emulation runs on: measured (steps padded with sleep,
            the default) or model (no sleeping: the silo reports τ·B/v or the curve's time,
            deterministic, for tests and studies); '' : measured.
        threads: torch threads (0: torch's default; 1 when silos share a machine).
        device: where it trains: auto (its GPU when it has one), cpu, cuda or cuda:N; HE and
            the upload stay on the CPU.
        port: the SuperNode's local API port (0: a free one).
        workdir: its logs and Flower home ('' : runs/<silo name>).
        he_context: the silos' secret CKKS context (`fedlb keygen`'s silo.context).
        root_certificates: TLS, the federation's CA certificate (`fedlb certs`' ca.crt).
        auth_key: this silo's private key (`fedlb silo-key`) when the server checks keys.
        warm: its ClientApps start warm: torch and fedlb imported once, a fork per message
            (fedlb.deploy.warm); false: Flower's own fresh process per message.
        resident: auto, on or off: a warm silo runs its ClientApps one after another in one
            resident worker, which keeps its CUDA context and model between rounds
            (fedlb.deploy.resident), instead of a fork per message; auto: where it trains on a
            GPU (device cuda, cuda:N, or auto on a machine with one). It gives up the fork's
            isolation of one message from the next, cheap on a CPU.
        app: the folder of the user's own Flower app the server runs (`fedlb server --app`):
            its warm server imports the app's clientapp module from there once, so every
            forked ClientApp finds it imported; '' : fedlb's own app. The ClientApp that
            runs is the FAB's the server submits (Flower installs it): the folder must be the
            same app (`fedlb silo` prints its FAB's digest beside the server's).
    """

    server: str = "127.0.0.1:8000"
    partition_id: int | None = None
    num_partitions: int | None = None
    data_path: str = ""
    emulated_speed: float = 0.0
    slowdown: float | None = None
    emulated_curve: str = ""
    base_speed: float = BASE_SPEED
    threads: int = 0
    device: str = "auto"
    port: int = 0
    workdir: str = ""
    he_context: str = ""
    root_certificates: str = ""
    auth_key: str = ""
    warm: bool = True
    resident: str = "auto"
    emulated_clock: str = ""
    app: str = ""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SiloSettings:
        settings = cls(**dataclass_arguments(cls, values, "[silo] key"))
        settings.check()
        return settings

    @property
    def name(self) -> str:
        """Its label: silo-<partition id>, or silo-<its data file's name>."""
        if self.partition_id is not None:
            return silo_label(self.partition_id)
        return silo_label(Path(self.data_path).stem)

    @property
    def work_dir(self) -> Path:
        """Its logs and Flower home, resolved: workdir, or runs/<its name>."""
        return Path(self.workdir or Path("runs") / self.name).resolve()

    @property
    def speed(self) -> float:
        """Samples/s it emulates (0: real speed or a curve)."""
        if self.emulated_speed == 0.0 and self.slowdown is not None:
            return self.base_speed / self.slowdown
        return self.emulated_speed

    @property
    def emulation(self) -> str:
        """What it emulates, and on which clock, in words (consoles)."""
        clock = (
            "clock: model, no sleeping"
            if self.emulated_clock == "model"
            else "clock: measured, sleep-padded"
        )
        if self.emulated_curve:
            return f"emulated curve {self.emulated_curve} ({clock})"
        if self.speed:
            return f"emulated {self.speed:.0f} samples/s ({clock})"
        return "real speed"

    def check(self) -> None:
        if self.data_path:
            if not Path(self.data_path).is_file():
                raise ConfigError(f"data-path {self.data_path} is not a file")
            check_silo_data(Path(self.data_path))  # now, not when its first message fails
        elif self.partition_id is None or self.num_partitions is None:
            raise ConfigError(
                "a silo needs partition-id and num-partitions, or data-path (or a config file)"
            )
        if self.num_partitions is not None and self.num_partitions < 1:
            raise ConfigError(
                f"num-partitions must be >= 1 (the server's num-silos), got {self.num_partitions}"
            )
        if self.partition_id is not None and self.partition_id < 0:
            raise ConfigError(
                f"partition-id must be >= 0 (ids count from 0), got {self.partition_id}"
            )
        if (
            self.partition_id is not None
            and self.num_partitions is not None
            and self.partition_id >= self.num_partitions
        ):
            raise ConfigError(
                f"partition-id {self.partition_id} is outside 0..{self.num_partitions - 1} "
                f"(num-partitions {self.num_partitions}; ids count from 0): give a "
                "partition-id below num-partitions, or the server's num-silos as num-partitions"
            )
        host, colon, port = self.server.rpartition(":")
        if not (host and colon and port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigError(
                f"server must be the fedlb server's host:port (e.g. 10.0.0.5:8000), got "
                f"{self.server!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535 (0: a free one), got {self.port}")
        if self.slowdown is not None and not (math.isfinite(self.slowdown) and self.slowdown >= 1):
            raise ConfigError(f"slowdown must be >= 1 and finite, got {self.slowdown}")
        if self.resident not in RESIDENT_SETTINGS:
            raise ConfigError(
                f"resident must be one of {', '.join(RESIDENT_SETTINGS)}, got {self.resident!r}"
            )
        if not (math.isfinite(self.base_speed) and self.base_speed > 0):
            raise ConfigError(f"base-speed must be > 0, got {self.base_speed}")
        if not (math.isfinite(self.emulated_speed) and self.emulated_speed >= 0):
            raise ConfigError(f"emulated-speed must be >= 0, got {self.emulated_speed}")
        if self.emulated_curve and (self.emulated_speed or self.slowdown is not None):
            raise ConfigError(
                f"emulated-curve {self.emulated_curve!r} and emulated-speed or slowdown: a "
                "silo emulates a speed or a step-time curve, not both"
            )
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        if self.emulated_clock and self.emulated_clock not in EMULATED_CLOCKS:
            raise ConfigError(
                f"emulated-clock must be one of {', '.join(EMULATED_CLOCKS)}, got "
                f"{self.emulated_clock!r}"
            )
        self.user_app()
        check_out_dir(Path(self.workdir or "runs"), "workdir")  # '' : runs/<silo name>
        if self.root_certificates and not Path(self.root_certificates).is_file():
            raise ConfigError(
                f"root-certificates {self.root_certificates} is not a file: fedlb certs makes "
                "ca.crt"
            )
        if self.auth_key and not Path(self.auth_key).is_file():
            raise ConfigError(f"auth-key {self.auth_key} is not a file: fedlb silo-key makes it")
        if self.he_context:
            he_key_fingerprint(Path(self.he_context), "silo")
        try:  # what the silo's ClientApp will check of its node config, checked now
            node_settings(self.node_config())
        except SiloConfigError as error:
            raise ConfigError(str(error)) from error

    def user_app(self) -> UserApp | None:
        """The user's app whose ClientApp this silo runs warm (None: fedlb's own)."""
        return UserApp.read(self.app) if self.app else None

    def he_fingerprint(self) -> str | None:
        """The fingerprint of its HE key (to compare with the server's), None without HE."""
        return he_key_fingerprint(Path(self.he_context), "silo") if self.he_context else None

    def node_config(self) -> dict[str, Any]:
        """Its SuperNode's --node-config: what the silo's ClientApp reads (silo.py)."""
        config: dict[str, Any] = {
            NODE_EMULATED_SPEED: self.speed,
            NODE_THREADS: self.threads,
            NODE_DEVICE: self.device,
        }
        if self.partition_id is not None:
            config[NODE_PARTITION_ID] = self.partition_id
        if self.num_partitions is not None:
            config[NODE_NUM_PARTITIONS] = self.num_partitions
        if self.data_path:
            config[NODE_DATA_PATH] = str(Path(self.data_path).resolve())
        if self.he_context:
            config[NODE_HE_CONTEXT] = str(Path(self.he_context).resolve())
        if self.emulated_curve:
            config[NODE_EMULATED_CURVE] = self.emulated_curve
        if self.emulated_clock:
            config[NODE_EMULATED_CLOCK] = self.emulated_clock
        return config


def silo_settings(
    path: Path | None = None, overrides: Mapping[str, Any] | None = None
) -> SiloSettings:
    """The [silo] settings of `path` (None: none) with `overrides` on top, checked."""
    table = read_sections(path, (SILO,))[SILO] if path is not None else {}
    in_file(path, SiloSettings, table, "[silo] key")
    return SiloSettings.from_mapping({**table, **(overrides or {})})


def local_silos(
    slowdowns: list[float],
    base_speed: float = BASE_SPEED,
    he_context: Path | None = None,
    server: str = "",
    warm: bool = True,
    curves: Sequence[str] = (),
) -> list[SiloSettings]:
    """One silo per slowdown on this machine (a demo): partition i of len(slowdowns), one
    torch thread each, emulated speed base_speed / slowdown; or, with `curves` (and no
    slowdowns), one silo per step-time curve ("h200/cnn", "cpu1/cnn*20"), emulating it.
    `server` '': the default (local silos join the federation that starts them, wherever
    it listens)."""
    if curves and slowdowns:
        raise ConfigError("local silos emulate slowdowns or step-time curves, not both")
    emulations: list[dict[str, Any]] = (
        [{"emulated-curve": curve} for curve in curves]
        if curves
        else [{"slowdown": float(s), "base-speed": float(base_speed)} for s in slowdowns]
    )
    return [
        SiloSettings.from_mapping(
            {
                **({"server": server} if server else {}),
                "partition-id": i,
                "num-partitions": len(emulations),
                **emulation,
                "threads": 1,
                "warm": warm,
                **({"he-context": str(he_context)} if he_context is not None else {}),
            }
        )
        for i, emulation in enumerate(emulations)
    ]
