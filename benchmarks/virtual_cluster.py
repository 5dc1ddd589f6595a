"""The straggler schemes on the virtual clock (fedlb.cluster.virtual): 4 to 64 workers.

1. Validation: the 4-worker settings of the measured table (docs/benchmarks.md, "The
   straggler schemes side by side": 1x, 2x, 3x, load; MLP on Fashion-MNIST, B = 32, lr
   0.05, target 0.75, 500 BSP iterations' worth of samples, evaluations every 0.5 s as
   the real snapshots), virtual and measured side by side: ms per worker iteration, X-steps
   to the target, seconds to it, and their ratios to BSP.
2. Crossover map: workers {4, 16, 32, 64} x max/min speed {1, 2, 3, 4, 8} (geometric),
   which scheme reaches the target first in virtual seconds, at the same lr and with the
   synchronous schemes' lr scaled linearly with X (capped); JSON lines and a PNG heatmap.

    .venv/bin/python benchmarks/virtual_cluster.py [--quick] [--only validation|crossover]

Clock: virtual (B / v + fixed costs per iteration, no sleeping; real gradients).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlb.cluster.virtual import VirtualData, VirtualJob, VirtualResult, run_virtual
from fedlb.data import federation_pool
from fedlb.experiments import markdown_table as table
from fedlb.experiments import run_benchmark
from fedlb.models import build_model

OUT = Path("docs/results/virtual")
BASE_SPEED, BATCH, LR, TARGET = 800.0, 32, 0.05, 0.75
LR_MAX = 0.4  # the linear rule's ceiling: BSP at 16 and 64 workers stalls below 0.75 at 0.8
SETTINGS = {  # as benchmarks/cluster.py's: (relative speeds, competing load)
    "1x": ((1, 1, 1, 1), 0.0),
    "2x": ((1, 1.26, 1.59, 2), 0.0),
    "3x": ((1, 1.44, 2.08, 3), 0.0),
    "load": ((1, 1, 1, 1), 0.15),
}
SCHEMES = ("bsp", "lb-ema", "asp", "ssp", "backup:1", "eager-solo", "eager-majority")
# docs/benchmarks.md, measured 2026-11-24 (clock: measured, seeds 0 and 1): (ms / worker
# iteration, X-steps to target, s to target); None: no seed reached 0.75
MEASURED: dict[str, dict[str, tuple[float, float | None, float | None]]] = {
    "1x": {
        "bsp": (61.1, 228, 13.9),
        "lb-ema": (63.3, 248, 15.7),
        "asp": (56.4, 107, 6.4),
        "ssp": (56.3, 83, 5.1),
        "backup:1": (60.5, 171, 13.9),
        "eager-solo": (53.6, None, None),
        "eager-majority": (60.2, 244, 14.5),
    },
    "2x": {
        "bsp": (60.7, 230, 13.8),
        "lb-ema": (53.6, 254, 13.5),
        "asp": (47.1, 124, 7.0),
        "ssp": (61.4, 104, 7.2),
        "backup:1": (49.0, 174, 12.1),
        "eager-solo": (42.2, None, None),
        "eager-majority": (48.7, 228, 11.1),
    },
    "3x": {
        "bsp": (57.9, 236, 13.8),
        "lb-ema": (44.3, 231, 10.3),
        "asp": (37.9, 133, 5.6),
        "ssp": (54.3, 106, 6.8),
        "backup:1": (42.7, 178, 10.3),
        "eager-solo": (36.5, None, None),
        "eager-majority": (44.6, 236, 10.4),
    },
    "load": {
        "bsp": (127.9, 231, 29.5),
        "lb-ema": (123.0, 237, 29.6),
        "asp": (83.2, 102, 11.4),
        "ssp": (93.3, 86, 9.2),
        "backup:1": (104.3, 166, 23.0),
        "eager-solo": (92.7, None, None),
        "eager-majority": (110.7, 238, 27.2),
    },
}

ORCHESTRA_SCHEMES = ("bsp", "lb-ema", "local-sgd", "orchestra", "orchestra-paper")
MEASURED_ORCHESTRA: dict[str, dict[str, tuple[float, float | None, float | None]]] = {
    "2x": {  # docs/benchmarks.md, Orchestra's Table 2 comparison, measured 2026-11-26
        "bsp": (54.6, 238, 13.0),
        "lb-ema": (43.8, 226, 9.9),
        "local-sgd": (41.8, 256, 10.7),
        "orchestra": (45.4, 247, 10.2),
        "orchestra-paper": (47.1, 241, 9.7),
    },
    "3x": {
        "bsp": (54.5, 235, 13.0),
        "lb-ema": (37.9, 234, 8.8),
        "local-sgd": (41.7, 256, 10.7),
        "orchestra": (29.9, 244, 7.2),
        "orchestra-paper": (34.3, 247, 8.0),
    },
}


def _data() -> tuple[VirtualData, tuple[int, ...], int]:
    torch.set_num_threads(1)
    train, test = federation_pool("fashion-mnist", "", 0, 0.2, 0)
    data = VirtualData(
        torch.as_tensor(train.x),
        torch.as_tensor(train.y),
        torch.as_tensor(test.x[:2000]),
        torch.as_tensor(test.y[:2000]),
    )
    return data, tuple(train.x.shape[1:]), train.num_classes


def _run(
    policy: str, job: VirtualJob, data: tuple[VirtualData, tuple[int, ...], int]
) -> VirtualResult:
    dataset, shape, classes = data
    return run_virtual(policy, job, build_model("mlp", shape, classes, job.seed), dataset)


def _mean(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else statistics.fmean(values)  # type: ignore[arg-type]


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _compare(
    settings: list[str],
    schemes: tuple[str, ...],
    measured: dict[str, dict[str, tuple[float, float | None, float | None]]],
    seeds: tuple[int, ...],
    data: tuple[VirtualData, tuple[int, ...], int],
) -> tuple[list[list[str]], dict[str, Any]]:
    total = 4 * BATCH
    rows: list[list[str]] = []
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for setting in settings:
        relative, load = SETTINGS[setting]
        found[setting] = {}
        for scheme in schemes:
            runs = []
            for seed in seeds:
                job = VirtualJob(
                    tuple(BASE_SPEED * v for v in relative),
                    batch_size=BATCH,
                    lr=LR,
                    load=load,
                    target=TARGET,
                    max_samples=500 * total,
                    max_seconds=300.0,
                    eval_every_s=0.5,
                    seed=seed,
                )
                runs.append(_run(scheme, job, data))
            steps = _mean(
                [None if r.samples_to_target is None else r.samples_to_target / total for r in runs]
            )
            found[setting][scheme] = {
                "iteration_s": statistics.fmean(r.iteration_s for r in runs),
                "steps_to_target": steps,
                "time_to_target_s": _mean([r.time_to_target_s for r in runs]),
                "reached": sum(r.time_to_target_s is not None for r in runs),
            }
        bsp, real_bsp = found[setting]["bsp"], measured[setting]["bsp"]
        for scheme in schemes:
            mine, real = found[setting][scheme], measured[setting][scheme]
            steps, real_steps = mine["steps_to_target"], real[1]
            assert real_bsp[1] is not None
            rows.append(
                [
                    setting,
                    scheme,
                    f"{mine['iteration_s'] * 1000:.1f} / {real[0]:.1f}",
                    f"{mine['iteration_s'] / bsp['iteration_s']:.2f} / {real[0] / real_bsp[0]:.2f}",
                    f"{_fmt(steps, '.0f')} / {_fmt(real_steps, '.0f')}",
                    f"{_fmt(None if steps is None else steps / bsp['steps_to_target'], '.2f')} / "
                    f"{_fmt(None if real_steps is None else real_steps / real_bsp[1], '.2f')}",
                    f"{_fmt(mine['time_to_target_s'], '.1f')} / {_fmt(real[2], '.1f')}",
                    f"{mine['reached']}/{len(seeds)}",
                ]
            )
    return rows, found


HEADERS = [
    "speeds",
    "scheme",
    "ms / worker iteration (virtual / measured)",
    "vs bsp",
    "X-steps to target",
    "vs bsp",
    "s to target",
    "reached (virtual)",
]


def validation(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    seeds = (0,) if quick else (0, 1)
    data = _data()
    rows, found = _compare(list(SETTINGS), SCHEMES, MEASURED, seeds, data)
    text = table(HEADERS, rows)
    text += (
        f"\n\nClock: virtual. 4 workers, MLP on Fashion-MNIST, B = {BATCH} (X = {4 * BATCH}), "
        f"SGD at lr {LR} for every scheme, target {TARGET}, at most 500 BSP iterations' worth "
        f"of samples, test accuracy on 2,000 images every 0.5 virtual s (as the real "
        f"snapshots), seeds {list(seeds)}; speeds {BASE_SPEED:.0f} samples/s x the relative "
        "speed, load: a competing process per worker switching with probability 0.15 every "
        "0.1 virtual s. Measured: docs/benchmarks.md's table (clock: measured, 2026-11-24)."
    )
    rows, orchestra = _compare(["2x", "3x"], ORCHESTRA_SCHEMES, MEASURED_ORCHESTRA, seeds, data)
    text += "\n\nOrchestra's comparison (measured 2026-11-26):\n\n" + table(HEADERS, rows)
    return text, {"validation": found, "validation_orchestra": orchestra}


# ---- 2. the crossover map -------------------------------------------------------------

WORKERS = (4, 16, 32, 64)
SPREADS = (1, 2, 3, 4, 8)
RULES = ("same", "scaled")


def crossover_schemes(workers: int) -> list[str]:
    return ["bsp", "lb-ema", f"backup:{max(1, workers // 8)}", "asp", "ssp", "orchestra"]


SYNCHRONOUS = ("bsp", "lb-ema", "backup")  # the schemes whose lr the scaled rule changes


def crossover(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    workers_list, spreads, seeds = ((4, 16), (1, 4), (0,)) if quick else (WORKERS, SPREADS, (0, 1))
    data = _data()
    OUT.mkdir(parents=True, exist_ok=True)
    lines = OUT / ("crossover-quick.jsonl" if quick else "crossover.jsonl")
    results: dict[tuple[int, int, str, str], list[dict[str, Any]]] = {}
    began = time.perf_counter()
    with lines.open("w") as handle:
        for workers in workers_list:
            for spread in spreads:
                speeds = tuple(float(v) for v in BASE_SPEED * np.geomspace(spread, 1, workers))
                for scheme in crossover_schemes(workers):
                    for rule in RULES:
                        if rule == "scaled" and not scheme.startswith(SYNCHRONOUS):
                            continue  # an update over B samples: the rule leaves lr as is
                        for seed in seeds:
                            job = VirtualJob(
                                speeds,
                                batch_size=BATCH,
                                lr=LR,
                                lr_rule="linear" if rule == "scaled" else "same",
                                lr_max=LR_MAX,
                                warmup=10,
                                target=TARGET,
                                max_seconds=20.0,
                                patience_s=4.0,
                                eval_every_s=0.1,
                                seed=seed,
                            )
                            result = _run(scheme, job, data)
                            row = {
                                "workers": workers,
                                "spread": spread,
                                "scheme": scheme,
                                "lr_rule": rule,
                                "seed": seed,
                                **{k: v for k, v in result.summary().items() if k != "curve"},
                            }
                            handle.write(json.dumps(row) + "\n")
                            handle.flush()
                            results.setdefault((workers, spread, scheme, rule), []).append(row)
    elapsed = time.perf_counter() - began
    winners, rows = _winners(results, workers_list, spreads)
    plot = _heatmap(
        winners, workers_list, spreads, OUT / ("crossover-quick.png" if quick else "crossover.png")
    )
    text = table(
        [
            "workers",
            "max/min speed",
            "first at the same lr",
            "first with scaled lr",
            "bsp / lb-ema / backup / asp / ssp / orchestra s (same lr)",
            "bsp / lb-ema / backup s (scaled lr)",
        ],
        rows,
    )
    text += (
        f"\n\nClock: virtual. MLP on Fashion-MNIST, B = {BATCH} per worker, speeds "
        f"{BASE_SPEED:.0f} samples/s x geomspace(spread, 1, workers), target {TARGET}, seeds "
        f"{list(seeds)} (a scheme counts only where every seed reached the target; s: the "
        "mean over seeds), at most 20 virtual s per run, a run ends when its test accuracy has "
        f"not improved for 4 virtual s. Same lr: {LR} everywhere. Scaled: the synchronous "
        f"schemes' lr = {LR} x (samples per update) / {BATCH}, capped at {LR_MAX}, warm-up "
        "over 10 updates; asp, ssp and orchestra's local steps (updates of B samples) keep "
        f"{LR}. backup:K with K = max(1, workers // 8); ssp:5; orchestra:4. JSON lines: "
        f"{lines}; heatmap: {plot}; {elapsed / 60:.0f} minutes on one core."
    )
    return text, {"crossover": {f"{w}x{s}": v for (w, s), v in winners.items()}}


def _winners(
    results: dict[tuple[int, int, str, str], list[dict[str, Any]]],
    workers_list: tuple[int, ...],
    spreads: tuple[int, ...],
) -> tuple[dict[tuple[int, int], dict[str, Any]], list[list[str]]]:
    winners, rows = {}, []
    for workers in workers_list:
        for spread in spreads:
            cell: dict[str, dict[str, float]] = {"same": {}, "scaled": {}}
            for (w, s, scheme, rule), runs in results.items():
                if (w, s) != (workers, spread):
                    continue
                mean = _mean([r["time_to_target_s"] for r in runs])
                cell[rule][scheme] = math.inf if mean is None else mean
            for scheme, seconds in cell["same"].items():  # the scaled race: all schemes
                if not scheme.startswith(SYNCHRONOUS):
                    cell["scaled"][scheme] = seconds
            best = {rule: min(times, key=times.__getitem__) for rule, times in cell.items()}
            winners[(workers, spread)] = {"best": best, "seconds": cell}

            names = crossover_schemes(workers)
            rows.append(
                [
                    str(workers),
                    f"{spread}x",
                    _label(best["same"], cell["same"]),
                    _label(best["scaled"], cell["scaled"]),
                    _show(cell["same"], names),
                    _show(cell["scaled"], names[:3]),
                ]
            )
    return winners, rows


def _show(times: dict[str, float], names: list[str]) -> str:
    return " / ".join(_fmt(None if math.isinf(times[n]) else times[n], ".1f") for n in names)


def _label(best: str, times: dict[str, float]) -> str:
    if math.isinf(times[best]):
        return "none"
    others = sorted(v for k, v in times.items() if k != best)
    lead = f" ({others[0] / times[best]:.2f}x)" if others and not math.isinf(others[0]) else ""
    return f"{best}{lead}"


def _heatmap(
    winners: dict[tuple[int, int], dict[str, Any]],
    workers_list: tuple[int, ...],
    spreads: tuple[int, ...],
    path: Path,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = ["bsp", "lb-ema", "backup", "asp", "ssp", "orchestra", "none"]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, rule in zip(axes, RULES, strict=True):
        grid = np.zeros((len(workers_list), len(spreads)))
        for i, workers in enumerate(workers_list):
            for j, spread in enumerate(spreads):
                cell = winners[(workers, spread)]
                best = cell["best"][rule]
                seconds = cell["seconds"][rule][best]
                family = "none" if math.isinf(seconds) else best.split(":")[0]
                grid[i, j] = families.index(family)
                text = "none" if family == "none" else f"{best}\n{seconds:.1f} s"
                axis.text(j, i, text, ha="center", va="center", fontsize=7)
        axis.imshow(grid, cmap="tab10", vmin=0, vmax=9, aspect="auto")
        axis.set_xticks(range(len(spreads)), [f"{s}x" for s in spreads])
        axis.set_yticks(range(len(workers_list)), [str(w) for w in workers_list])
        axis.set(xlabel="max/min speed", ylabel="workers")
        axis.set_title(f"first to {TARGET} ({'same lr' if rule == 'same' else 'sync lr scaled'})")
    figure.suptitle("Straggler schemes, clock: virtual (fedlb.cluster.virtual)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main() -> None:
    run_benchmark(
        "fedlb.cluster virtual-clock benchmark",
        __doc__.splitlines()[0],
        f"torch {torch.__version__}, one thread. Clock: virtual (no sleeping; time from the "
        "speeds and fixed costs, gradients real).",
        [
            ("Validation against the measured 4-worker table", validation),
            ("Crossover map: workers x speed spread", crossover),
        ],
    )


if __name__ == "__main__":
    main()
