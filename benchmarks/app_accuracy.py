"""Accuracy at the app's own settings: Flower's own apps, stock against fedlb's drop-in.

Each run executes an app's real ServerApp `main` and ClientApp (tests/apps: Flower's
quickstart-pytorch, the `flwr new` PyTorch app, advanced-pytorch with its own FedAvg
subclass, lr schedule and per-client head) in this process, on an in-process grid (the
messages the apps exchange are Flower's own; only the transport is short-circuited):
- `stock`: the app as published (FedAvg, its own loader);
- `default`: the three-line drop-in (tests/apps/adopt.py) with fedlb's defaults;
- `unguarded`: the same without the StabilityGuard (`Balancing(guard=False)`);
- `floor:F`: a fixed floor of F x the mean batch, without the guard's reaction;
- `guard:k=v,...`: the drop-in with `StabilityGuard(k=v, ...)` (`guard:probe=0`: the
  guard's floor always on, the default before its probe);
- `edge:L`: the drop-in with `Balancing(edge=L)`: what a run found at the edge runs
  (`edge:uniform`: the app's own sizes and steps, fedlb's behaviour before the second lever;
  the default is `steps`).
`--partition dirichlet:0.5` or `classes:2` splits the quickstart's and `flwr new` app's
data by label instead of IID (their fixtures' FEDLB_APP_PARTITION).
Silos have the emulated speeds given (`--speeds`, samples/s by partition-id) on the
model clock (no sleeping: each silo reports τ·B/v; the sizes depend on the speeds alone),
so a run's sizes are what a deployment with those speeds would give, and runs are fast.
A seed fixes torch's RNG before the ServerApp starts (the initial model, every loader's
shuffling), so stock and fedlb's runs of one seed start from the same model.

The final model (the app's own final_model.pt) is scored with the app's own `test()` on
a central test set (the quickstart's 359 held-out digits for the quickstart and `flwr
new` apps, which share that offline data; Fashion-MNIST's t10k for advanced-pytorch).
"Collapsed": final accuracy <= 0.15 (a dead network: FedAvg cannot leave it). E (compute
clock) = T*/T_round per round from fedlb's records, rounds 2..N; for stock the same
ratio for its uniform sizes at these speeds.

    .venv/bin/python benchmarks/app_accuracy.py --app quickstart --seeds 0-9 \
        --rounds 8 --set learning-rate=0.1 --json quickstart-lr0.1.jsonl
    .venv/bin/python benchmarks/app_accuracy.py --from-json quickstart-lr0.1.jsonl

Writes one JSON line per run (`--json`), then prints the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from flwr.app import Context, RecordDict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedlb._flower_internals import set_task_identity  # noqa: E402
from fedlb.balance import (  # noqa: E402
    BatchSizeManager,
    PooledProportional,
    StabilityGuard,
    ideal_round_time,
)
from fedlb.data import use_profile_dir  # noqa: E402
from fedlb.flower import Balancing, LoadBalanced  # noqa: E402
from tests.apps.adopt import adopt, app_config, imported  # noqa: E402
from tests.flower_fakes import InProcessGrid  # noqa: E402

APPS = {  # name -> (fixture folder, default speeds: samples/s by partition-id)
    "quickstart": ("quickstart_pytorch", "400,200,100"),
    "flwr-new": ("flwr_new_pytorch", "400,200,100"),
    "advanced": ("advanced_pytorch", "400,200,200,100"),
}
POLICIES = ("stock", "default", "unguarded")  # and floor:F, a fixed floor (no guard)
DEAD = 0.15


def central_accuracy(app: str, modules: dict[str, ModuleType], model_file: Path) -> float:
    """The final model scored by the app's own test() on a central test set."""
    task = modules["task"]
    net = task.Net()
    net.load_state_dict(torch.load(model_file, weights_only=True))
    if app == "advanced":
        from torch.utils.data import DataLoader

        split = task.load_split("test").with_transform(task.apply_eval_transforms)
        loader = DataLoader(split, batch_size=32)
    elif app == "quickstart":
        loader = task.load_centralized_dataset()
    else:  # the quickstart's held-out digits: the flwr new app's own hold-out too
        with tempfile.TemporaryDirectory() as tmp:
            quick, _ = adopt("quickstart_pytorch", Path(tmp), balanced=False)
            with imported(quick) as quickstart:
                loader = quickstart["task"].load_centralized_dataset()
    _, accuracy = task.test(net, loader, "cpu")
    return float(accuracy)


def watch_server_evaluation(app: str, modules: dict[str, ModuleType]) -> list[float]:
    """The central accuracy the app's own server-side evaluation finds each round (round
    0: the initial model), recorded as it runs; the `flwr new` app has none."""
    seen: list[float] = []
    server: Any = modules["server_app"]  # the app's module: its own functions

    def keep(evaluate: Any) -> Any:
        def watched(server_round: int, arrays: Any) -> Any:
            metrics = evaluate(server_round, arrays)
            seen.append(float(metrics["accuracy"]))
            return metrics

        return watched

    if app == "quickstart":
        server.global_evaluate = keep(server.global_evaluate)
    elif app == "advanced":
        make = server.get_global_evaluate_fn
        server.get_global_evaluate_fn = lambda device: keep(make(device))
    return seen


def time_to(row: dict[str, Any], target: float) -> float | None:
    """Seconds on the model clock until the app's central accuracy first reached
    `target` (None: not within the run, or no per-round accuracy)."""
    accuracy = row.get("accuracy_by_round") or []
    elapsed = 0.0
    for number, seconds in enumerate(row.get("round_s") or [], start=1):
        elapsed += seconds or 0.0
        if number < len(accuracy) and accuracy[number] >= target:
            return elapsed
    return None


@functools.cache
def loader_steps(app: str, partitions: int) -> tuple[int, ...]:
    """Each partition's len(trainloader) at the app's own batch size (32)."""
    with tempfile.TemporaryDirectory() as tmp:
        copy, _ = adopt(APPS[app][0], Path(tmp), balanced=False)
        with imported(copy) as modules:
            load = modules["task"].load_data
            return tuple(
                len((load(p, partitions, 32) if app == "quickstart" else load(p, partitions))[0])
                for p in range(partitions)
            )


def stock_efficiency(speeds: list[float], steps: dict[int, int], batch: int) -> float:
    """T*/T_round of uniform sizes at these speeds and step counts (model clock)."""
    names = {str(p): v for p, v in enumerate(speeds) if p in steps}
    taus = {str(p): steps[p] for p in steps}
    ideal = ideal_round_time(names, batch * len(names), taus)
    return ideal / max(taus[n] * batch / names[n] for n in names)


def tuned_guard(policy: str) -> StabilityGuard:
    """`guard:probe=0.15,ratio=4` -> StabilityGuard(probe=0.15, ratio=4.0)."""
    settings: dict[str, Any] = {}
    for item in policy.removeprefix("guard:").split(","):
        key, _, value = item.partition("=")
        settings[key.strip()] = int(value) if key.strip() == "start" else float(value)
    return StabilityGuard(**settings)


def scale_learning_rate(strategy: LoadBalanced, how: str, key: str = "lr", b0: int = 32) -> None:
    """The learning-rate lever, a prototype (issue 55's (b); not a fedlb feature: a drop-in
    does not own the app's learning rate, the quickstart sends it as `lr` in its train
    config): every train message's `lr` times (B/B0) (`linear`) or its square root
    (`sqrt`) where the silo's batch B is below the app's B0, unchanged above it."""
    from fedlb.flower.protocol import BATCH_SIZE

    configure = strategy.configure_train

    def scaled(server_round: int, arrays: Any, config: Any, grid: Any) -> Any:
        messages = list(configure(server_round, arrays, config, grid))
        for message in messages:
            sent = message.content.config_records.get("config")
            batch, rate = (None, None) if sent is None else (sent.get(BATCH_SIZE), sent.get(key))
            if sent is None or not isinstance(batch, int) or not isinstance(rate, float):
                continue
            share = min(1.0, batch / b0)
            sent[key] = rate * (share if how == "linear" else math.sqrt(share))
        return messages

    strategy.configure_train = scaled  # type: ignore[method-assign]


def run_once(
    app: str,
    policy: str,
    seed: int,
    rounds: int,
    overrides: dict[str, Any],
    speeds: list[float],
    profiles: bool = False,
    strategy: str | None = None,
) -> dict[str, Any]:
    """One run; with `profiles`, at the verdict an earlier run kept in
    $FEDLB_PROFILE_DIR, round 1 from the silos' profiles stored there where it allows;
    with `strategy` (tests/apps/adopt.py STRATEGIES, the quickstart only), its FedAvg
    replaced by that strategy first (balanced: `LoadBalanced(<that strategy>)`)."""
    folder, _ = APPS[app]
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        copy, _ = adopt(folder, where, balanced=policy != "stock", strategy=strategy)
        config = app_config(copy, **overrides, **{"num-server-rounds": rounds})
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
            balancing = kwargs.get("balancing", Balancing())
            if policy == "unguarded" or policy.startswith("floor:"):
                balancing = replace(balancing, guard=False)
            if policy.startswith("guard:"):  # guard:probe=0.15: a guard of other settings
                balancing = replace(balancing, guard=tuned_guard(policy))
            if policy.startswith("floor:"):  # every silo >= F x the mean batch, all along
                share = float(policy.removeprefix("floor:"))
                balancing = replace(
                    balancing,
                    balancer=lambda sizes: BatchSizeManager(
                        sizes, PooledProportional(min_share=share)
                    ),
                )
            if policy.startswith("edge:"):  # edge:uniform: what a run at the edge runs
                balancing = replace(balancing, edge=policy.removeprefix("edge:"))
            if policy.startswith("lr:"):  # the learning-rate lever: sizes fully balanced
                balancing = replace(balancing, guard=False)
            if profiles:
                balancing = replace(balancing, profiles=True)
            made.append(self)
            init(self, *args, **{**kwargs, "balancing": balancing})
            if policy.startswith("lr:"):
                scale_learning_rate(self, policy.removeprefix("lr:"))

        LoadBalanced.__init__ = keep  # type: ignore[method-assign]
        here = Path.cwd()
        os.chdir(where)  # the apps write final_model.pt (and outputs/) where they run
        started = time.perf_counter()
        try:
            with imported(copy) as modules:
                accuracy_by_round = watch_server_evaluation(app, modules)
                grid = InProcessGrid(nodes, config, modules["client_app"].app)
                torch.manual_seed(seed)
                random.seed(seed)  # FedAvg samples nodes with Python's global RNG
                np.random.seed(seed)
                modules["server_app"].main(grid, Context(1, 0, {}, RecordDict(), config))
                accuracy = central_accuracy(app, modules, where / "final_model.pt")
        finally:
            os.chdir(here)
            LoadBalanced.__init__ = init  # type: ignore[method-assign]
        seconds = time.perf_counter() - started
    row: dict[str, Any] = {
        "app": app,
        "policy": policy,
        "seed": seed,
        "rounds": rounds,
        "overrides": overrides,
        "speeds": speeds,
        "final_accuracy": accuracy,
        **({"strategy": strategy} if strategy else {}),
        "collapsed": accuracy <= DEAD,
        "seconds": seconds,
    }
    row["accuracy_by_round"] = accuracy_by_round  # round 0 (the initial model) on
    if made:
        records = made[0].reporter.records
        row["round_s"] = [r.round_s for r in records]  # model clock: max_i τ_i·B_i/v_i
        row["efficiency"] = [r.efficiency for r in records]
        row["sizes"] = [{s.silo: s.batch_size for s in r.silos} for r in records]
        row["norms_per_step"] = [
            {s.silo: (s.update_norm or 0.0) / max(s.local_steps, 1) for s in r.silos}
            for r in records
        ]
        row["train_loss"] = [{s.silo: s.train_loss for s in r.silos} for r in records]
        row["excluded"] = [[f for f in r.failed if "diverged" in f] for r in records]
        manager = made[0].manager
        row["floor"] = float(getattr(manager.tuner, "min_share", 0.0)) if manager else 0.0
        row["steps"] = [{s.silo: s.local_steps for s in r.silos} for r in records]
        row["regime"] = records[-1].guard if records else None  # the guard's verdict
        # what each round's guard read: the dispersion of a judging round, the steps' growth
        row["guard_probe"] = [r.guard_probe for r in records]
        row["guard_growth"] = [r.guard_growth for r in records]
        row["guard_by_round"] = [r.guard for r in records]
        row["remembered"] = records[0].guard_remembered if records else None
    else:  # stock: its uniform sizes' E at these speeds, per round
        by_round: dict[int, list[int]] = {}  # FedAvg shares one config: count pushes
        phase = 0
        for previous, m in zip([None, *grid.sent], grid.sent, strict=False):
            if m.metadata.message_type == "train":
                if previous is None or previous.metadata.message_type != "train":
                    phase += 1
                by_round.setdefault(phase, []).append(m.metadata.dst_node_id)
        steps = loader_steps(app, len(speeds))
        row["efficiency"] = [
            stock_efficiency(speeds, {n - 10: steps[n - 10] for n in round_nodes}, 32)
            for _, round_nodes in sorted(by_round.items())
        ]
        row["round_s"] = [
            max(steps[n - 10] * 32 / speeds[n - 10] for n in round_nodes)
            for _, round_nodes in sorted(by_round.items())
        ]
    return row


def mean_sd(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def table(rows: list[dict[str, Any]], target: float | None = None) -> str:
    out = [
        "| app | η | policy | runs | collapsed | final accuracy | not collapsed | E (rounds 2..N) "
        "| runs with an update left out | floor at the end | model-clock s to target, median |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r["app"], json.dumps(r["overrides"], sort_keys=True), r["policy"]) for r in rows},
        key=lambda k: (k[0], k[1], POLICIES.index(k[2]) if k[2] in POLICIES else 9, k[2]),
    )
    for app, overrides, policy in keys:
        group = [
            r
            for r in rows
            if (r["app"], json.dumps(r["overrides"], sort_keys=True), r["policy"])
            == (app, overrides, policy)
        ]
        finals = [r["final_accuracy"] for r in group]
        alive = [a for a in finals if a > DEAD]
        effs = [e for r in group for e in r["efficiency"][1:] if e is not None and math.isfinite(e)]
        guarded = [r for r in group if any(r.get("excluded", []))]
        floors = [r.get("floor", 0.0) for r in group if "floor" in r]
        lr = json.loads(overrides).get("learning-rate", json.loads(overrides).get("lr", "app's"))
        times = [time_to(r, target) for r in group] if target is not None else []
        reached = [t for t in times if t is not None]
        # the median over every run, a run that never reached the target counting as longer
        middle = (
            sorted(math.inf if t is None else t for t in times)[len(times) // 2] if times else 0
        )
        to_target = (
            "–"
            if target is None or not any(r.get("accuracy_by_round") for r in group)
            else f"{middle:.1f} ({len(reached)}/{len(group)} reached)"
            if math.isfinite(middle)
            else f"> the run ({len(reached)}/{len(group)} reached)"
        )
        out.append(
            f"| {app} | {lr} | {policy} | {len(group)} | {sum(r['collapsed'] for r in group)} "
            f"| {mean_sd(finals)} | {mean_sd(alive)} | {mean_sd(effs)} "
            f"| {len(guarded) if 'floor' in group[0] else '–'} "
            f"| {mean_sd(floors) if floors else '–'} | {to_target} |"
        )
    return "\n".join(out)


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def parse_value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--app", choices=sorted(APPS), default="quickstart")
    parser.add_argument("--seeds", default="0-9", help="e.g. 0-9 or 0,3,5")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--policies", nargs="+", default=list(POLICIES), help=f"{', '.join(POLICIES)}, floor:F"
    )
    parser.add_argument("--speeds", help="samples/s by partition-id, e.g. 400,200,100")
    parser.add_argument(
        "--partition", default="iid", help="quickstart, flwr-new: iid, dirichlet:A, classes:K"
    )
    parser.add_argument("--set", nargs="*", default=[], help="run config overrides key=value")
    parser.add_argument(
        "--second-run",
        action="store_true",
        help="run each balanced policy twice, its profiles and verdicts in a fresh folder; "
        "report the second run (at the first's verdict; round 1 from its profiles where "
        "stable, or for a policy without a probe)",
    )
    parser.add_argument("--json", type=Path, help="append one JSON line per run here")
    parser.add_argument("--from-json", type=Path, nargs="*", help="only print the table")
    parser.add_argument(
        "--target", type=float, help="central accuracy for the time-to-target column"
    )
    args = parser.parse_args()
    if args.from_json:
        rows = [json.loads(line) for f in args.from_json for line in f.read_text().splitlines()]
        print(table(rows, args.target))
        return
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    if args.partition != "iid" and args.app == "advanced":
        raise SystemExit("advanced-pytorch has its own partition (Dirichlet 1.0): no --partition")
    os.environ["FEDLB_APP_PARTITION"] = args.partition  # read by the fixtures' load_data
    use_profile_dir("")  # no run depends on the runs before it ...
    set_task_identity(run_id=1, task_id=1, node_id=0)
    speeds = [float(v) for v in (args.speeds or APPS[args.app][1]).split(",")]
    overrides = dict(item.split("=", 1) for item in args.set)
    overrides = {k: parse_value(v) for k, v in overrides.items()}
    rows = []
    for seed in parse_seeds(args.seeds):
        for policy in args.policies:
            if args.second_run and policy != "stock":
                with tempfile.TemporaryDirectory() as folder:
                    use_profile_dir(folder)
                    first = run_once(args.app, policy, seed, args.rounds, overrides, speeds, True)
                    row = run_once(args.app, policy, seed, args.rounds, overrides, speeds, True)
                    use_profile_dir("")  # ... but its own second run
                row["second_run"] = True
                row["first_run"] = {
                    k: first.get(k) for k in ("regime", "final_accuracy", "collapsed")
                }
            else:
                row = run_once(args.app, policy, seed, args.rounds, overrides, speeds)
            row["partition"] = args.partition
            rows.append(row)
            print(
                f"{args.app} {overrides} seed {seed} {policy}: final accuracy "
                f"{row['final_accuracy']:.3f} ({row['seconds']:.0f} s)"
                + (f", left out {row['excluded']}" if any(row.get("excluded", [])) else ""),
                flush=True,
            )
            if args.json:
                with args.json.open("a") as out:
                    out.write(json.dumps(row) + "\n")
    print(table(rows, args.target))


if __name__ == "__main__":
    main()
