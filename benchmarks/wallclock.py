"""The user's clock: wall time per round of a real deployment, FedAvg against fedlb's
default, with Flower's own ClientApp processes (cold) and fedlb's warm silo path.

Real SuperLink and SuperNode processes on 127.0.0.1, fedlb's app submitted with `flwr
run`, silos with emulated speeds (sleep-padded steps: base 200 samples/s divided by each
silo's slowdown) so that a round's compute is that of a cross-silo round, well above
Flower's own per-message floor. For each silo count, in one run on this machine:

- `fedavg cold`: plain FedAvg (tuner static: every silo at B0), Flower's process per message;
- `fedavg warm`: the same on fedlb's warm path (silos and ServerApp);
- `default cold` / `default warm`: fedlb's default (pooled tuner, change-point estimator,
  stability guard: no silo below half the mean batch);
- `full balance warm`: the default without the guard (LB-BSP as published).
The silos' speed profiles go to a folder of the run's own (FEDLB_PROFILE_DIR): the first
default run stores them, the later ones (a federation that has run before) ask for them
and run round 1 balanced; "E round 1" shows which.

Per-round wall = the ServerApp's wall-clock of the round (train phase + evaluation, which
rides in the next train message), rounds 2..N-1 (round 1 also pays for the silos' first
start, the last for the final evaluation). "Beyond compute" = that wall − the slowest silo's
busy time as it reported it. The whole run is timed from `flwr run` to the run's end.

    .venv/bin/python benchmarks/wallclock.py [--silos 3,5] [--rounds 6] [--local-steps 50]
        [--json wall.jsonl]
    .venv/bin/python benchmarks/wallclock.py --phases RUN [RUN ...]   # out-dirs or rounds.jsonl

`--phases` reads finished runs' rounds.jsonl (e.g. `fedlb demo --compare`'s fedavg/ and
fedlb/) and splits the slowest silo's round (rounds 2..N-1, medians) into its ClientApp's
start-up (its own clock), its busy time (compute + fixed), Flower's share for it (push to
reply on the server's clock, less those two: the SuperNode's pick-up and the transfers),
and the rest of the round (aggregation, the next push).

Clock: wall (time.monotonic in the ServerApp for rounds, time.perf_counter here for runs).
Takes ~20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedlb.deploy import Federation, RunConfig  # noqa: E402
from fedlb.flower import records_from_json_lines  # noqa: E402
from fedlb.flower.records.record import middle_rounds  # noqa: E402

BASE_SPEED = 200.0
SLOWDOWNS = {3: (1.0, 2.0, 4.0), 5: (1.0, 1.5, 2.0, 3.0, 4.0)}
POLICIES: dict[str, tuple[dict[str, Any], bool]] = {  # run settings, warm silos
    "fedavg cold": ({"tuner": "static", "profiles": 0}, False),
    "fedavg warm": ({"tuner": "static", "profiles": 0}, True),
    "default cold": ({}, False),
    "default warm": ({}, True),
    "full balance warm": ({"guard": 0}, True),
}


def measure(policy: str, silos: int, rounds: int, local_steps: int, work: Path) -> dict[str, Any]:
    changes, warm = POLICIES[policy]
    slowdowns = SLOWDOWNS[silos]
    settings = {
        **RunConfig().to_mapping(),
        "num-silos": silos,
        "num-rounds": rounds,
        "local-steps": local_steps,
        "batch-size": 16,
        "out-dir": str(work / "out"),
        **changes,
    }
    # cold: Flower's own processes on both sides (a ServerApp process per run as well)
    with Federation(work / "procs", warm=warm) as federation:
        for i, slowdown in enumerate(slowdowns):
            federation.add_silo(
                f"silo-{i}",
                {
                    "partition-id": i,
                    "num-partitions": silos,
                    "emulated-speed": BASE_SPEED / slowdown,
                    "threads": 1,
                },
                warm=warm,
            )
        started = time.perf_counter()
        outcome = federation.run(settings, timeout=1800)
        run_s = time.perf_counter() - started
    if not outcome.ok:
        raise RuntimeError(f"{policy}: run ended as {outcome.status}; see {outcome.log_path}")
    middle = middle_rounds(outcome.records)
    walls = [r.total_wall_s for r in middle]
    slowest = [r.round_s or 0.0 for r in middle]
    return {
        "policy": policy,
        "silos": silos,
        "rounds": rounds,
        "local_steps": local_steps,
        "slowdowns": list(slowdowns),
        "round_wall_s": statistics.median(walls),
        "slowest_busy_s": statistics.median(slowest),
        "beyond_compute_s": statistics.median(w - s for w, s in zip(walls, slowest, strict=True)),
        "run_wall_s": run_s,
        "efficiency": statistics.mean(r.efficiency or 0.0 for r in middle),
        "round1_efficiency": outcome.records[0].efficiency,
        "final_accuracy": outcome.records[-1].accuracy,
        "walls": walls,
        "sizes": [{s.silo: s.batch_size for s in r.silos} for r in outcome.records],
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| silos | policy | round wall s | slowest silo busy s | beyond compute s | "
        "FedAvg cold / this, per round | whole run s | FedAvg cold / this, run | E | E round 1 "
        "| accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for silos in sorted({r["silos"] for r in rows}):
        group = [r for r in rows if r["silos"] == silos]
        base = next((r for r in group if r["policy"] == "fedavg cold"), None)
        for r in group:
            per_round = f"{base['round_wall_s'] / r['round_wall_s']:.2f}x" if base else "–"
            per_run = f"{base['run_wall_s'] / r['run_wall_s']:.2f}x" if base else "–"
            accuracy = "–" if r["final_accuracy"] is None else f"{r['final_accuracy']:.3f}"
            lines.append(
                f"| {silos} | {r['policy']} | {r['round_wall_s']:.1f} | "
                f"{r['slowest_busy_s']:.1f} | {r['beyond_compute_s']:.1f} | {per_round} | "
                f"{r['run_wall_s']:.0f} | {per_run} | {r['efficiency']:.3f} | "
                f"{r.get('round1_efficiency') or 0:.3f} | {accuracy} |"
            )
    return "\n".join(lines)


def phases(run: Path) -> dict[str, float]:
    """Where the slowest silo's round went, medians over rounds 2..N-1 of a finished run
    (its out-dir, or its rounds.jsonl)."""
    path = run / "rounds.jsonl" if run.is_dir() else run
    records = records_from_json_lines(path.read_text().splitlines())
    middle = middle_rounds(records)
    rows: dict[str, list[float]] = {}
    for record in middle:
        slowest = max(record.silos, key=lambda s: s.wall_s or 0.0)
        start = slowest.start_s or 0.0
        parts = {
            "ClientApp start-up (its clock)": start,
            "busy: compute + fixed": slowest.round_s,
            "Flower: pick-up, transfers": (slowest.wall_s or 0.0) - start - slowest.round_s,
            "server: aggregation, next push": record.total_wall_s - (slowest.wall_s or 0.0),
            "round wall": record.total_wall_s,
        }
        for name, value in parts.items():
            rows.setdefault(name, []).append(value)
    return {name: statistics.median(values) for name, values in rows.items()}


def main() -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # stop the processes
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--silos", default="3,5")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--local-steps", type=int, default=50)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", type=Path, help="append one JSON line per run")
    parser.add_argument("--from-json", type=Path, help="print the table of earlier runs")
    parser.add_argument(
        "--phases", type=Path, nargs="+", help="finished runs' out-dirs or rounds.jsonl files"
    )
    args = parser.parse_args()
    if args.phases:
        split = {str(folder): phases(folder) for folder in args.phases}
        print("| phase (slowest silo, median s) | " + " | ".join(split) + " |")
        print("|---|" + "---|" * len(split))
        for name in next(iter(split.values())):
            print(f"| {name} | " + " | ".join(f"{p[name]:.2f}" for p in split.values()) + " |")
        return
    if args.from_json:
        rows = [json.loads(line) for line in args.from_json.read_text().splitlines() if line]
        print(table(rows))
        return
    rows = []
    profiles = Path(tempfile.mkdtemp(prefix="fedlb-profiles-"))
    for silos in (int(x) for x in args.silos.split(",")):
        os.environ["FEDLB_PROFILE_DIR"] = str(profiles / f"silos-{silos}")  # fresh per count
        for policy in args.policies.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                row = measure(policy, silos, args.rounds, args.local_steps, Path(tmp))
            rows.append(row)
            print(
                f"{silos} silos, {policy}: round wall {row['round_wall_s']:.1f} s "
                f"(slowest busy {row['slowest_busy_s']:.1f} s), run {row['run_wall_s']:.0f} s",
                flush=True,
            )
            if args.json:
                with args.json.open("a") as out:
                    out.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
