"""Ray nodes on this machine for Flower's Simulation Engine: a head that every run of an
experiment shares, and more nodes where a test stands in for a cluster of machines.

Flower's simulation (the flwr-simulation process a simulation SuperLink starts per run)
calls `ray.init()` without an address: Ray then joins the cluster named by RAY_ADDRESS,
and only without one starts a private Ray for that run (about 5 s here, every run).
A simulation SuperLink started with `ray_address` (`Federation(..., ray_address=...)`)
puts RAY_ADDRESS in its environment, so every run joins that cluster: one head started
here for all of an experiment's policies, or the head of a cluster of several machines,
whose nodes Flower's RayBackend fills with ClientApp actors node by node.

Each node is `ray start --block` behind fedlb's guard (fedlb/deploy/guard.py): stopping
it stops every Ray process it started, and a fedlb that dies takes them with it. A head
keeps its state in a temporary folder of its own, not Ray's default /tmp/ray, where
`ray.init()` looks for a running cluster: another program's Ray must not join this one.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psutil

from .console_scripts import find_script
from .errors import DeployError
from .processes import FlowerProcess, free_port

STARTED = "Ray runtime started."
STOP_GRACE_S = 0.5  # what `ray start` prints once the node is up
# Ray warns that it will stop overriding CUDA_VISIBLE_DEVICES for CPU-only actors; opting
# in to that behaviour now silences it and changes nothing here.
RAY_ENV = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@dataclass
class RayNode:
    """A Ray node started here; `address` is its cluster's (the head's GCS, host:port)."""

    process: FlowerProcess
    address: str
    temp_dir: Path | None = None  # a head's state folder, removed when it stops

    def stop(self) -> None:
        """Stop every process of this node. Ray's daemons take over 8 s to exit on
        SIGTERM (the guard's grace), and their state is thrown away anyway: SIGKILL
        after a short grace, then any that left the process group, by PID."""
        try:
            started = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            started = []
        self.process.stop(grace=STOP_GRACE_S)
        for leftover in started:
            with contextlib.suppress(psutil.Error):
                leftover.kill()  # psutil checks it is still the same process
        psutil.wait_procs(started, timeout=5)
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> RayNode:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()


def ray_command() -> Path:
    """The `ray` CLI (this Python's own, else the first on PATH), or a DeployError saying
    how to get it."""
    ray = find_script("ray")
    if ray is None:
        raise DeployError(
            "Flower's simulation needs Ray, which is not installed here: "
            "pip install 'fedlb[simulation]' (./scripts/setup.sh installs it)"
        )
    return ray


def start_ray_head(
    workdir: Path, num_cpus: int | None = None, host: str = "127.0.0.1", timeout: float = 120
) -> RayNode:
    """A Ray head listening on `host` (a free port); `num_cpus` None: all of this
    machine's, 0: none (the head then runs no ClientApp, only what connects to it)."""
    ray = ray_command()
    port = free_port(host)
    # short: Ray's sockets live under it, and a socket path has at most 107 bytes
    temp_dir = Path(tempfile.mkdtemp(prefix="fedlb-ray-"))
    command = [
        str(ray),
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        host,
        "--port",
        str(port),
        "--include-dashboard=false",
        "--ray-client-server-port",  # Ray's default, 10001, would clash with another head
        str(free_port(host)),
        "--disable-usage-stats",
        "--temp-dir",
        str(temp_dir),
        *(["--num-cpus", str(num_cpus)] if num_cpus is not None else []),
    ]
    log_path = workdir / "ray-head.log"
    offset = _size(log_path)
    process = FlowerProcess.start(
        "Ray head", command, workdir / "home-ray", log_path, port, RAY_ENV
    )
    node = RayNode(process, f"{host}:{port}", temp_dir)
    _started_or_stopped(node, offset, timeout)
    return node


def start_ray_node(
    workdir: Path,
    address: str,
    num_cpus: int | None = None,
    name: str = "ray-node",
    host: str = "127.0.0.1",
    timeout: float = 120,
) -> RayNode:
    """One more node of the cluster whose head is at `address`, on this machine."""
    command = [
        str(ray_command()),
        "start",
        "--block",
        "--address",
        address,
        "--node-ip-address",
        host,
        "--disable-usage-stats",
        *(["--num-cpus", str(num_cpus)] if num_cpus is not None else []),
    ]
    log_path = workdir / f"{name}.log"
    offset = _size(log_path)
    process = FlowerProcess.start(
        f"Ray {name}", command, workdir / "home-ray", log_path, 0, RAY_ENV
    )
    node = RayNode(process, address)
    _started_or_stopped(node, offset, timeout)
    return node


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _started_or_stopped(node: RayNode, offset: int, timeout: float) -> None:
    """Wait for `ray start` to say the node is up (in its log after `offset`: the log is
    appended to, and may hold an earlier start's words); stop it and raise if it does not."""
    deadline = time.monotonic() + timeout
    try:
        while STARTED not in _read_from(node.process.log_path, offset):
            if not node.process.alive():
                raise DeployError(
                    f"{node.process.name} exited with code {node.process.process.returncode}"
                    f" while starting; its log ({node.process.log_path}) ends with:\n"
                    f"{node.process.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise DeployError(
                    f"{node.process.name} did not start in {timeout:.0f} s; its log: "
                    f"{node.process.log_path}"
                )
            time.sleep(0.2)
    except BaseException:
        node.stop()
        raise


def _read_from(path: Path, offset: int) -> str:
    with path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")
