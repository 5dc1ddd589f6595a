"""Accuracy parity: stock FedAvg against load-balanced batch sizes on Flower's own app.

The question (a user's report): on Flower's quickstart-pytorch at the app's own lr 0.1
(SGD, momentum 0.9, 1 local epoch, batch 32) with 3 silos of speeds 1:2:4, load-balanced
FedAvg ended at 0.76 accuracy against 0.91 for stock FedAvg; at lr 0.03 they matched. Is it
the method or an artifact? This runs an exact, in-process FedAvg emulation with seeds:

- the app is `tests/apps/quickstart_pytorch` (Flower's example, unchanged but for offline
  data): every round, for every silo, its `Net()` loads the global weights and the app's
  own `train(net, trainloader, epochs=1, lr, device)` runs on it, unchanged;
- the weights are averaged by each silo's dataset size `len(trainloader.dataset)` with
  Flower's own `aggregate_arrayrecords` (what FedAvg.aggregate_train calls), and the global
  model is scored with the app's `test()` on its central test set;
- stock: each silo's loader is `DataLoader(train, batch_size=32, shuffle=True)` as the
  app's, so τ_i = len(loader) steps of 32; load-balanced: the same dataset, batch size B_i
  and exactly τ_i steps (a `RandomSampler` without replacement that continues into a fresh
  permutation, `num_samples = τ_i·B_i`, in a `BatchSampler`; len(loader) = τ_i). X = Σ B_i
  = 96 as in stock.

Policies: `stock` (B = 32 each), `uniform` (B = 32 each through the load-balanced loader: a
control for the loader), `lb` (B ∝ speed, fedlb's Proportional tuner), `lb-f0.5`,
`lb-f0.75` (the same with a floor B_i >= ceil(f·X/n), the rest re-divided proportionally).
E = T*/max_i t_i on the model clock t_i = τ·B_i/v_i, T* the best integer split of X.

Data: Fashion-MNIST through the app (FEDLB_APP_DATA=fashion-mnist; `apt-get install -y
dataset-fashion-mnist`), 3 IID silos, each silo's train part subsampled to --per-silo
samples (a fresh draw per seed) to fit the compute budget; the central test set is t10k.
A seed fixes torch's RNG (so the initial model), the subsample and every loader's order; a
seed's runs share the initial model and data across policies (paired).

The other app, `--app flwr-new`: `tests/apps/flwr_new_pytorch`, what `flwr new` writes
(the same Net, but Adam, its own lr 0.01, 1 local epoch, train loss divided by
len(trainloader), `load_data(partition_id, num_partitions)` with batch 32 fixed, and no
central test set). Its partitions come from its own `load_data`, its own `train()`/`test()`
run unchanged, and the global model is scored with its `test()` on the quickstart's
`load_centralized_dataset()`: both fixtures share one offline data section, so that is the
same held-out set, disjoint from the flwr-new partitions (checked at start: it must equal
the flwr-new task's own hold-out). Its --lrs default to its own 0.01.

    .venv/bin/python benchmarks/accuracy_parity.py [--app quickstart|flwr-new]
        [--rounds 10] [--seeds 0 1 2] [--lrs 0.1 0.03] [--per-silo 6000]
        [--json results.json] [--from-json results.json]

Prints one markdown table (accuracy at round 3 and at the last round, mean ± sd over
seeds) and per-seed accuracies.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Subset

from fedlb.balance import Proportional, balance_efficiency
from fedlb.balance.tuners import TuningInput

APPS = Path(__file__).resolve().parent.parent / "tests" / "apps"
APP = APPS / "quickstart_pytorch"
FLWR_NEW = APPS / "flwr_new_pytorch"
APP_LRS = {"quickstart": [0.1, 0.03], "flwr-new": [0.01]}  # --lrs default: the app's own
POLICIES = ("stock", "uniform", "lb", "lb-f0.5", "lb-f0.75")
B0 = 32
COLLAPSED = 0.15  # final accuracy at or below this: stuck at chance (0.10)


def load_task(data: str) -> Any:
    """The app's task module (Net, load_data, load_centralized_dataset, train, test)."""
    os.environ["FEDLB_APP_DATA"] = data
    os.environ.pop("FEDLB_APP_PARTITION_WEIGHTS", None)
    sys.path.insert(0, str(APP))
    return importlib.import_module("pytorchexample.task")


@dataclass(frozen=True)
class App:
    """What a run uses of an app: its task module (Net, train, test), its silos' train sets
    and the central test set that scores the global model."""

    name: str
    task: Any
    partition: Callable[[int, int], Dataset[Any]]  # (partition_id, num_partitions) -> train
    central: DataLoader[Any]


def load_app(name: str, data: str) -> App:
    """The quickstart, or the `flwr new` app scored on the quickstart's central test set."""
    quickstart = load_task(data)
    central = quickstart.load_centralized_dataset()
    if name == "quickstart":
        return App(
            name, quickstart, lambda i, n: quickstart.load_data(i, n, B0)[0].dataset, central
        )
    sys.path.insert(0, str(FLWR_NEW))
    task = importlib.import_module("flwrnewpytorch.task")
    # The same offline data section in both fixtures: the quickstart's central set must be
    # the flwr-new task's own hold-out (so disjoint from the partitions its load_data serves).
    held_x, held_y = task._offline_data()[1]
    assert torch.equal(central.dataset.images, held_x)
    assert torch.equal(central.dataset.labels, held_y)
    return App(name, task, lambda i, n: task.load_data(i, n)[0].dataset, central)


def batch_sizes(policy: str, speeds: list[float]) -> list[int]:
    """B_i per silo: B0 each for stock/uniform, else X = n·B0 divided ∝ speed with a floor."""
    n = len(speeds)
    if policy in ("stock", "uniform"):
        return [B0] * n
    floor = 1 if policy == "lb" else math.ceil(float(policy.removeprefix("lb-f")) * B0)
    names = [f"silo{i}" for i in range(n)]
    given = TuningInput(
        sizes=dict.fromkeys(names, B0),
        speeds=dict(zip(names, speeds, strict=True)),
        overheads=dict.fromkeys(names, 0.0),
        iterations=dict.fromkeys(names, 1),
        reports={},
    )
    sizes = Proportional(min_batch=floor).propose(given)
    return [sizes[name] for name in names]


def efficiency(sizes: list[int], speeds: list[float], taus: list[int]) -> float:
    """E = T*/max_i τ_i·B_i/v_i (model clock, no fixed costs), T* over integer splits of X."""
    names = [f"silo{i}" for i in range(len(sizes))]
    return balance_efficiency(
        dict(zip(names, speeds, strict=True)),
        dict(zip(names, sizes, strict=True)),
        dict(zip(names, taus, strict=True)),
    )


def loader(policy: str, train: Subset[Any], size: int, tau: int, seed: int) -> DataLoader[Any]:
    """Stock: the app's own loader. Otherwise exactly τ batches of `size` (continuing
    permutations of the silo's data)."""
    order = torch.Generator().manual_seed(seed)
    if policy == "stock":
        return DataLoader(train, batch_size=size, shuffle=True, generator=order)
    sampler = RandomSampler(train, replacement=False, num_samples=tau * size, generator=order)
    result = DataLoader(train, batch_sampler=BatchSampler(sampler, size, drop_last=False))
    assert len(result) == tau
    return result


def run_one(
    app: App,
    policy: str,
    lr: float,
    seed: int,
    rounds: int,
    speeds: list[float],
    per_silo: int,
    eval_rounds: set[int],
) -> dict[str, Any]:
    from flwr.app import ArrayRecord, MetricRecord, RecordDict

    from fedlb._flower_internals import aggregate_arrayrecords

    task = app.task
    n = len(speeds)
    device = torch.device("cpu")
    pick = torch.Generator().manual_seed(10_000 + seed)
    silos = []
    for i in range(n):
        full = app.partition(i, n)
        keep = torch.randperm(len(cast(Sized, full)), generator=pick)[:per_silo].tolist()
        silos.append(Subset(full, keep))
    taus = [math.ceil(len(train) / B0) for train in silos]  # len() of the app's loader at B0
    sizes = batch_sizes(policy, speeds)
    torch.manual_seed(seed)
    arrays = ArrayRecord(task.Net().state_dict())
    accuracy: dict[int, float] = {}
    losses: dict[int, float] = {}
    train_losses: list[list[float]] = []  # per round, per silo
    drifts: list[list[float]] = []  # per round, per silo: ||w_i - w_global||
    for server_round in range(1, rounds + 1):
        replies = []
        start = arrays.to_torch_state_dict()
        train_losses.append([])
        drifts.append([])
        for i, train in enumerate(silos):
            net = task.Net()
            net.load_state_dict(start)
            order = seed * 100_003 + server_round * 101 + i
            trainloader = loader(policy, train, sizes[i], taus[i], order)
            train_loss = task.train(net, trainloader, 1, lr, device)
            weights = net.state_dict()
            train_losses[-1].append(float(train_loss))
            drifts[-1].append(
                math.sqrt(sum(float(((weights[k] - start[k]) ** 2).sum()) for k in start))
            )
            metrics = MetricRecord(
                {"train_loss": train_loss, "num-examples": len(cast(Sized, trainloader.dataset))}
            )
            replies.append(RecordDict({"arrays": ArrayRecord(weights), "metrics": metrics}))
        arrays = aggregate_arrayrecords(replies, "num-examples")
        if server_round in eval_rounds or server_round == rounds:
            net = task.Net()
            net.load_state_dict(arrays.to_torch_state_dict())
            loss, acc = task.test(net, app.central, device)
            accuracy[server_round], losses[server_round] = float(acc), float(loss)
    return {
        "app": app.name,
        "policy": policy,
        "lr": lr,
        "seed": seed,
        "sizes": sizes,
        "tau": taus,
        "E": efficiency(sizes, speeds, taus),
        "accuracy": accuracy,
        "loss": losses,
        "train_loss": train_losses,
        "drift": drifts,
    }


def mean_sd(values: list[float], signed: bool = False) -> str:
    number = "{:+.3f}" if signed else "{:.3f}"
    if len(values) < 2:
        return number.format(values[0]) if values else "-"
    return f"{number.format(statistics.fmean(values))} ± {statistics.stdev(values):.3f}"


def table(results: list[dict[str, Any]], rounds: int, early: int) -> str:
    """One row per (lr, policy): accuracies mean ± sd over seeds, the final accuracy's
    difference from stock's on the same seed (same initial model and data), and how many
    runs collapsed (final accuracy <= COLLAPSED: the model stuck at chance)."""
    lines = [
        f"| policy | B_i | lr | E | accuracy round {early} | accuracy round {rounds} "
        f"| minus stock, same seed | collapsed | round {rounds}, runs not collapsed | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        dict.fromkeys((r["lr"], r["policy"]) for r in results),
        key=lambda k: (-k[0], POLICIES.index(k[1])),
    )
    for lr, policy in keys:
        runs = [r for r in results if r["lr"] == lr and r["policy"] == policy]
        final = [r["accuracy"][rounds] for r in runs]
        alive = [a for a in final if a > COLLAPSED]
        stock = {
            r["seed"]: r["accuracy"][rounds]
            for r in results
            if r["lr"] == lr and r["policy"] == "stock"
        }
        paired = [r["accuracy"][rounds] - stock[r["seed"]] for r in runs if r["seed"] in stock]
        lines.append(
            f"| {policy} | {'/'.join(map(str, runs[0]['sizes']))} | {lr:g} | {runs[0]['E']:.3f} | "
            f"{mean_sd([r['accuracy'][early] for r in runs])} | {mean_sd(final)} | "
            f"{mean_sd(paired, signed=True)} | "
            f"{len(final) - len(alive)}/{len(final)} | {mean_sd(alive)} | {len(runs)} |"
        )
    return "\n".join(lines)


def silo_table(results: list[dict[str, Any]]) -> str:
    """Per silo (slowest first), the size of its local update ||w_i - w_global||: typical
    (median over rounds) and largest in the run, each the median over seeds."""
    lines = [
        "| policy | lr | update norm per silo, median round | largest update norm per silo |",
        "|---|---|---|---|",
    ]
    keys = sorted(
        dict.fromkeys((r["lr"], r["policy"]) for r in results),
        key=lambda k: (-k[0], POLICIES.index(k[1])),
    )
    for lr, policy in keys:
        runs = [r for r in results if r["lr"] == lr and r["policy"] == policy]
        silos = range(len(runs[0]["sizes"]))
        typical = [
            statistics.median(statistics.median(row[i] for row in r["drift"]) for r in runs)
            for i in silos
        ]
        largest = [
            statistics.median(max(row[i] for row in r["drift"]) for r in runs) for i in silos
        ]
        lines.append(
            f"| {policy} | {lr:g} | {' / '.join(f'{x:.1f}' for x in typical)} | "
            f"{' / '.join(f'{x:.1f}' for x in largest)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--app",
        default="quickstart",
        choices=sorted(APP_LRS),
        help="quickstart: tests/apps/quickstart_pytorch; flwr-new: tests/apps/flwr_new_pytorch",
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--early", type=int, default=3, help="also report this round")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--lrs", type=float, nargs="+", help="default: the app's own (0.1 0.03 / 0.01)"
    )
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--speeds", default="1,2,4", help="relative silo speeds")
    parser.add_argument("--per-silo", type=int, default=6000, help="train samples per silo")
    parser.add_argument("--data", default="fashion-mnist", choices=["fashion-mnist", "digits"])
    parser.add_argument("--eval-every", type=int, default=1, help="score the model every k rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path, help="write every run's results here")
    parser.add_argument(
        "--from-json", type=Path, help="print the table of an earlier --json file, run nothing"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        done = json.loads(args.from_json.read_text())
        for run in done:  # JSON keys are strings
            run["accuracy"] = {int(k): v for k, v in run["accuracy"].items()}
        last = max(max(run["accuracy"]) for run in done)
        print(table(done, last, args.early))
        print()
        print(silo_table(done))
        return

    torch.set_num_threads(args.threads)
    logging.getLogger("fedlb.balance").setLevel(logging.ERROR)  # the floors' removal warnings
    speeds = [float(v) for v in args.speeds.split(",")]
    lrs = args.lrs or APP_LRS[args.app]
    app = load_app(args.app, args.data)
    eval_rounds = {k for k in range(1, args.rounds + 1) if k % args.eval_every == 0}
    eval_rounds.add(args.early)
    print(
        f"# {args.app} app, {args.data}, {len(speeds)} IID silos x {args.per_silo} train "
        f"samples, speeds {args.speeds}, {args.rounds} rounds, seeds {args.seeds}, "
        f"test set {len(cast(Sized, app.central.dataset))}",
        flush=True,
    )
    results = []
    started = time.perf_counter()
    for seed in args.seeds:
        for lr in lrs:
            for policy in args.policies:
                t0 = time.perf_counter()
                result = run_one(
                    app, policy, lr, seed, args.rounds, speeds, args.per_silo, eval_rounds
                )
                result["seconds"] = time.perf_counter() - t0
                results.append(result)
                curve = " ".join(f"{result['accuracy'][k]:.3f}" for k in sorted(result["accuracy"]))
                print(
                    f"lr {lr:g} seed {seed} {policy:9s} B {result['sizes']} "
                    f"acc by round {curve} ({result['seconds']:.0f} s)",
                    flush=True,
                )
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1))
    print(f"\n{len(results)} runs in {time.perf_counter() - started:.0f} s\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results, args.rounds, args.early))
    print()
    print(silo_table(results))


if __name__ == "__main__":
    main()
