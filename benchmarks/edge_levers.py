"""The second lever at the edge of stability: time to the same accuracy, stock beside it.

Flower's quickstart-pytorch (tests/apps) with the three drop-in lines, run in this process
on the model clock by benchmarks/app_accuracy.py (its real ServerApp and ClientApp; a round
is its slowest silo's τ·B/v), at the app's own settings unless --set says otherwise:
- `stock`: the app as published (FedAvg, B 32, one epoch a round);
- `default`: fedlb's default: round 1 uniform, the guard's probe in round 2; at the edge,
  every silo at its own batch size with the slow silos' steps cut and each update
  normalized by its steps (FedNova); stable, batch sizes balanced (τ and η kept);
- `edge:uniform`: the same, but the app's own sizes and steps at the edge (fedlb before
  the second lever);
- `lr:linear` / `lr:sqrt`: a prototype of the learning-rate lever, not a fedlb feature:
  batch sizes fully balanced from round 2 (no guard), and the `lr` the quickstart sends
  in its train config scaled by B/32 (or its square root) for the silos below B 32.
  Part of what it wins is a lower mean learning rate: run stock at that mean
  (`--policies stock --set learning-rate=...`) beside it.
Per policy: the median model-clock time to `--target` central accuracy (a run that never
reaches it counts as longer than any), stock's over fedlb's paired by seed (the median of
the per-seed ratios), runs reaching it, the mean final accuracy, the accuracy at stock's
time for `--at-rounds` rounds (the last round a run finished by then), and dead networks
(final accuracy <= 0.15).

    .venv/bin/python benchmarks/edge_levers.py --seeds 0-9 --rounds 14 --json edge.jsonl
    .venv/bin/python benchmarks/edge_levers.py --seeds 0-9 --set learning-rate=0.03 ...
    .venv/bin/python benchmarks/edge_levers.py --partition dirichlet:0.5 ...
    .venv/bin/python benchmarks/edge_levers.py --speeds 100,200,400,600,800 ...
    .venv/bin/python benchmarks/edge_levers.py --from-json edge.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.app_accuracy import DEAD, parse_seeds, parse_value, run_once, time_to  # noqa: E402

POLICIES = ("stock", "default", "edge:uniform")


def accuracy_at(row: dict[str, Any], seconds: float) -> float:
    """The central accuracy of the last round `row` finished within `seconds` on the
    model clock (the initial model's where none did)."""
    accuracy = row["accuracy_by_round"]
    elapsed, found = 0.0, accuracy[0]
    for number, took in enumerate(row["round_s"], start=1):
        elapsed += took or 0.0
        if elapsed > seconds + 1e-9 or number >= len(accuracy):
            break
        found = accuracy[number]
    return float(found)


def setting(row: dict[str, Any]) -> str:
    lr = row["overrides"].get("learning-rate", "0.1 (the app's)")
    speeds = ":".join(f"{v:g}" for v in row["speeds"])
    strategy = f", {row['strategy']}" if row.get("strategy") else ""
    return f"η {lr}, {row.get('partition', 'iid')}, speeds {speeds}{strategy}"


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]], target: float, at_rounds: int) -> str:
    out = [
        f"| setting | policy | runs | median s to {target} | stock / policy (paired median) "
        f"| reached | final accuracy | accuracy at stock's {at_rounds}-round time | dead "
        "| regime (edge / stable) | τ at the edge (median run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for where in sorted({setting(r) for r in rows}):
        group = [r for r in rows if setting(r) == where]
        stock = {r["seed"]: r for r in group if r["policy"] == "stock"}
        policies = sorted({r["policy"] for r in group}, key=lambda p: (p != "stock", p))
        for policy in policies:
            runs = [r for r in group if r["policy"] == policy]
            times = {r["seed"]: time_to(r, target) for r in runs}
            ordered = sorted(math.inf if t is None else t for t in times.values())
            middle = ordered[len(ordered) // 2]
            ratios = []
            for seed, t in times.items():
                base = stock.get(seed)
                mine = math.inf if t is None else t
                theirs = None if base is None else time_to(base, target)
                if theirs is not None and math.isfinite(mine):
                    ratios.append(theirs / mine)
                elif theirs is not None:
                    ratios.append(0.0)
            at = [
                accuracy_at(r, sum(stock[r["seed"]]["round_s"][:at_rounds]))
                for r in runs
                if r["seed"] in stock
            ]
            finals = [r["final_accuracy"] for r in runs]
            regimes = [r.get("regime") for r in runs]
            edge_runs = [r for r in runs if r.get("regime") == "edge" and r.get("steps")]
            taus = (
                "/".join(
                    str(t) for _, t in sorted(edge_runs[len(edge_runs) // 2]["steps"][-1].items())
                )
                if edge_runs
                else "–"
            )
            out.append(
                f"| {where} | {policy} | {len(runs)} "
                f"| {'never' if math.isinf(middle) else f'{middle:.1f}'} "
                f"| {fmt(statistics.median(ratios) if ratios else None, '.2f')}x "
                f"| {sum(t is not None for t in times.values())}/{len(runs)} "
                f"| {statistics.fmean(finals):.3f} "
                f"| {fmt(statistics.fmean(at) if at else None, '.3f')} "
                f"| {sum(f <= DEAD for f in finals)} "
                f"| {regimes.count('edge')} / {regimes.count('stable')} | {taus} |"
            )
    return "\n".join(out)


def paired(rows: list[dict[str, Any]], at: tuple[int, ...] = (4, 8, 14)) -> str:
    """Each policy's accuracy minus stock's at stock's k-round time, paired by seed: the
    mean ± sd over seeds and how many seeds were at least as accurate (the question of
    "no less accurate at equal time")."""
    out = [
        "| setting | policy | "
        + " | ".join(f"Δ at stock's {k}-round time (≥ stock)" for k in at)
        + " | dead (stock's) |",
        "|---|---|" + "---|" * len(at) + "---|",
    ]
    for where in sorted({setting(r) for r in rows}):
        group = [r for r in rows if setting(r) == where]
        stock = {r["seed"]: r for r in group if r["policy"] == "stock"}
        for policy in sorted({r["policy"] for r in group} - {"stock"}):
            runs = [r for r in group if r["policy"] == policy and r["seed"] in stock]
            if not runs:
                continue
            cells = []
            for k in at:
                deltas = [
                    accuracy_at(r, sum(stock[r["seed"]]["round_s"][:k]))
                    - accuracy_at(stock[r["seed"]], sum(stock[r["seed"]]["round_s"][:k]))
                    for r in runs
                    if len(stock[r["seed"]]["round_s"]) >= k
                ]
                if len(deltas) < 2:
                    cells.append("–")
                    continue
                cells.append(
                    f"{statistics.fmean(deltas):+.3f} ± {statistics.stdev(deltas):.3f} "
                    f"({sum(d >= 0 for d in deltas)}/{len(deltas)})"
                )
            dead = sum(r["final_accuracy"] <= DEAD for r in runs)
            dead_stock = sum(stock[r["seed"]]["final_accuracy"] <= DEAD for r in runs)
            out.append(
                f"| {where} | {policy} | " + " | ".join(cells) + f" | {dead} ({dead_stock}) |"
            )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--speeds", default="400,200,100", help="samples/s by partition-id")
    parser.add_argument("--partition", default="iid", help="iid, dirichlet:A, classes:K")
    parser.add_argument("--set", nargs="*", default=[], help="run config overrides key=value")
    parser.add_argument(
        "--strategy", help="the quickstart's FedAvg replaced by this first (tests/apps/adopt.py)"
    )
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--at-rounds", type=int, default=8)
    parser.add_argument("--json", type=Path, help="append one JSON line per run here")
    parser.add_argument("--from-json", type=Path, nargs="*", help="only print the table")
    args = parser.parse_args()
    if args.from_json:
        rows = [json.loads(line) for f in args.from_json for line in f.read_text().splitlines()]
        print(table(rows, args.target, args.at_rounds))
        print()
        print(paired(rows))
        return
    import logging

    import torch

    from fedlb._flower_internals import set_task_identity
    from fedlb.data import use_profile_dir

    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    os.environ["FEDLB_APP_PARTITION"] = args.partition
    use_profile_dir("")
    set_task_identity(run_id=1, task_id=1, node_id=0)
    speeds = [float(v) for v in args.speeds.split(",")]
    overrides = {k: parse_value(v) for k, v in (item.split("=", 1) for item in args.set)}
    rows = []
    for seed in parse_seeds(args.seeds):
        for policy in args.policies:
            row = run_once(
                "quickstart", policy, seed, args.rounds, overrides, speeds, strategy=args.strategy
            )
            row["partition"] = args.partition
            rows.append(row)
            print(
                f"seed {seed} {policy}: final {row['final_accuracy']:.3f}, to {args.target} "
                f"{time_to(row, args.target)}, regime {row.get('regime')}",
                flush=True,
            )
            if args.json:
                with args.json.open("a") as out:
                    out.write(json.dumps(row) + "\n")
    print(table(rows, args.target, args.at_rounds))
    print()
    print(paired(rows))


if __name__ == "__main__":
    main()
