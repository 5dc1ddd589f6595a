"""Framework seconds per round of a real Flower 1.41 deployment: stock loop vs fedlb's.

For 3 and 5 silos (real SuperLink and SuperNode processes on this machine, silos at their
real speed, a tiny MLP so compute is milliseconds), three loops side by side, in one run:

- stock: Flower's own send_and_receive (pull, sleep 3 s, pull ...), a separate evaluate
  phase every round (what FedAvg does);
- polling: fedlb's PollingGrid (pull every 0.1 s), a separate evaluate phase every round;
- fedlb default: polling, and every round's evaluation inside the next train message.

All three evaluate the global model every round. Framework time of a round = wall-clock of
its train and evaluate phases − the slowest silo's own busy time (compute + fixed costs,
as it reported). Rounds 2 .. R-1 are averaged: the first also pays for process start-up and
the wait for silos, the last for the final model's own evaluate phase. The cost of one
fresh `flwr-clientapp`-like process (what every message pays) is measured apart.

    .venv/bin/python benchmarks/flower_overhead.py [--rounds 6] [--silos 3,5] [--json out.json]

Clock: wall (time.monotonic in the ServerApp). Takes ~15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedlb.flower import Federation, RunConfig


def _stop_on_sigterm() -> None:
    # A SIGTERM must unwind the `with Federation` blocks so their processes are stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))


LOOPS = {
    "stock": {"poll-interval": 0.0, "evaluate-every": 1, "evaluate-mode": "separate"},
    "polling": {"poll-interval": 0.1, "evaluate-every": 1, "evaluate-mode": "separate"},
    "fedlb default": {"poll-interval": 0.1, "evaluate-every": 1, "evaluate-mode": "with-train"},
}


def measure(silos: int, rounds: int, loop: dict[str, Any], work: Path) -> dict[str, float]:
    settings = {
        **RunConfig().to_mapping(),
        "num-silos": silos,
        "num-rounds": rounds,
        "local-steps": 5,
        "batch-size": 16,
        "out-dir": str(work / "out"),
        **loop,
    }
    with Federation(work / "procs") as federation:
        for i in range(silos):
            federation.add_silo(
                f"silo-{i}", {"partition-id": i, "num-partitions": silos, "threads": 1}
            )
        outcome = federation.run(settings, timeout=1800)
    if not outcome.ok:
        raise RuntimeError(f"run ended as {outcome.status}; see {outcome.log_path}")
    later = [r for r in outcome.records if 1 < r.round < rounds]
    train = [r.wall_s - (r.round_s or 0.0) for r in later]
    evaluate = [r.eval_wall_s or 0.0 for r in later]
    return {
        "train_s": statistics.mean(train),
        "evaluate_s": statistics.mean(evaluate),
        "framework_s": statistics.mean(t + e for t, e in zip(train, evaluate, strict=True)),
        "silo_busy_s": statistics.mean(r.round_s or 0.0 for r in later),
        "evaluated_rounds": sum(1 for r in later if r.eval_wall_s is not None),
        "rounds": len(later),
    }


def clientapp_start_s(repeats: int = 3) -> float:
    """CPU-bound start of a fresh process that imports what a silo message needs."""
    code = "import flwr.clientapp, torch, fedlb.flower.client_app"
    times = []
    for _ in range(repeats):
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.monotonic() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--silos", default="3,5")
    parser.add_argument("--json")
    args = parser.parse_args()
    _stop_on_sigterm()
    sizes = [int(x) for x in args.silos.split(",")]
    results: dict[str, Any] = {"clientapp_start_s": clientapp_start_s()}
    print("# Flower framework time per round (clock: wall)\n")
    print(
        f"A fresh flwr-clientapp-like process importing flwr, torch and fedlb's ClientApp: "
        f"{results['clientapp_start_s']:.2f} s (every message pays one).\n"
    )
    print(
        "| silos | loop | train phase s | evaluate phase s | framework s/round | "
        "vs stock | silo busy s |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        per_loop = {}
        for name, loop in LOOPS.items():
            with tempfile.TemporaryDirectory(prefix="fedlb-overhead-") as tmp:
                per_loop[name] = measure(n, args.rounds, loop, Path(tmp))
            stock = per_loop["stock"]["framework_s"]
            m = per_loop[name]
            print(
                f"| {n} | {name} | {m['train_s']:.1f} | {m['evaluate_s']:.1f} "
                f"({m['evaluated_rounds']}/{m['rounds']} rounds) | {m['framework_s']:.1f} | "
                f"{m['framework_s'] / stock - 1:+.0%} | {m['silo_busy_s']:.3f} |",
                flush=True,
            )
        results[str(n)] = per_loop
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
