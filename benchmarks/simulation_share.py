"""What share of a round on Flower's simulation is Flower's own: the quickstart under
`flwr run --stream`, stock beside the three drop-in lines.

Flower's Simulation Engine (a SuperLink started with --simulation, Ray, 3 simulated
SuperNodes, one CPU each) runs Flower's quickstart-pytorch (tests/apps) with speeds
emulated on the **measured clock** (`fedlb-emulated-speeds`: every step padded with sleep
to its silo's speed, default 600 : 300 : 150 samples/s). `stock` is the app's server as
published with the client's two drop-in lines (which then only emulate the speeds);
`default` is the three-line drop-in. The copy's ServerApp prints the wall-clock time of
each central evaluation (its `global_evaluate`, wrapped: `flwr run --stream` delivers
lines in batches, too coarse to time them on arrival): a round's wall is from one central
evaluation to the next (its training, its federated evaluation, the app's central
evaluation); the slowest silo's busy seconds (compute and
fixed costs, as its report says; for stock, τ·B/v of its loader at its emulated speed)
are what the silos needed; the rest is Flower's own (scheduling ClientApps on Ray
workers, messages, the evaluation phase). Rounds 2..N-1 (round 1 also starts the
workers; the last also saves the model).

    .venv/bin/python benchmarks/simulation_share.py --rounds 6 --json share.jsonl
    .venv/bin/python benchmarks/simulation_share.py --from-json share.jsonl

Clock: wall (time.time in the ServerApp's process). Takes ~6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedlb.deploy import processes as deploy  # noqa: E402
from fedlb.deploy.console_scripts import bin_dir  # noqa: E402
from tests.apps.adopt import adopt, declare_emulation, published_server  # noqa: E402

EVALUATED = re.compile(r"fedlb-benchmark: central evaluation of round (\d+) at ([\d.]+)")
STAMP = """

import time as _time

_global_evaluate = global_evaluate


def global_evaluate(server_round, arrays):  # fedlb's benchmark: when each round ended
    at = _time.time()
    print(f"fedlb-benchmark: central evaluation of round {server_round} at {at:.3f}", flush=True)
    return _global_evaluate(server_round, arrays)
"""
BALANCE = re.compile(r"fedlb: round (\d+) balance \[[^\]]+\]: (.*?); round")
BUSY = re.compile(r"(silo-\d+) B=\d+→\d+ τ=\d+ \(([\d.]+)\+([\d.]+) s\)")
STOCK_STEPS, STOCK_BATCH = 12, 32  # the quickstart's loader on 3 partitions: 12 steps of 32


def run_once(policy: str, rounds: int, speeds: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        app, _ = adopt("quickstart_pytorch", where)
        if policy == "stock":  # the server as published; the client's mod only emulates
            published_server(app)
        server = app / "pytorchexample/server_app.py"
        server.write_text(server.read_text() + STAMP)
        declare_emulation(app)
        here = Path.cwd()
        os.chdir(where)  # the ServerApp writes final_model.pt where the SuperLink runs
        link = deploy.start_superlink(where, extra_args=["--simulation"])
        home = where / "home-cli"
        lines: list[str] = []
        try:
            deploy.write_connection(home, f"127.0.0.1:{link.control_port}")
            command = [
                str(bin_dir() / "flwr"),
                "run",
                str(app),
                deploy.CONNECTION,
                "--stream",
                "--federation-config",
                "num-supernodes=3 client-resources-num-cpus=1",
                "--run-config",
                f'num-server-rounds={rounds} fedlb-emulated-speeds="{speeds}"',
            ]
            started = time.monotonic()
            done = subprocess.run(
                command,
                env=deploy.flower_env(home),
                capture_output=True,
                text=True,
                timeout=1800,
                check=False,
            )
            total = time.monotonic() - started
            lines = (done.stdout + done.stderr).splitlines()
        finally:
            os.chdir(here)
            link.stop()
    ended = {int(m.group(1)): float(m.group(2)) for line in lines if (m := EVALUATED.search(line))}
    if sorted(ended) != list(range(rounds + 1)):
        raise RuntimeError(
            f"{policy}: central evaluations {sorted(ended)}:\n" + "\n".join(lines[-40:])
        )
    walls = {k: ended[k] - ended[k - 1] for k in range(1, rounds + 1)}
    busy: dict[int, float] = {}
    for line in lines:
        if (m := BALANCE.search(line)) is not None:
            busy[int(m.group(1))] = max(float(c) + float(f) for _, c, f in BUSY.findall(m.group(2)))
    if policy == "stock":  # no fedlb line: its loader's steps at the slowest emulated speed
        slowest = min(float(v) for v in speeds.split(","))
        busy = {k: STOCK_STEPS * STOCK_BATCH / slowest for k in walls}
    return {
        "policy": policy,
        "rounds": rounds,
        "speeds": speeds,
        "round_wall_s": walls,
        "slowest_busy_s": busy,
        "total_s": total,
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| policy | runs | wall s per round | slowest silo busy s | Flower's own s | "
        "Flower's share |",
        "|---|---|---|---|---|---|",
    ]
    for policy in sorted({r["policy"] for r in rows}, key=lambda p: p != "stock"):
        walls, busy = [], []
        for r in (r for r in rows if r["policy"] == policy):
            middle = [int(k) for k in r["round_wall_s"] if 1 < int(k) < r["rounds"]]
            walls += [r["round_wall_s"][str(k)] for k in middle]
            busy += [r["slowest_busy_s"][str(k)] for k in middle if str(k) in r["slowest_busy_s"]]
        wall, need = statistics.median(walls), statistics.median(busy)
        out.append(
            f"| {policy} | {sum(r['policy'] == policy for r in rows)} | {wall:.2f} | {need:.2f} "
            f"| {wall - need:.2f} | {(wall - need) / wall:.0%} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--speeds", default="600,300,150")
    parser.add_argument("--policies", nargs="+", default=["stock", "default"])
    parser.add_argument("--json", type=Path, help="append one JSON line per run here")
    parser.add_argument("--from-json", type=Path, nargs="*", help="only print the table")
    args = parser.parse_args()
    if args.from_json:
        rows = [json.loads(line) for f in args.from_json for line in f.read_text().splitlines()]
        print(table(rows))
        return
    rows = []
    for _ in range(args.runs):
        for policy in args.policies:
            row = json.loads(json.dumps(run_once(policy, args.rounds, args.speeds)))  # str keys
            rows.append(row)
            print(f"{policy}: {row['total_s']:.1f} s, rounds {row['round_wall_s']}", flush=True)
            if args.json:
                with args.json.open("a") as out:
                    out.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
