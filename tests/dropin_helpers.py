"""Shared helpers of the drop-in tests (tests/test_flower_dropin_*.py, and the tests and
benchmarks that run Flower's apps the same way): the speeds of deployed silos, the balance
lines fedlb logs and their parser, the noisy model clock and the equal-silos run, and
`flwr run` with a timeout."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import subprocess
import time
import tomllib
from pathlib import Path

import torch
from flwr.app import Context, RecordDict

from fedlb.deploy import processes as deploy
from fedlb.deploy.control import Control
from tests.apps.adopt import adopt, app_config, imported
from tests.flower_fakes import InProcessGrid

DEPLOYED_SPEEDS = (120.0, 60.0, 30.0)  # the same, slower: each silo is its own process


BALANCE = re.compile(r"fedlb: round (\d+) balance \[([^\]]+)\]: (.*?); round .* E = ([\d.–]+)")


SIZE = re.compile(r"(silo-\d+) B=(\d+)→(\d+) τ=(\d+)")


COMPUTE = re.compile(r"(silo-\d+) B=(\d+)→\d+ τ=(\d+) \(([\d.]+)\+")


def balance_lines(log: str) -> dict[int, dict[str, tuple[int, int, int]]]:
    """round -> silo -> (B, next B, τ), from fedlb's balance lines in a run's log."""
    rounds: dict[int, dict[str, tuple[int, int, int]]] = {}
    for match in BALANCE.finditer(log):
        rounds[int(match.group(1))] = {
            silo: (int(b), int(after), int(steps))
            for silo, b, after, steps in SIZE.findall(match.group(3))
        }
    return rounds


class NoisyModelClock:
    """Equal silos on the model clock with the timing noise real hardware adds: every
    report's compute is τ·B/v times exp(N(0, σ²)), its fixed cost o times exp(N(0, σ_o²)),
    drawn from one seeded generator (the in-process grid asks the silos in order, so a run
    is the same on any machine, busy or not). σ = 0.2 and σ_o = 0.5 are the default
    tuner's own prior noise (fedlb.balance.pooled) and benchmarks/noise_floor.py's; what
    the quickstart's real millisecond steps measure on this machine, quiet or busy, is
    benchmarks/equal_silos.py's to print."""

    name = "model"
    curve_name = ""

    def __init__(self, seed: int, speed: float = 2000.0, overhead: float = 0.02) -> None:
        import numpy as np

        self.rng = np.random.default_rng(seed)
        self.speed, self.overhead = speed, overhead

    def pace(self, server_round: int) -> None:
        return None

    def fixed_cost(self, server_round: int) -> float:
        return 0.0

    def report(
        self, server_round: int, batch_size: int, steps: int, compute_s: float, fixed_s: float
    ) -> tuple[float, float]:
        compute, fixed = self.rng.lognormal(0.0, (0.2, 0.5))
        return steps * batch_size / self.speed * compute, self.overhead * fixed


def equal_silos_run(
    tmp_path: Path, silos: int, clock: NoisyModelClock | None, rounds: int = 10
) -> dict[int, dict[str, tuple[int, int, int]]]:
    """The quickstart's own ServerApp main and ClientApp on `silos` equal silos, in
    process, its reports timed by `clock` (None: the real clock, this machine's time),
    from torch seed 0: {round: {silo: (B, next B, τ)}} from fedlb's balance lines. The
    caller is in `tmp_path` (the app saves its model where it runs) with the task
    identity set."""
    from fedlb.flower import dropin

    app, _ = adopt("quickstart_pytorch", tmp_path)
    nodes = {10 + i: {"partition-id": i, "num-partitions": silos} for i in range(silos)}
    config = app_config(app, **{"num-server-rounds": rounds, "fraction-evaluate": 0.0})
    handler = _Said()
    root, level = logging.getLogger(), logging.getLogger().level
    root.addHandler(handler)
    if level > logging.INFO:
        root.setLevel(logging.INFO)
    emulated_timing = dropin.emulated_timing
    if clock is not None:  # every silo's reports from the one clock, in the grid's order
        dropin.emulated_timing = lambda emulation: (clock, None)
    try:
        with imported(app) as modules:
            grid = InProcessGrid(nodes, config, modules["client_app"].app)
            torch.manual_seed(0)
            modules["server_app"].main(grid, Context(1, 0, {}, RecordDict(), config))
    finally:
        dropin.emulated_timing = emulated_timing
        root.removeHandler(handler)
        root.setLevel(level)
    return balance_lines("\n".join(handler.said))


class _Said(logging.Handler):
    """What the run's loggers said, at INFO and above."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def _flwr_run(home: Path, app: Path, options: list[str], timeout: float) -> tuple[str, str]:
    """`flwr run APP --stream`, the user's own command: (its output, the run's final status
    from the SuperLink)."""
    done = subprocess.run(
        [str(deploy.bin_dir() / "flwr"), "run", str(app), deploy.CONNECTION, "--stream", *options],
        env=deploy.flower_env(home),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = done.stdout + done.stderr
    (home / "flwr-run.log").write_text(output)
    run_id = re.search(r"run_id `(\d+)`", output)
    assert run_id is not None, output[-3000:]
    address = tomllib.loads((home / "config.toml").read_text())["superlink"][deploy.CONNECTION]
    with Control(address["address"]) as control:
        return output, control.run_status(run_id.group(1))


def wait_listening(port: int, server: subprocess.Popen[bytes], timeout: float = 90) -> None:
    """Until `server` (a `fedlb server` process) listens on 127.0.0.1:`port`; an
    AssertionError with its output if it exits or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.2)
    output = server.stdout.read().decode() if server.poll() is not None and server.stdout else ""
    raise AssertionError(f"the server did not listen on {port}: {output}")
