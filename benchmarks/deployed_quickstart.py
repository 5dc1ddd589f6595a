"""Flower's quickstart deployed: stock against the three drop-in lines on the wall clock.

`fedlb server --app` and three `fedlb silo --app` as real processes on 127.0.0.1 (free
ports), the silos emulating speeds 4 : 2 : 1 on the **measured clock** (every step padded
with sleep to its speed; the speeds low enough that three training processes on this
machine still keep up, which the server would say otherwise). The app is Flower's
quickstart-pytorch (tests/apps) at its own settings unless --set says otherwise:
`default` with the three drop-in lines (tests/apps/adopt.py); `stock` with its server as
published (Flower's FedAvg) and the two client lines only, which then emulate the speeds
and nothing else (a stock strategy sends no orders: every silo trains its own loader's
batches, as the app wrote it).

Time to accuracy is read from the app's own central evaluation, as its ServerApp logs it
after every round: the moment each line reaches the ServerApp's log file, on this
process's clock (polled every 0.1 s), from the line of the initial model's evaluation
(the run has started: every silo joined). Runs are not seeded (a deployed ServerApp
seeds nothing), so stock and fedlb's runs are not paired: the medians over runs say it.

    .venv/bin/python benchmarks/deployed_quickstart.py --runs 3 --rounds 12 \
        --json deployed.jsonl
    .venv/bin/python benchmarks/deployed_quickstart.py --from-json deployed.jsonl

Clock: wall. Takes ~25 minutes on 2 cores at the defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedlb.deploy.processes import free_port  # noqa: E402
from tests.apps.adopt import adopt, published_server  # noqa: E402
from tests.dropin_helpers import wait_listening  # noqa: E402

SPEEDS = (120.0, 60.0, 30.0)  # samples/s by partition-id: 4 : 2 : 1
# the app's central evaluation as Flower's strategy logs it: the initial model's, each round's
ACCURACY = re.compile(
    r"(?:MetricRecord|Initial global evaluation results): \{'accuracy': ([\d.e-]+)"
)
FEDLB = [sys.executable, "-m", "fedlb.cli"]
ENV = {**os.environ, "COLUMNS": "200"}


def _silo(app: Path, port: int, partition: int, speed: float, where: Path) -> list[str]:
    return [
        *FEDLB,
        "silo",
        "--app",
        str(app),
        "--server",
        f"127.0.0.1:{port}",
        "--partition-id",
        str(partition),
        "--num-partitions",
        str(len(SPEEDS)),
        "--emulated-speed",
        str(speed),
        "--threads",
        "1",
        "--workdir",
        str(where / f"silo-{partition}"),
    ]


def _watch(out: Path, server: subprocess.Popen[bytes], timeout: float) -> list[float]:
    """The moment (time.monotonic) each central evaluation reached the ServerApp's log,
    the initial model's first, until the server exits; the accuracies beside them."""
    seen: list[tuple[float, float]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = server.poll() is not None
        for log in out.glob("processes/serverapp-*.log"):
            found = ACCURACY.findall(log.read_text(errors="replace"))
            now = time.monotonic()
            seen.extend((now, float(a)) for a in found[len(seen) :])
        if done:
            return [t for t, _ in seen] + [a for _, a in seen]
        time.sleep(0.1)
    raise RuntimeError(f"the run did not end within {timeout:.0f} s")


def run_once(policy: str, rounds: int, overrides: dict[str, str]) -> dict[str, Any]:
    """One deployed run of the quickstart (stock or with the drop-in)."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        app, _ = adopt("quickstart_pytorch", where)
        if policy == "stock":  # the server as published; the client's mod only emulates
            published_server(app)
        port, out = free_port(), where / "out"
        settings = " ".join(
            f"{k}={v}" for k, v in {"num-server-rounds": rounds, **overrides}.items()
        )
        started = time.monotonic()
        server = subprocess.Popen(
            [
                *FEDLB,
                "server",
                "--app",
                str(app),
                "--run-config",
                settings,
                "--port",
                str(port),
                "--out-dir",
                str(out),
                "--num-silos",
                str(len(SPEEDS)),
                "--run-timeout",
                "1800",
            ],
            cwd=where,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=ENV,
        )
        silos: list[subprocess.Popen[bytes]] = []
        try:
            wait_listening(port, server, timeout=120)
            silos = [
                subprocess.Popen(
                    _silo(app, port, i, v, where),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    env=ENV,
                )
                for i, v in enumerate(SPEEDS)
            ]
            watched = _watch(out, server, 1800)
            output = server.communicate(timeout=60)[0].decode(errors="replace")
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
            for silo in silos:
                silo.send_signal(signal.SIGTERM)
            for silo in silos:
                try:
                    silo.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(silo.pid, signal.SIGKILL)
        half = len(watched) // 2
        moments, accuracy = watched[:half], watched[half:]
        rows = (out / "rounds.jsonl").read_text().splitlines() if policy != "stock" else []
    if server.returncode != 0 or len(accuracy) != rounds + 1:
        raise RuntimeError(
            f"{policy}: exit {server.returncode}, {len(accuracy)} evaluations:\n" + output[-3000:]
        )
    records = [json.loads(line) for line in rows]
    below = sorted(
        {r["round"] for r in records for e in r.get("events", []) if "below its emulated" in e}
    )
    return {
        "policy": policy,
        "rounds": rounds,
        "overrides": overrides,
        "speeds": list(SPEEDS),
        "accuracy_by_round": accuracy,  # round 0: the initial model
        "seconds_by_round": [t - moments[0] for t in moments],  # wall, from the initial one
        "total_s": time.monotonic() - started,
        "below_emulation_rounds": below,
        "steps": [
            {r["silo"]: r["local_steps"] for r in records if r["round"] == k}
            for k in sorted({r["round"] for r in records})
        ],
        "sizes": [
            {r["silo"]: r["batch_size"] for r in records if r["round"] == k}
            for k in sorted({r["round"] for r in records})
        ],
    }


def time_to(row: dict[str, Any], target: float) -> float | None:
    for accuracy, seconds in zip(row["accuracy_by_round"], row["seconds_by_round"], strict=True):
        if accuracy >= target:
            return float(seconds)
    return None


def accuracy_at(row: dict[str, Any], seconds: float) -> float:
    """The central accuracy of the last round the run had evaluated within `seconds`."""
    found = row["accuracy_by_round"][0]
    for accuracy, at in zip(row["accuracy_by_round"], row["seconds_by_round"], strict=True):
        if at > seconds:
            break
        found = accuracy
    return float(found)


def mean_at(runs: list[dict[str, Any]], seconds: float) -> float:
    return statistics.fmean(accuracy_at(r, seconds) for r in runs)


def table(rows: list[dict[str, Any]], target: float, at_rounds: int = 8) -> str:
    stock = [r for r in rows if r["policy"] == "stock"]
    at = (
        statistics.median(r["seconds_by_round"][at_rounds] for r in stock)
        if stock and all(len(r["seconds_by_round"]) > at_rounds for r in stock)
        else None
    )
    out = [
        f"| policy | runs | wall s to {target} (each run) | median | final accuracy "
        f"| accuracy at stock's {at_rounds}-round time"
        + ("" if at is None else f" ({at:.0f} s)")
        + " | wall s per round after round 1 (median) | runs with a silo below its speed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy in sorted({r["policy"] for r in rows}, key=lambda p: p != "stock"):
        runs = [r for r in rows if r["policy"] == policy]
        times = [time_to(r, target) for r in runs]
        ordered = sorted(math.inf if t is None else t for t in times)  # never: the longest
        median = statistics.median(ordered)
        per_round = [
            b - a
            for r in runs
            for a, b in zip(r["seconds_by_round"][1:], r["seconds_by_round"][2:], strict=False)
        ]
        out.append(
            f"| {policy} | {len(runs)} | "
            + ", ".join("never" if t is None else f"{t:.1f}" for t in times)
            + f" | {'never' if math.isinf(median) else f'{median:.1f}'} "
            f"| {statistics.fmean(r['accuracy_by_round'][-1] for r in runs):.3f} "
            f"| {'–' if at is None else format(mean_at(runs, at), '.3f')} "
            f"| {statistics.median(per_round):.1f} "
            f"| {sum(bool(r['below_emulation_rounds']) for r in runs)} of {len(runs)} runs |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--policies", nargs="+", default=["stock", "default"])
    parser.add_argument("--set", nargs="*", default=[], help="run config overrides key=value")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--json", type=Path, help="append one JSON line per run here")
    parser.add_argument("--from-json", type=Path, nargs="*", help="only print the table")
    args = parser.parse_args()
    if args.from_json:
        rows = [json.loads(line) for f in args.from_json for line in f.read_text().splitlines()]
        print(table(rows, args.target))
        return
    overrides = dict(item.split("=", 1) for item in args.set)
    rows = []
    for number in range(args.runs):
        for policy in args.policies:  # interleaved: a busy spell hits both alike
            row = run_once(policy, args.rounds, overrides)
            rows.append(row)
            print(
                f"run {number} {policy}: to {args.target} {time_to(row, args.target)} s, "
                f"final {row['accuracy_by_round'][-1]:.3f}, {row['total_s']:.0f} s in all",
                flush=True,
            )
            if args.json:
                with args.json.open("a") as out:
                    out.write(json.dumps(row) + "\n")
    print(table(rows, args.target))


if __name__ == "__main__":
    main()
