"""PNG plots of a policy comparison (matplotlib, no display needed).

matplotlib is imported when a plot is drawn: it adds about a second to every `fedlb`
command's start otherwise."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlb.flower import accuracy_of

if TYPE_CHECKING:
    from .results import PolicyResult
    from .scenario import Scenario


def _save(figure: Any, path: Path, right: float = 1.0) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout(rect=(0, 0, right, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_results(scenario: Scenario, results: dict[str, PolicyResult], out: Path) -> list[Path]:
    """accuracy.png, batch_sizes.png, round_time.png and idle.png in `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    clock = f"clock: {scenario.clock_label()}"
    written = []

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        points: list[tuple[float, float]] = []
        for t, record in zip(result.clock_s, result.records, strict=True):
            accuracy = accuracy_of(record)
            if accuracy is not None:
                points.append((t, accuracy))
        axis.plot([t for t, _ in points], [a for _, a in points], marker="o", ms=3, label=name)
    axis.axhline(scenario.target_accuracy, color="grey", ls="--", lw=1, label="target")
    axis.set_xlabel(f"time (s, {clock})")
    axis.set_ylabel("test accuracy")
    axis.set_title(f"{scenario.name}: accuracy against time")
    axis.legend()
    written.append(_save(figure, out / "accuracy.png"))

    names = list(results)
    all_silos = sorted({s.silo for r in results.values() for rec in r.records for s in rec.silos})
    colour = {silo: f"C{i % 10}" for i, silo in enumerate(all_silos)}
    figure, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), squeeze=False)
    for axis, name in zip(axes[0], names, strict=True):
        records = results[name].records
        for silo in all_silos:
            points = [(r.round, s.batch_size) for r in records for s in r.silos if s.silo == silo]
            if points:
                axis.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    marker=".",
                    color=colour[silo],
                    label=silo,
                )
        axis.set_title(name)
        axis.set_xlabel("round")
        axis.xaxis.get_major_locator().set_params(integer=True)
    axes[0][0].set_ylabel("batch size B")
    handles = [Line2D([], [], color=colour[s], marker=".", label=s) for s in all_silos]
    figure.legend(handles=handles, loc="upper right", fontsize=7)
    figure.suptitle("batch size per silo per round (silos a policy dropped are not drawn)")
    written.append(_save(figure, out / "batch_sizes.png", right=0.93))

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        line = axis.plot(
            [r.round for r in result.records],
            [math.nan if r.round_s is None else r.round_s for r in result.records],
            marker="o",
            ms=3,
            label=name,
        )
        axis.plot(
            [r.round for r in result.records],
            [math.nan if r.ideal_s is None else r.ideal_s for r in result.records],
            ls=":",
            color=line[0].get_color(),
        )
    axis.set_xlabel("round")
    axis.set_ylabel(f"round time (s, {clock})")
    axis.set_title("round time (solid) against the ideal T* (dotted)")
    axis.legend()
    written.append(_save(figure, out / "round_time.png"))

    figure, axis = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        records = results[name].records
        silos = sorted({s.silo for r in records for s in r.silos})
        shares = []
        for silo in silos:
            idle = sum(
                s.idle_s
                for r in records
                for s in r.silos
                if s.silo == silo and math.isfinite(s.idle_s)
            )
            total = sum(r.round_s or 0.0 for r in records)
            shares.append(idle / total if total else 0.0)
        axis.bar([i + k * width for i in range(len(silos))], shares, width, label=name)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(silos))], silos)
    axis.set_ylabel("share of run time idle")
    axis.set_title(f"idle share per silo ({clock})")
    axis.legend()
    written.append(_save(figure, out / "idle.png"))
    written.append(plot_best_by_round(scenario, {scenario.seed: results}, out))
    return written


def _accuracy_by_seed(results: list[PolicyResult]) -> Any:
    """One policy's accuracy per seed (rows) and round (columns, as many as every seed
    ran), NaN where a round has none."""
    import numpy as np

    rounds = min(len(r.records) for r in results)
    return np.array(
        [
            [math.nan if (a := accuracy_of(r.records[k])) is None else a for k in range(rounds)]
            for r in results
        ]
    )


def _mean_and_band(axis: Any, x: Any, values: Any, label: str) -> None:
    """The mean over seeds (rows of `values`) as a line, the lowest to highest as a band."""
    import numpy as np

    line = axis.plot(x, np.nanmean(values, axis=0), marker="o", ms=3, label=label)
    if len(values) > 1:
        axis.fill_between(
            x,
            np.nanmin(values, axis=0),
            np.nanmax(values, axis=0),
            color=line[0].get_color(),
            alpha=0.15,
        )


def plot_seeds(
    scenario: Scenario, runs: dict[int, dict[str, PolicyResult]], out: Path
) -> list[Path]:
    """accuracy.png in `out`: each policy's accuracy per round, the mean over the seeds
    against the mean clock time, with the band between the lowest and highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name in scenario.policy_names():
        results = [by_policy[name] for by_policy in runs.values()]
        accuracy = _accuracy_by_seed(results)
        rounds = accuracy.shape[1]
        times = np.array([r.clock_s[:rounds] for r in results]).mean(axis=0)
        _mean_and_band(axis, times, accuracy, name)
    axis.axhline(scenario.target_accuracy, color="grey", ls="--", lw=1, label="target")
    axis.set_xlabel(f"time (s, clock: {scenario.clock_label()}; mean over seeds)")
    axis.set_ylabel("test accuracy")
    axis.set_title(
        f"{scenario.name}: accuracy, mean of {len(runs)} seeds (band: lowest to highest)"
    )
    axis.legend()
    return [_save(figure, out / "accuracy.png"), plot_best_by_round(scenario, runs, out)]


def plot_best_by_round(
    scenario: Scenario, runs: dict[int, dict[str, PolicyResult]], out: Path
) -> Path:
    """accuracy_by_round.png in `out`: each policy's best accuracy so far against the
    round (the LB-BSP paper's Fig. 13 measure), the mean over the seeds with the band
    between the lowest and highest: what each policy learns per round, whatever its
    speed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name in scenario.policy_names():
        results = [by_policy[name] for by_policy in runs.values()]
        accuracy = _accuracy_by_seed(results)
        rounds = accuracy.shape[1]
        best = np.fmax.accumulate(accuracy, axis=1)
        _mean_and_band(axis, np.arange(1, rounds + 1), best, name)
    axis.axhline(scenario.target_accuracy, color="grey", ls="--", lw=1, label="target")
    axis.set_xlabel("round")
    axis.set_ylabel("best test accuracy so far")
    seeds = f"\nmean of {len(runs)} seeds, band: lowest to highest" if len(runs) > 1 else ""
    axis.set_title(f"{scenario.name}: best accuracy so far, by round{seeds}", fontsize=11)
    axis.legend()
    return _save(figure, out / "accuracy_by_round.png")


def redraw_plots(
    scenario: Scenario, runs: dict[int, dict[str, PolicyResult]], out: Path
) -> list[Path]:
    """The PNGs of a finished experiment (load_results), drawn again in `out` (with the
    scenario's target line, e.g. another --target-accuracy)."""
    if scenario.repeats > 1:
        return plot_seeds(scenario, runs, out)
    return plot_results(scenario, runs[scenario.seed], out)
