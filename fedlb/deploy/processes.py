"""Starting and stopping Flower's deployment processes: SuperLink, SuperNodes.

Every process gets its own FLWR_HOME, its own log file and its own process group, so it
can be stopped with everything it spawned (flower-superexec, flwr-serverapp,
flwr-clientapp) by PID, never by name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from fedlb.flower.protocol import NODE_DEVICE
from fedlb.security import TlsFiles

from .console_scripts import bin_dir, console_scripts, say_in_process
from .errors import DeployError
from .gate import CONTROL_HOST, gated_command
from .join import SUPERNODE_START, diagnose, supernode_join

# their home before: callers still import them from here (explicit re-exports)
from .leftovers import ENTRY_POINTS as ENTRY_POINTS
from .leftovers import GUARD
from .leftovers import SUPERLINK as SUPERLINK
from .leftovers import leftover as leftover
from .leftovers import process_start_time as process_start_time
from .leftovers import stop_leftover as stop_leftover
from .ports import check_port_free as check_port_free
from .ports import free_port as free_port
from .ports import unused_port as unused_port
from .resident import wanted as resident_wanted
from .warm import launcher_command, make_secret
from .warm import unsupported as warm_unsupported
from .warm_tasks import SERVERAPP, SIMULATION

log = logging.getLogger("fedlb.flower")
CONNECTION = "fedlb"  # the name of the SuperLink connection in FLWR_HOME/config.toml


class JoinError(DeployError):
    """A SuperNode that did not connect to its SuperLink: refused, exited, or not in time.
    `unregistered`: refused as a key the SuperLink does not know, which may pass once the
    server has registered it."""

    def __init__(self, message: str, unregistered: bool = False) -> None:
        super().__init__(message)
        self.unregistered = unregistered


def app_dir() -> Path:
    """The Flower app fedlb ships (fedlb/deploy/app): what `flwr run` submits."""
    return Path(str(files("fedlb.deploy").joinpath("app")))


def wait_app_dir() -> Path:
    """fedlb's wait app (fedlb/deploy/wait_app): submitted before a user's app, it ends
    once the federation's silos have joined (fedlb.deploy.waiting)."""
    return Path(str(files("fedlb.deploy").joinpath("wait_app")))


def flower_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a Flower process: its own FLWR_HOME, this venv's tools first on
    PATH (the SuperLink runs flower-superexec from PATH), no runtime `uv sync`."""
    env = dict(os.environ)
    env["FLWR_HOME"] = str(home)
    env["PATH"] = f"{bin_dir()}{os.pathsep}{env.get('PATH', '')}"
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    env.update(extra or {})
    return env


@dataclass
class FlowerProcess:
    """A started Flower process with its log. `stop()` ends its whole process group."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    port: int
    command: list[str] = field(default_factory=list)
    control_port: int | None = None  # a SuperLink's Control API, on 127.0.0.1 (fedlb.deploy.gate)

    @classmethod
    def start(
        cls,
        name: str,
        command: list[str],
        home: Path,
        log_path: Path,
        port: int,
        env: Mapping[str, str] | None = None,
    ) -> FlowerProcess:
        home.mkdir(parents=True, exist_ok=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Through the guard, which stops the group if this process dies without doing so.
        guarded = [sys.executable, str(GUARD), str(os.getpid()), *command]
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                guarded,
                env=flower_env(home, env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return cls(name, process, log_path, port, command)

    @property
    def pid(self) -> int:
        """The guard's PID: the leader of the process group (the process itself is its child)."""
        return self.process.pid

    def identity(self) -> dict[str, Any]:
        """What finds this process group again after the process that started it died
        (`stop_leftover`): its leader's PID and start time (a reused PID has another), and
        the port it serves, which its command line names."""
        return {
            "name": self.name,
            "pid": self.pid,
            "started": process_start_time(self.pid),
            "port": self.port,
        }

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_healthy(self, timeout: float = 60.0, ca: Path | None = None) -> None:
        """Wait until its HTTP API answers /health (HTTPS checked against `ca` when given);
        fail early, with its log, if it died."""
        context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
        scheme = "https" if ca is not None else "http"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise DeployError(
                    f"{self.name} exited with code {self.process.returncode} while starting; "
                    f"its log ({self.log_path}) ends with:\n{self.log_tail()}"
                )
            doors = [(scheme, self.port, context)]
            if self.control_port is not None:  # the SuperLink's control door: plain, loopback
                doors.append(("http", self.control_port, None))
            if all(_answers(*door) for door in doors):
                return
            time.sleep(0.1)
        raise DeployError(
            f"{self.name} did not become ready on port {self.port} in {timeout:.0f} s"
        )

    def healthy_or_stopped(self, timeout: float = 60.0, ca: Path | None = None) -> None:
        """`wait_healthy`, and when it fails, stop the process: it must not be left
        holding its port."""
        try:
            self.wait_healthy(timeout, ca)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to its process group, SIGKILL after `grace` seconds."""
        if self.alive():
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(5)
        else:
            self._signal(signal.SIGKILL)  # children of a dead leader may still run
            self.process.wait()

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, for fault tests)."""
        self._signal(signal.SIGKILL)
        self.process.wait(5)

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)


def _answers(scheme: str, port: int, context: ssl.SSLContext | None) -> bool:
    """Whether 127.0.0.1:`port` answers /health."""
    try:
        url = f"{scheme}://127.0.0.1:{port}/health"
        with urllib.request.urlopen(url, timeout=1, context=context) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_superlink(
    workdir: Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: list[str] | None = None,
    tls: TlsFiles | None = None,
    warm: bool = False,
    control_port: int | None = None,
) -> FlowerProcess:
    """A SuperLink serving the Fleet API (and the Runtime API to this machine) on `port`:
    HTTPS with `tls`, plain HTTP (Flower's --insecure) without; its Control API on
    127.0.0.1:`control_port` only (None: a free port; fedlb.deploy.gate says why).
    `warm`: its ServerApps (its simulations, with `--simulation` among `extra_args`)
    start warm (fedlb.deploy.warm: torch, flwr, Ray and fedlb's app imported once, a
    fork per run), else Flower's own SuperExec and a `flwr-serverapp` (`flwr-simulation`)
    process per run."""
    if port:
        check_port_free(host, port, "the SuperLink")
    port = port or free_port(host)
    if control_port:
        check_port_free(CONTROL_HOST, control_port, "the SuperLink's Control API")
    control_port = control_port or free_port(CONTROL_HOST)
    while control_port == port:
        control_port = free_port(CONTROL_HOST)
    security = (
        [
            "--ssl-ca-certfile",
            str(tls.ca),
            "--ssl-certfile",
            str(tls.cert),
            "--ssl-keyfile",
            str(tls.key),
        ]
        if tls is not None
        else ["--insecure"]
    )
    command = [
        "flower-superlink",  # Flower's entry point, run by fedlb's gate in its own process
        *security,
        "--disable-runtime-dependency-installation",
        "--host",
        host,
        "--port",
        str(port),
        *(extra_args or []),
    ]
    command = gated_command(control_port, command)
    if warm and (why := warm_unsupported()):
        log.warning("the server's ServerApps start cold (a process per run): %s", why)
        warm = False
    say_in_process("flower-superlink")
    if not warm:  # Flower's SuperLink starts these from PATH: refused now, not at the run
        runner = "flwr-simulation" if "--simulation" in command else "flwr-serverapp"
        console_scripts(
            ("flower-superexec", runner), "the server's runs start in Flower's own processes"
        )
    if warm:
        secret = make_secret(workdir / "home-superlink" / "superexec.secret")
        command = launcher_command(
            f"{CONTROL_HOST}:{control_port}",  # the runtime API, at the loopback door
            secret,
            command,
            task=SIMULATION if "--simulation" in command else SERVERAPP,
        )
    link = FlowerProcess.start(
        "SuperLink", command, workdir / "home-superlink", workdir / "superlink.log", port, env
    )
    link.control_port = control_port
    link.healthy_or_stopped(ca=tls.ca if tls is not None else None)
    return link


def node_config_text(values: Mapping[str, Any]) -> str:
    """Flower's --node-config syntax: space-separated TOML k=v. Strings are quoted (an
    unquoted one is refused), floats keep their point (Flower types a value by how it is
    written: 2 is an int, 2.0 a float)."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            parts.append(f"{key}={str(value).lower()}")
        elif isinstance(value, str):
            parts.append(f"{key}={json.dumps(value)}")  # a JSON string is a TOML string
        elif isinstance(value, float):
            parts.append(f"{key}={value!r}")
        else:
            parts.append(f"{key}={int(value)}")
    return " ".join(parts)


def start_supernode(
    workdir: Path,
    name: str,
    superlink: str,
    node_config: Mapping[str, Any],
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: list[str] | None = None,
    root_certificates: Path | None = None,
    warm: bool = False,
    preload: Sequence[str] = (),
    resident: str = "auto",
    import_paths: Sequence[Path] = (),
) -> FlowerProcess:
    """A SuperNode for one silo; `port` is its local runtime API (distinct per node).
    `warm`: its ClientApps start warm (fedlb.deploy.warm: torch and fedlb imported once,
    a fork per message; `preload`: more modules to import once, found in `import_paths`
    too: a user's app folder), else Flower's own process per message. `resident` (auto,
    on, off): a warm silo runs its ClientApps one after another in one resident worker
    (fedlb.deploy.resident: a GPU keeps its CUDA context and model between rounds);
    auto: where it trains on a GPU.
    With `root_certificates` (the federation's ca.crt) it talks TLS to the SuperLink and
    refuses one whose certificate that CA did not sign; without, plain HTTP. Returns once
    its local API is up, connected or not (`wait_joined` waits for that); a SuperNode
    refused before its API came up raises JoinError with Flower's reason. Several at
    once: `launch_supernode` each, then `supernode_ready` each (they start in parallel)."""
    node = launch_supernode(
        workdir,
        name,
        superlink,
        node_config,
        port,
        env,
        extra_args,
        root_certificates,
        warm,
        preload,
        resident,
        import_paths=import_paths,
    )
    supernode_ready(node)
    return node


def launch_supernode(
    workdir: Path,
    name: str,
    superlink: str,
    node_config: Mapping[str, Any],
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: list[str] | None = None,
    root_certificates: Path | None = None,
    warm: bool = False,
    preload: Sequence[str] = (),
    resident: str = "auto",
    avoid: Collection[int] = (),
    import_paths: Sequence[Path] = (),
) -> FlowerProcess:
    """`start_supernode` without waiting for its API: the process, started. `port`: the
    user's, refused if taken; None: a free one outside `avoid` (ports given to processes
    not bound yet), its `port`."""
    if port:
        check_port_free("127.0.0.1", port, f"silo {name}'s SuperNode")
    else:
        port = unused_port("127.0.0.1", f"silo {name}'s SuperNode", avoid)
    security = (
        ["--root-certificates", str(root_certificates)]
        if root_certificates is not None
        else ["--insecure"]
    )
    command = [
        "flower-supernode",
        *security,
        "--superlink",
        superlink,
        "--port",
        str(port),
        "--node-config",
        node_config_text(node_config),
        *(extra_args or []),
    ]
    if warm and (why := warm_unsupported()):
        log.warning("silo %s starts cold (Flower's process per message): %s", name, why)
        warm = False
    if warm:  # Flower's SuperNode in fedlb's launcher: no console script runs
        say_in_process("flower-supernode")
        secret = make_secret(workdir / f"home-{name}" / "superexec.secret")
        # decided here, not in the launcher or its server: they must not touch CUDA
        device = str(node_config.get(NODE_DEVICE, "auto"))
        if on := resident_wanted(resident, device):
            log.info("silo %s: a resident worker runs its ClientApps (device %s)", name, device)
        command = launcher_command(
            f"127.0.0.1:{port}", secret, command, preload, resident=on, import_paths=import_paths
        )
    else:  # the SuperNode starts flower-superexec, which starts flwr-clientapp: from PATH
        scripts = ("flower-supernode", "flower-superexec", "flwr-clientapp")
        command[0] = str(console_scripts(scripts, f"silo {name} runs cold")[0])
    log_path = workdir / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as out:  # the log is appended to: mark where this start begins
        out.write(f"{SUPERNODE_START} {name} for {superlink} at {time.strftime('%F %T')}\n")
    return FlowerProcess.start(name, command, workdir / f"home-{name}", log_path, port, env)


def supernode_ready(node: FlowerProcess) -> None:
    """Wait for a launched SuperNode's local API; stopped and JoinError (Flower's reason)
    when the server refused it, stopped and DeployError when it did not come up."""
    try:
        node.healthy_or_stopped()
    except DeployError as error:
        join = supernode_join(node.log_path)
        if join.refused:
            raise JoinError(f"refused by the server: {join.refused}", join.unregistered) from error
        raise


def wait_joined(
    node: FlowerProcess,
    address: str,
    tls: bool,
    timeout: float | None = 60.0,
    on_wait: Callable[[str], None] | None = None,
    every: float = 10.0,
    since: float | None = None,
) -> int:
    """Wait until the SuperNode's log says it connected to the SuperLink at `address`;
    its node id. JoinError with the reason when Flower gave up (refused), the process
    exited, or it has not connected `timeout` s after `since` (time.monotonic(); None:
    now), None: wait for ever. `on_wait` is told how it stands every `every` s meanwhile."""
    started = time.monotonic() if since is None else since
    said = time.monotonic()
    while True:
        alive = node.alive()  # before reading: the log of a process found dead is complete
        join = supernode_join(node.log_path)
        if join.node_id is not None:
            return join.node_id
        if join.refused:
            raise JoinError(f"refused by the server: {join.refused}", join.unregistered)
        if not alive:
            raise JoinError(
                f"its SuperNode exited with code {node.process.returncode} before it "
                f"connected; its log ({node.log_path}) ends with:\n{node.log_tail()}"
            )
        waited = time.monotonic() - started
        if timeout is not None and waited > timeout:
            raise JoinError(f"not connected after {timeout:.0f} s: {diagnose(address, tls)}")
        if on_wait is not None and time.monotonic() - said >= every:
            on_wait(f"not connected after {waited:.0f} s: {diagnose(address, tls)}")
            said = time.monotonic()
        time.sleep(0.2)


def write_connection(home: Path, address: str, root_certificates: Path | None = None) -> None:
    """FLWR_HOME/config.toml for the `flwr` CLI: one connection named CONNECTION."""
    home.mkdir(parents=True, exist_ok=True)
    security = (
        f"root-certificates = {json.dumps(str(root_certificates))}\n"
        if root_certificates is not None
        else "insecure = true\n"
    )
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "{address}"\n{security}'
    )
