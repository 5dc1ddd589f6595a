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
fresh `flwr-clientapp`-like process (what every message pays) is measured apart, and so is
its data cost: a fresh process getting one silo's Fashion-MNIST partition without the
partition cache (what every message paid before it), with it cold (the first message) and
warm (every later one).

    .venv/bin/python benchmarks/flower_overhead.py [--rounds 6] [--silos 3,5] [--json out.json]
    .venv/bin/python benchmarks/flower_overhead.py --only data-cache   # ~2 minutes

Clock: wall (time.monotonic in the ServerApp, time.perf_counter for the data cost). Takes
~20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedlb.deploy import Federation, RunConfig


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
    with Federation(work / "procs", warm=False) as federation:  # Flower's own ServerApp
        for i in range(silos):
            federation.add_silo(  # Flower's own path: what this benchmark measures
                f"silo-{i}", {"partition-id": i, "num-partitions": silos, "threads": 1}, warm=False
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
    code = "import flwr.clientapp, torch, fedlb.deploy.client_app"
    times = []
    for _ in range(repeats):
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.monotonic() - start)
    return statistics.median(times)


# One silo's message, in a fresh process: import what the ClientApp imports for its data,
# then time silo_data alone (printed) while the caller times the whole process.
DATA_MESSAGE = """
import sys, time
from fedlb.deploy import RunConfig
from fedlb.deploy.task import silo_data
start = time.perf_counter()
config = RunConfig(dataset="fashion-mnist", num_silos=int(sys.argv[1]), partition=sys.argv[2])
data = silo_data(config, 0, int(sys.argv[1]))
print(time.perf_counter() - start, len(data.train))
"""
DATA_MODES = ("before: no cache", "cold: build + store", "warm: read")


def data_cache_costs(silos: int = 5, scheme: str = "iid", repeats: int = 9) -> dict[str, Any]:
    """Median wall seconds of one silo message's data step (silo_data) and of the whole
    fresh process, on Fashion-MNIST (the Debian package's files), per cache mode. Modes are
    interleaved within each repetition, in rotating order, so that drift and other load on
    the shared cores hit all alike."""
    samples: dict[str, dict[str, list[float]]] = {
        m: {"data": [], "process": []} for m in DATA_MODES
    }
    train_samples = 0
    with tempfile.TemporaryDirectory(prefix="fedlb-cache-bench-") as tmp:
        cold, warm = Path(tmp) / "cold", Path(tmp) / "warm"
        folders = dict(zip(DATA_MODES, ["off", str(cold), str(warm)], strict=True))
        for repeat in range(-1, repeats):  # repeat -1 fills the warm cache, and is dropped
            shift = repeat % len(DATA_MODES)  # each mode first, second, third in turn
            for mode in [*DATA_MODES[shift:], *DATA_MODES[:shift]]:
                shutil.rmtree(cold, ignore_errors=True)  # cold: an empty cache every time
                env = {**os.environ, "FEDLB_CACHE_DIR": folders[mode]}
                start = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, "-c", DATA_MESSAGE, str(silos), scheme],
                    check=True,
                    capture_output=True,
                    text=True,
                    env=env,
                )
                process_s = time.perf_counter() - start
                data_s, count = done.stdout.split()[-2:]
                train_samples = int(count)
                if repeat >= 0:
                    samples[mode]["data"].append(float(data_s))
                    samples[mode]["process"].append(process_s)
    return {
        "silos": silos,
        "partition": scheme,
        "repeats": repeats,
        "train_samples": train_samples,
        **{
            mode: {kind: statistics.median(values) for kind, values in times.items()}
            for mode, times in samples.items()
        },
    }


def print_data_cache(costs: dict[str, Any]) -> None:
    before = costs[DATA_MODES[0]]
    print(
        f"# One silo message's data cost: Fashion-MNIST, silo 0 of {costs['silos']} "
        f"({costs['partition']}, {costs['train_samples']} training samples), fresh process, "
        f"median of {costs['repeats']} (clock: wall)\n"
    )
    print("| partition cache | silo_data s | × before | whole process s | × before |")
    print("|---|---|---|---|---|")
    for mode in DATA_MODES:
        m = costs[mode]
        print(
            f"| {mode} | {m['data']:.3f} | {m['data'] / before['data']:.3f} | "
            f"{m['process']:.2f} | {m['process'] / before['process']:.2f} |",
            flush=True,
        )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--silos", default="3,5")
    parser.add_argument("--json")
    parser.add_argument(
        "--only", choices=["data-cache"], help="run only this part (data-cache: ~2 minutes)"
    )
    args = parser.parse_args()
    _stop_on_sigterm()
    sizes = [int(x) for x in args.silos.split(",")]
    results: dict[str, Any] = {"data_cache": data_cache_costs()}
    print_data_cache(results["data_cache"])
    if args.only == "data-cache":
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return
    results["clientapp_start_s"] = clientapp_start_s()
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
