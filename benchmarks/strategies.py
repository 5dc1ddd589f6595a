"""Other strategies balanced: Flower's quickstart-pytorch with its FedAvg replaced by FedAdam,
FedProx, server-side DP fixed clipping around FedAvg, or a subclass with its own
aggregate_train (tests/apps/adopt.py STRATEGIES), stock against `LoadBalanced(<that
strategy>)` with the client's balance_mod() and balanced_loader(), at the app's own
settings (its lr 0.1, batch 32, one local epoch, its 3 rounds unless --rounds).

Two ways to run it, each printing the same table:
- in-process (default): the app's real ServerApp `main` and ClientApp in this process on
  an in-process grid, silos at the emulated speeds on the model clock (no sleeping, every
  seed's torch RNG fixed before the ServerApp starts: stock and wrapped start from the same
  model);
- `--simulation`: `flwr run` on a SuperLink started with --simulation (Flower's Simulation
  Engine, Ray), the speeds given by the run config (`fedlb-emulated-speeds`, measured
  clock: each step padded with sleep), the accuracy read from the app's own log; what a
  user runs. The model's initialisation follows torch's own seeding there (not fixed).

The accuracy is the app's own server-side evaluation of the final model (the quickstart's
`global_evaluate` on its central test set). "Sizes" are the last round's batch sizes by
silo, "X" their sum, "τ" the local steps sent.

    .venv/bin/python benchmarks/strategies.py --seeds 0-9 --json strategies.jsonl
    .venv/bin/python benchmarks/strategies.py --simulation --seeds 0-2 --json sim.jsonl
    .venv/bin/python benchmarks/strategies.py --from-json strategies.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context, RecordDict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.app_accuracy import watch_server_evaluation  # noqa: E402
from fedlb.data import use_profile_dir  # noqa: E402
from fedlb.flower import LoadBalanced  # noqa: E402
from tests.apps.adopt import STRATEGIES, adopt, app_config, declare_emulation, imported  # noqa: E402
from tests.flower_fakes import InProcessGrid  # noqa: E402

SPEEDS = "400,200,100"  # samples/s by partition-id: 4 : 2 : 1
ACCURACY = re.compile(r"MetricRecord: \{'accuracy': ([\d.e-]+)")
BALANCE = re.compile(r"fedlb: round (\d+) balance \[[^\]]+\]: (.*?); round")
SIZE = re.compile(r"(silo-\d+) B=(\d+)→(\d+) τ=(\d+)")


def in_process(
    strategy: str, balanced: bool, seed: int, rounds: int, speeds: list[float]
) -> dict[str, Any]:
    """One run of the app's ServerApp and ClientApp in this process (model clock)."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        copy, _ = adopt("quickstart_pytorch", where, balanced=balanced, strategy=strategy)
        config = app_config(copy, **{"num-server-rounds": rounds})
        nodes = {
            10 + i: {
                "partition-id": i,
                "num-partitions": len(speeds),
                "emulated-speed": v,
                "emulated-clock": "model",
            }
            for i, v in enumerate(speeds)
        }
        made: list[LoadBalanced] = []
        init = LoadBalanced.__init__

        def keep(self: LoadBalanced, *args: Any, **kwargs: Any) -> None:
            made.append(self)
            init(self, *args, **kwargs)

        LoadBalanced.__init__ = keep  # type: ignore[method-assign]
        here = Path.cwd()
        os.chdir(where)
        started = time.perf_counter()
        try:
            with imported(copy) as modules:
                accuracy = watch_server_evaluation("quickstart", modules)
                grid = InProcessGrid(nodes, config, modules["client_app"].app)
                torch.manual_seed(seed)
                random.seed(seed)  # Flower's strategies sample with Python's random
                np.random.seed(seed)
                modules["server_app"].main(grid, Context(1, 0, {}, RecordDict(), config))
        finally:
            os.chdir(here)
            LoadBalanced.__init__ = init  # type: ignore[method-assign]
        seconds = time.perf_counter() - started
    row: dict[str, Any] = {"accuracy_by_round": accuracy, "seconds": seconds}
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    row["train_configs"] = len(train)
    row["config_keys"] = sorted({k for m in train for k in m.content["config"]})
    if made:
        records = made[0].reporter.records
        row["sizes"] = [{s.silo: s.batch_size for s in r.silos} for r in records]
        row["steps"] = [{s.silo: s.local_steps for s in r.silos} for r in records]
        row["efficiency"] = [r.efficiency for r in records]
        row["round_s"] = [r.round_s for r in records]
    return row


def simulated(
    strategy: str, balanced: bool, rounds: int, speeds: str, where: Path
) -> dict[str, Any]:
    """One `flwr run` on a simulation SuperLink (measured clock, padded steps)."""
    from fedlb.deploy import processes as deploy
    from tests.dropin_helpers import _flwr_run

    copy, _ = adopt("quickstart_pytorch", where, balanced=balanced, strategy=strategy)
    declare_emulation(copy)
    here = Path.cwd()
    os.chdir(where)  # the ServerApp writes final_model.pt where the SuperLink runs
    link = deploy.start_superlink(where, extra_args=["--simulation"])
    home = where / "home-cli"
    started = time.perf_counter()
    try:
        deploy.write_connection(home, f"127.0.0.1:{link.control_port}")
        output, status = _flwr_run(
            home,
            copy,
            [
                "--federation-config",
                "num-supernodes=3 client-resources-num-cpus=1",
                "--run-config",
                f'num-server-rounds={rounds} fedlb-emulated-speeds="{speeds}"',
            ],
            timeout=900,
        )
    finally:
        os.chdir(here)
        link.stop()
    row: dict[str, Any] = {
        "status": status,
        "seconds": time.perf_counter() - started,
        "accuracy_by_round": [float(a) for a in ACCURACY.findall(output)],
        "aggregations_of_its_own": output.count("OwnFedAvg.aggregate_train: round"),
    }
    sizes, steps = [], []
    for _, silos in BALANCE.findall(output):
        found = SIZE.findall(silos)
        sizes.append({silo: int(b) for silo, b, _, _ in found})
        steps.append({silo: int(t) for silo, _, _, t in found})
    row["sizes"], row["steps"] = sizes, steps
    (where / "output.log").write_text(output)
    return row


def mean_sd(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def sizes_text(sizes: dict[str, int]) -> str:
    return " : ".join(str(sizes[k]) for k in sorted(sizes)) if sizes else "–"


def rounds_of(row: dict[str, Any]) -> int:
    """A run's rounds: as recorded, else from its accuracies (in-process runs record the
    initial model's too; Flower's simulation log gives the rounds' only)."""
    if "rounds" in row:
        return int(row["rounds"])
    return len(row["accuracy_by_round"]) - (0 if row["via"] == "simulation" else 1)


def table(rows: list[dict[str, Any]]) -> str:
    """Per strategy and way of running: final accuracy, stock against LoadBalanced, paired
    by seed (mean ± its standard error; how many pairs within 0.06), and the median run's
    sizes in round 2 (the first at the silos' own sizes) and in the last round."""
    out = [
        "| strategy | via | rounds | seeds | stock final accuracy | LoadBalanced final accuracy "
        "| paired difference | within 0.06 | sizes, round 2 | sizes, last round | X | τ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy in STRATEGIES:
        for via in ("in-process", "simulation"):
            for rounds in sorted({rounds_of(r) for r in rows}):
                group = [
                    r
                    for r in rows
                    if r["strategy"] == strategy and r["via"] == via and rounds_of(r) == rounds
                ]
                stock = {r["seed"]: r["accuracy_by_round"][-1] for r in group if not r["balanced"]}
                wrapped = {r["seed"]: r["accuracy_by_round"][-1] for r in group if r["balanced"]}
                pairs = [wrapped[s] - stock[s] for s in sorted(set(stock) & set(wrapped))]
                if not pairs:
                    continue
                balanced = [r for r in group if r["balanced"] and r.get("sizes")]
                median = balanced[len(balanced) // 2]["sizes"] if balanced else [{}]
                taus = sorted({t for r in balanced for t in r["steps"][-1].values()})
                spread = statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else 0.0
                out.append(
                    f"| {strategy} | {via} | {rounds} | {len(pairs)} "
                    f"| {mean_sd(list(stock.values()))} | {mean_sd(list(wrapped.values()))} "
                    f"| {statistics.mean(pairs):+.3f} ± {spread:.3f} "
                    f"| {sum(abs(d) <= 0.06 for d in pairs)}/{len(pairs)} "
                    f"| {sizes_text(median[1] if len(median) > 1 else {})} "
                    f"| {sizes_text(median[-1])} "
                    f"| {sum(median[-1].values()) if median[-1] else '–'} | {taus} |"
                )
    return "\n".join(out)


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES)
    )
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--rounds", type=int, default=3, help="the app's own: 3")
    parser.add_argument("--speeds", default=SPEEDS, help="samples/s by partition-id")
    parser.add_argument(
        "--simulation", action="store_true", help="flwr run on a simulation SuperLink"
    )
    parser.add_argument("--json", type=Path, help="append one JSON line per run here")
    parser.add_argument("--from-json", type=Path, nargs="*", help="only print the table")
    args = parser.parse_args()
    if args.from_json:
        rows = [json.loads(line) for f in args.from_json for line in f.read_text().splitlines()]
        print(table(rows))
        return
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    use_profile_dir("")
    os.environ["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    if not args.simulation:
        from fedlb._flower_internals import set_task_identity

        set_task_identity(run_id=1, task_id=1, node_id=0)
    speeds = [float(v) for v in args.speeds.split(",")]
    rows = []
    for seed in parse_seeds(args.seeds):
        for strategy in args.strategies:
            for balanced in (False, True):
                if args.simulation:
                    torch.manual_seed(seed)
                    with tempfile.TemporaryDirectory() as tmp:
                        row = simulated(strategy, balanced, args.rounds, args.speeds, Path(tmp))
                    via = "simulation"
                else:
                    row = in_process(strategy, balanced, seed, args.rounds, speeds)
                    via = "in-process"
                row.update(
                    strategy=strategy,
                    balanced=balanced,
                    seed=seed,
                    via=via,
                    speeds=args.speeds,
                    rounds=args.rounds,
                )
                rows.append(row)
                final = row["accuracy_by_round"][-1] if row["accuracy_by_round"] else float("nan")
                sizes = row["sizes"][-1] if row.get("sizes") else "–"
                print(
                    f"{strategy} {'LoadBalanced' if balanced else 'stock'} seed {seed} ({via}): "
                    f"final accuracy {final:.3f}, last sizes {sizes} ({row['seconds']:.0f} s)",
                    flush=True,
                )
                if args.json:
                    with args.json.open("a") as out:
                        out.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
