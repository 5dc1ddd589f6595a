"""Benchmark of cluster mode (fedlb.cluster), all figures measured side by side in one run.

1. Iteration time of each policy against BSP on 4 gloo ranks (torchrun, this machine) at
   heterogeneity max/min speed 1, 2 and 3 (emulated, sleep-padded: clock `measured`),
   against the ceiling the speeds allow; E from iteration 11 on; the controller's share of
   the iteration (rank 0's manager decisions) and the whole exchange's (gather, decide,
   broadcast, waits included).
2. The gRPC manager service: seconds per blocking Report call and per iteration (all
   workers' reports answered) with 4 and 32 client workers (threads of one process).
3. Speed prediction under a real competing load (the paper's Table 3).
4. The straggler schemes side by side (LB-BSP Figs. 6 and 12): bsp, lb-ema, asp, ssp,
   backup:1, eager-solo, eager-majority (and lb-narx under load) on 4 workers training an
   MLP on Fashion-MNIST, at max/min speed 1, 2, 3 and under a competing load: hardware
   efficiency (a worker's mean iteration time), statistical efficiency (samples to the
   target accuracy, in BSP iterations of X samples), time to target, accuracy at equal
   wall time, over seeds; accuracy-over-time plots.
5. Orchestra against BSP, LB-BSP and local SGD (time to accuracy at 2x and 3x) and the
   barrier its agent chose over time.
6. The data-partition manager (LB-BSP §7, footnote 13): 5 ranks holding 2 classes each,
   fixed unequal batches (the paper's 64-192, divided by 8), the same iterations: accuracy
   with and without the manager against IID shards, over seeds; samples and bytes moved.

    .venv/bin/python benchmarks/cluster.py [--quick] [--json results.json] [--only schemes]

Prints Markdown tables; docs/benchmarks.md keeps the latest ones with this command.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cluster_accuracy import (
    COMPARISON_HEADERS,
    SETTINGS,
    compare_to_accuracy,
    setting_note,
)
from fedlb.cluster import ManagerClient, serve
from fedlb.experiments import ClusterScenario, launch, run_benchmark
from fedlb.experiments import markdown_table as table

RUNS = Path("runs/benchmarks/cluster")  # every job's results and log
LEVELS = {1: "1,1,1,1", 2: "1,1.26,1.59,2", 3: "1,1.44,2.08,3"}  # geometric, max/min = level
POLICIES = ("bsp", "lb-ema", "lb-narx", "deadband")


def policies_at_levels(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    iterations = 40 if quick else 150
    rows, data = [], {}
    for level, speeds in LEVELS.items():
        results: dict[str, dict[str, Any]] = {}
        for policy in POLICIES:
            scenario = ClusterScenario.from_mapping(
                {
                    "speeds": speeds,
                    "base-speed": 300.0,
                    "iterations": iterations,
                    "policy": policy,
                    "narx-warmup": 60,
                }
            )
            folder = RUNS / f"level-{level}" / policy  # kept: its torchrun.log tells a failure
            if launch(scenario, folder, timeout=600) != 0:
                raise RuntimeError(f"{policy} at level {level} failed: see {folder}/torchrun.log")
            results[policy] = json.loads((folder / "summary.json").read_text())
        ceiling = ClusterScenario.from_mapping({"speeds": speeds, "base-speed": 300.0}).ceiling()
        base = results["bsp"]["mean_iteration_s"]
        for policy, summary in results.items():
            speedup = base / summary["mean_iteration_s"]
            rows.append(
                [
                    f"{level}x",
                    policy,
                    f"{summary['mean_iteration_s'] * 1000:.1f}",
                    f"{speedup:.2f}x",
                    f"{ceiling:.2f}x",
                    f"{speedup / ceiling:.0%}",
                    f"{(speedup - 1) / (ceiling - 1):.0%}" if ceiling > 1.001 else "–",
                    f"{summary['steady_efficiency']:.3f}",
                    f"{summary['controller_s_per_iteration'] / summary['mean_iteration_s']:.2%}",
                    f"{summary['exchange_s_per_iteration'] / summary['mean_iteration_s']:.1%}",
                ]
            )
        data[f"level_{level}"] = {
            "ceiling": ceiling,
            "policies": {
                p: {
                    "iteration_s": s["mean_iteration_s"],
                    "speedup": base / s["mean_iteration_s"],
                    "steady_efficiency": s["steady_efficiency"],
                    "controller_s": s["controller_s_per_iteration"],
                    "exchange_s": s["exchange_s_per_iteration"],
                }
                for p, s in results.items()
            },
        }
    text = table(
        [
            "max/min speed",
            "policy",
            "ms / iteration",
            "speedup vs bsp",
            "ceiling",
            "of the ceiling",
            "of the gain possible",
            "E",
            "controller share",
            "exchange share",
        ],
        rows,
    )
    text += (
        f"\n\n4 gloo ranks on this machine's 2 cores, MLP on digits, X = 128, {iterations} "
        "iterations per run, mean iteration time from iteration 11 on (clock: measured, "
        "speeds sleep-padded to 300 samples/s x the relative speed). Ceiling: BSP's "
        "compute time over the ideal split's; the iteration also holds the all-reduce, the "
        "optimizer step and Python, which no split removes, hence 'of the gain possible' = "
        "(speedup - 1) / (ceiling - 1). NARX uses EMA for its first 60 reports."
    )
    return text, {"levels": data}


def prediction_under_load(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Table 3 with a real competing process per rank: replay each rank's reports (speed,
    CPU, memory as measured) through Memoryless, EMA and NARX, one-step-ahead."""
    import numpy as np

    from fedlb.balance import EMA, NARX, Memoryless, SpeedEstimator, WorkerReport

    iterations, warmup = (200, 80) if quick else (500, 200)
    scenario = ClusterScenario.from_mapping(
        {"speeds": "1,1,1,1", "iterations": iterations, "policy": "lb-ema", "load": 0.08}
    )
    folder = RUNS / "competing-load"
    if launch(scenario, folder, timeout=900) != 0:
        raise RuntimeError(f"the competing-load run failed: see {folder}/torchrun.log")
    lines = (folder / "iterations.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    estimators: dict[str, Any] = {
        "Memoryless": Memoryless,
        "EMA": EMA,
        "NARX": lambda: NARX(warmup=warmup),
    }
    rmse: dict[str, float] = {}
    for name, make in estimators.items():
        errors = []
        for rank in range(scenario.nproc):
            mine = [r for r in rows if r["rank"] == rank]
            estimator: SpeedEstimator = make()
            for k in range(len(mine) - 1):
                r = mine[k]
                estimator.update(
                    WorkerReport(
                        str(rank), r["batch_size"], 1, r["compute_s"], cpu=r["cpu"], mem=r["mem"]
                    )
                )
                if k >= warmup + 10:
                    following = mine[k + 1]
                    errors.append(
                        estimator.predict() - following["batch_size"] / following["compute_s"]
                    )
        rmse[name] = float(np.sqrt(np.mean(np.square(errors))))
    text = table(
        ["estimator", "RMSE (samples/s)", "vs EMA"],
        [[n, f"{v:.1f}", f"{v / rmse['EMA'] - 1:+.0%}"] for n, v in rmse.items()],
    )
    text += (
        f"\n\n4 ranks of equal speed (400 samples/s) each sharing its emulated machine with a "
        "competing process that starts or stops with probability 0.08 every 0.1 s, burning "
        "20-75% of a core and holding 50-400 MB while it runs; the rank's speed falls by "
        "0.8 x the competitor's CPU share. Reports (speed, and the CPU and memory of the rank "
        f"plus its competitor, measured by psutil) of a {iterations}-iteration lb-ema run, "
        f"replayed through each estimator; errors counted after report {warmup + 10} "
        f"(NARX trains on its first {warmup})."
    )
    return text, {"prediction_under_load": rmse}


def _service_worker(
    address: str,
    name: str,
    speed: float,
    rounds: int,
    barrier: threading.Barrier,
    calls: list[tuple[int, float]],
) -> None:
    """One plain worker: report every iteration and wait for its next size."""
    client = ManagerClient(address)
    size = 32
    for iteration in range(1, rounds + 1):
        barrier.wait()  # all workers start the iteration together
        start = time.perf_counter()
        size = client.report("bench", name, iteration, size, size / speed)
        elapsed = time.perf_counter() - start
        calls.append((iteration, elapsed))  # list.append is atomic under the GIL
    client.close()


def service_costs(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rounds = 30 if quick else 200
    rows, data = [], {}
    for workers in (4, 32):
        server, port, _ = serve(0, max_workers=workers + 8)
        address = f"127.0.0.1:{port}"
        names = [f"w{i}" for i in range(workers)]
        ManagerClient(address).register("bench", names, 32)
        calls: list[tuple[int, float]] = []
        barrier = threading.Barrier(workers)
        threads = [
            threading.Thread(
                target=_service_worker,
                args=(address, n, 100.0 + 10 * i, rounds, barrier, calls),
            )
            for i, n in enumerate(names)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        server.stop(0)
        call = statistics.median(elapsed for _, elapsed in calls)
        slowest: dict[int, float] = {}
        for iteration, elapsed in calls:  # an iteration ends with its last answer
            slowest[iteration] = max(slowest.get(iteration, 0.0), elapsed)
        per_iteration = statistics.median(slowest.values())
        rows.append([str(workers), f"{call * 1000:.2f}", f"{per_iteration * 1000:.2f}"])
        data[str(workers)] = {"call_s": call, "iteration_s": per_iteration}
    text = table(["workers", "ms per Report call (median)", "ms per iteration (median)"], rows)
    text += (
        f"\n\nBlocking reports (BSP): every worker's call returns once all have reported; "
        f"{rounds} iterations, workers are threads of one process on this machine, gRPC on "
        "loopback, all released together each iteration. A call's time includes waiting for "
        "the last worker's report; an iteration's is its slowest call's."
    )
    return text, {"service": data}


# ---- 4. the straggler schemes (their settings and race: cluster_accuracy.py) -------------

SCHEMES = ("bsp", "lb-ema", "asp", "ssp", "backup:1", "eager-solo", "eager-majority")


def schemes_to_accuracy(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    iterations, seeds, target = (60, (0,), 0.6) if quick else (500, (0, 1), 0.75)
    settings = dict(list(SETTINGS.items())[:2]) if quick else SETTINGS
    rows, data, _ = compare_to_accuracy(
        RUNS / "schemes", settings, SCHEMES, iterations, seeds, target
    )
    text = table(COMPARISON_HEADERS, rows) + "\n\n" + setting_note(iterations, seeds, target)
    text += (
        " Plots: " + ", ".join(str(RUNS / "schemes" / f"accuracy-{s}.png") for s in settings) + "."
    )
    return text, {"schemes": data}


# orchestra: fedlb's agent (a moving reward baseline); orchestra-paper: the paper's reward
ORCHESTRA_SCHEMES = ("bsp", "lb-ema", "local-sgd", "orchestra", "orchestra-paper")
AGENTS = ("orchestra", "orchestra-paper")


def orchestra_to_accuracy(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Orchestra against BSP, LB-BSP and local SGD (the paper's Table 2 comparison), and
    the barrier its agent chose over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    iterations, seeds, target = (60, (0,), 0.6) if quick else (500, (0, 1), 0.75)
    settings = {k: SETTINGS[k] for k in (("2x",) if quick else ("2x", "3x"))}
    rows, data, every = compare_to_accuracy(
        RUNS / "orchestra", settings, ORCHESTRA_SCHEMES, iterations, seeds, target
    )
    figure, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 3.5))
    for axis, (setting, runs) in zip(
        [axes] if len(settings) == 1 else axes, every.items(), strict=True
    ):
        for agent in AGENTS:
            barriers = runs[agent][0]["barriers"]
            axis.step(
                [b["seconds"] for b in barriers],
                [b["barrier_s"] for b in barriers],
                where="post",
                label="moving baseline" if agent == "orchestra" else "the paper's (best so far)",
            )
        axis.legend(title="the agent's reward")
        axis.set(xlabel="wall s", ylabel="barrier T (s)", title=f"Orchestra's barrier, {setting}")
    figure.tight_layout()
    plot = RUNS / "orchestra" / "barrier.png"
    figure.savefig(plot, dpi=110)
    plt.close(figure)
    decisions = [
        b["decision_s"]
        for runs in every.values()
        for agent in AGENTS
        for s in runs[agent]
        for b in s["barriers"]
    ]
    levels = {
        agent: [
            statistics.fmean(b["level"] for b in s["barriers"][len(s["barriers"]) // 2 :])
            for runs in every.values()
            for s in runs[agent]
        ]
        for agent in AGENTS
    }
    text = table(COMPARISON_HEADERS, rows) + "\n\n" + setting_note(iterations, seeds, target)
    text += (
        f" local-sgd averages every 8 steps; orchestra:4 (local steps at most 4 apart; "
        f"orchestra-paper: the same with the paper's reward). The agents' mean barrier "
        f"level over each run's second half (steps from T*, the floor is the slowest "
        f"worker's one batch): orchestra "
        f"{', '.join(f'{v:+.1f}' for v in levels['orchestra'])}; orchestra-paper "
        f"{', '.join(f'{v:+.1f}' for v in levels['orchestra-paper'])}. The "
        f"agent's cost per decision: mean {statistics.fmean(decisions) * 1000:.2f} ms, max "
        f"{max(decisions) * 1000:.2f} ms (rank 0, between rounds, while the ranks wait for "
        f"the average). Plots: {RUNS / 'orchestra'}/accuracy-*.png, {plot}."
    )
    return text, {"orchestra": data, "agent_decision_s": decisions, "agent_levels": levels}


# ---- 5. the data-partition manager ------------------------------------------------------

PARTITION_JOB: dict[str, Any] = {
    "nproc": 5,
    "speeds": "2,3,4,5,6",  # as the batch sizes: LB-BSP would have given them these
    "base-speed": 4000.0,
    "dataset": "digits",
    "model": "mlp",
    "batch-sizes": "8,12,16,20,24",
    "learning-rate": 0.05,
    "partition-check": 10,
    "policy": "bsp",  # the sizes stay as given: the paper's check holds them fixed
}
PARTITION_CASES = {  # name: (shards, manager)
    "IID shards": ("iid", False),
    "2 classes per rank, no manager": ("classes:2", False),
    "2 classes per rank, manager (gap <= 2)": ("classes:2", True),
}


def partition_manager_check(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    iterations, seeds = (100, (0,)) if quick else (300, (0, 1, 2))
    rows, data = [], {}
    for case, (shards, manager) in PARTITION_CASES.items():
        results = []
        for seed in seeds:
            job = {**PARTITION_JOB, "iterations": iterations, "seed": seed, "shards": shards}
            job["partition-manager"] = manager
            folder = RUNS / "partition" / f"{shards.replace(':', '-')}-{manager}" / f"seed-{seed}"
            if launch(ClusterScenario.from_mapping(job), folder, timeout=600) != 0:
                raise RuntimeError(f"{case} failed: see {folder}/bsp/torchrun.log")
            results.append(json.loads((folder / "summary.json").read_text()))
        accuracy = [r["final_accuracy"] for r in results]
        moved = [sum(m["count"] for m in r.get("partition_moves", [])) for r in results]
        data[case] = {
            "accuracy": accuracy,
            "samples_moved": moved,
            "bytes_moved": [r.get("partition_bytes_moved", 0) for r in results],
            "largest_gap": [max(r.get("traversal_gaps", [0.0])) for r in results],
        }
        rows.append(
            [
                case,
                f"{statistics.fmean(accuracy):.3f}",
                f"{statistics.pstdev(accuracy):.3f}",
                " / ".join(f"{a:.3f}" for a in accuracy),
                f"{statistics.fmean(moved):.0f}",
                f"{statistics.fmean(data[case]['bytes_moved']) / 1024:.1f}",
                f"{max(data[case]['largest_gap']):.1f}",
            ]
        )
    iid = statistics.fmean(data["IID shards"]["accuracy"])
    text = table(
        [
            "shards",
            "accuracy",
            "sd",
            "per seed",
            "samples moved",
            "KiB moved",
            "largest traversal gap",
        ],
        rows,
    )
    text += (
        f"\n\n5 gloo ranks, MLP on the embedded digits (1,438 training images, tested on "
        f"the 359 held out), batch sizes 8, 12, 16, 20, 24 held fixed (X = 80), "
        f"{iterations} iterations, SGD at lr 0.05, the weighted all-reduce; seeds "
        f"{list(seeds)}. 'largest traversal gap': the most passes one shard was ahead of "
        "another at a check (the counts restart after each move). Accuracy with the manager "
        + f"minus IID: {statistics.fmean(data[list(PARTITION_CASES)[2]]['accuracy']) - iid:+.3f}; "
        + f"without it: {statistics.fmean(data[list(PARTITION_CASES)[1]]['accuracy']) - iid:+.3f}."
    )
    return text, {"partition": data}


def main() -> None:
    run_benchmark(
        "fedlb.cluster benchmark",
        __doc__.splitlines()[0],
        f"torch {torch.__version__}. Clock: measured (wall, time.perf_counter; rank speeds "
        "emulated by sleep padding).",
        [
            ("Policies against BSP on 4 gloo ranks", policies_at_levels),
            ("The gRPC manager service", service_costs),
            ("Speed prediction under a real competing load (Table 3)", prediction_under_load),
            ("Straggler schemes: time to accuracy", schemes_to_accuracy),
            ("Orchestra against BSP, LB-BSP and local SGD", orchestra_to_accuracy),
            ("The data-partition manager on 2-class shards", partition_manager_check),
        ],
    )


if __name__ == "__main__":
    main()
