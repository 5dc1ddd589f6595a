"""The straggler schemes' race to a target accuracy, for benchmarks/cluster.py (its sections
4 and 5): the job every scheme trains, the speed settings, every scheme run at every
setting and seed with an accuracy-over-time plot, and the table's columns and note."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from fedlb.experiments import ClusterScenario, launch

SETTINGS = {  # name: (relative speeds, competing load)
    "1x": ("1,1,1,1", 0.0),
    "2x": ("1,1.26,1.59,2", 0.0),
    "3x": ("1,1.44,2.08,3", 0.0),
    "load": ("1,1,1,1", 0.15),
}
SCHEME_JOB: dict[str, Any] = {
    "dataset": "fashion-mnist",
    "model": "mlp",
    "batch-size": 32,
    "learning-rate": 0.05,
    "base-speed": 800.0,
    "snapshot-s": 0.5,
    "eval-samples": 2000,
    "narx-warmup": 60,
}


def _iteration_s(folder: Path, wall: float) -> float:
    """A worker's mean iteration time: the wall time over the iterations each ran."""
    counts: dict[int, int] = {}
    for line in (folder / "iterations.jsonl").read_text().splitlines():
        rank = json.loads(line)["rank"]
        counts[rank] = counts.get(rank, 0) + 1
    return wall / statistics.fmean(counts.values())


def _accuracy_at(curve: list[dict[str, float]], seconds: float) -> float:
    """The accuracy of the last snapshot taken by `seconds`."""
    return [p for p in curve if p["seconds"] <= seconds][-1]["accuracy"]


def compare_to_accuracy(
    root: Path,
    settings: dict[str, tuple[str, float]],
    schemes: tuple[str, ...],
    iterations: int,
    seeds: tuple[int, ...],
    target: float,
) -> tuple[list[list[str]], dict[str, Any], dict[str, dict[str, list[dict[str, Any]]]]]:
    """Run every scheme at every setting and seed under the folder `root`; (table rows,
    figures, every run's summary), one accuracy-over-time plot per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    total = 4 * int(SCHEME_JOB["batch-size"])  # X
    rows, data, every = [], {}, {}
    for setting, (speeds, load) in settings.items():
        chosen = schemes + (("lb-narx",) if load else ())
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in chosen}
        for seed in seeds:
            for scheme in chosen:
                job = {**SCHEME_JOB, "speeds": speeds, "load": load, "seed": seed}
                job |= {"iterations": iterations, "policy": scheme, "target-accuracy": target}
                folder = root / setting / f"seed-{seed}" / scheme.replace(":", "-")
                if launch(ClusterScenario.from_mapping(job), folder, timeout=900) != 0:
                    raise RuntimeError(f"{scheme} ({setting}) failed: see {folder}/torchrun.log")
                summary = json.loads((folder / "summary.json").read_text())
                summary["iteration_s"] = _iteration_s(folder, summary["wall_s"])
                runs[scheme].append(summary)
        every[setting] = runs
        figure, axis = plt.subplots(figsize=(7, 4))
        for scheme, summaries in runs.items():
            curve = summaries[0]["accuracy"]
            axis.plot([p["seconds"] for p in curve], [p["accuracy"] for p in curve], label=scheme)
        axis.axhline(target, color="grey", linewidth=0.8, linestyle=":")
        axis.set(xlabel="wall s (clock: measured, emulated speeds)", ylabel="test accuracy")
        axis.set_title(f"4 workers at {setting}: accuracy over time (seed {seeds[0]})")
        axis.legend(fontsize=7)
        figure.tight_layout()
        plot = root / f"accuracy-{setting}.png"
        figure.savefig(plot, dpi=110)
        plt.close(figure)
        # equal wall time: BSP's run, seed by seed (a run that ended sooner keeps its last)
        equal = [runs["bsp"][k]["wall_s"] for k in range(len(seeds))]
        bsp = runs["bsp"]
        asp = runs.get("asp")

        def mean(values: list[float | None]) -> float | None:
            return None if any(v is None for v in values) else statistics.fmean(values)  # type: ignore[arg-type]

        bsp_steps = mean([s["samples_to_target"] for s in bsp])
        setting_data = {}
        for scheme, summaries in runs.items():
            times = [s["time_to_target_s"] for s in summaries]
            steps = mean([s["samples_to_target"] for s in summaries])
            t_iter = statistics.fmean(s["iteration_s"] for s in summaries)
            at_equal = statistics.fmean(
                _accuracy_at(s["accuracy"], equal[k]) for k, s in enumerate(summaries)
            )
            reached = sum(t is not None for t in times)
            entry = {
                "iteration_s": t_iter,
                "iteration_vs_bsp": t_iter / statistics.fmean(s["iteration_s"] for s in bsp),
                "iteration_vs_asp": None
                if asp is None
                else t_iter / statistics.fmean(s["iteration_s"] for s in asp),
                "steps_to_target": None if steps is None else steps / total,
                "steps_vs_bsp": None if steps is None or not bsp_steps else steps / bsp_steps,
                "time_to_target_s": mean(times),
                "reached": reached,
                "accuracy_at_equal_time": at_equal,
                "final_accuracy": statistics.fmean(s["final_accuracy"] for s in summaries),
            }
            setting_data[scheme] = entry
            rows.append(
                [
                    setting,
                    scheme,
                    f"{t_iter * 1000:.1f}",
                    f"{entry['iteration_vs_bsp']:.2f}",
                    "–"
                    if entry["iteration_vs_asp"] is None
                    else f"{entry['iteration_vs_asp']:.2f}",
                    "–" if entry["steps_to_target"] is None else f"{entry['steps_to_target']:.0f}",
                    "–" if entry["steps_vs_bsp"] is None else f"{entry['steps_vs_bsp']:.2f}",
                    f"{reached}/{len(seeds)}",
                    "–"
                    if entry["time_to_target_s"] is None
                    else f"{entry['time_to_target_s']:.1f}",
                    f"{at_equal:.3f}",
                ]
            )
        data[setting] = {"schemes": setting_data, "equal_wall_s": equal, "plot": str(plot)}
    return rows, data, every


COMPARISON_HEADERS = [
    "speeds",
    "scheme",
    "ms / worker iteration",
    "vs bsp",
    "vs asp",
    "X-steps to target",
    "vs bsp",
    "reached",
    "s to target",
    "acc at equal time",
]


def setting_note(iterations: int, seeds: tuple[int, ...], target: float) -> str:
    total = 4 * int(SCHEME_JOB["batch-size"])
    return (
        f"4 workers (a parameter-server process besides them for asp, ssp, backup), MLP on "
        f"Fashion-MNIST, B = 32 per worker (X = {total}), SGD at lr 0.05, {iterations} BSP "
        f"iterations' worth of samples per run (asp, ssp: {iterations * 4} pushes; eager: "
        f"{iterations} collectives), seeds {list(seeds)}, target {target}. Clock: measured "
        "(sleep-padded to 800 samples/s x the relative speed; 'load': every worker gets a "
        "competing process that switches on or off with probability 0.15 every 0.1 s). "
        "ms / worker iteration: the wall time over the iterations each worker ran (the "
        "hardware efficiency); X-steps: samples in the applied updates until the target, in "
        "units of X (the statistical efficiency); acc at equal time: each scheme's accuracy "
        "when BSP's run ended (its last, for a run that ended sooner). Means over seeds; "
        "'–' where a seed did not reach the target. Accuracy is evaluated after each run on "
        "snapshots of the weights taken every 0.5 s (2,000 test images)."
    )
