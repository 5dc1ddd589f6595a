"""The adaptive default against stock and the fixed floor: one table across settings.

Reads the runs of two benchmarks and prints, per setting, what a user judges (issue 37):
dead networks, time to the same accuracy, final accuracy at equal rounds, and E, for
stock FedAvg, the guard's fixed floor (the default before the probe) and the default
(the probe on), plus the probe's verdicts and full balance (no guard) where it ran.

- `benchmarks/app_accuracy.py --json` lines (Flower's own apps): policies `stock`,
  `guard:probe=0` (the floor), `default`, `unguarded`; one setting per (app, partition,
  learning rate, speeds).
- `fedlb experiment --repeats K` folders (their summary.json): policies `fedavg`,
  `lb-floor`, `lb`, `lb-full`; one setting per scenario (a later folder of the same
  scenario adds the seeds it ran, e.g. `--seed 10 --repeats 10`, and replaces those it
  ran again).

Definitions, the same for both:
- collapsed: final central accuracy <= 0.15 (a dead network; 10-class tasks only);
- time to target: model-clock seconds until the central accuracy first reached the
  target, the median over the seeds, a seed that never reached it counting as longer.
  App runs: 0.9 x stock's median final accuracy, rounded down to 0.05 (a level most
  runs reach within the rounds run: balanced policies end their rounds in about half
  stock's clock time, so a target only stock's last round reaches says nothing of
  time), or `--target`; experiments: the scenario's target;
- E: the mean over every round, round 1 (uniform sizes) included, on the model clock;
- regime: how many of the default's runs its probe found stable;
- second run (`app_accuracy.py --second-run`, `fedlb experiment --second-run`): each
  balanced policy's second run: the default takes up its first run's verdict and, where
  stable, starts round 1 from the first run's stored profiles (the floor always does);
  stock's runs are its first (nothing of a first run changes a stock run).

    .venv/bin/python benchmarks/adaptive_default.py --apps docs/results/adaptive-default/*.jsonl \
        --experiments docs/results/adaptive-default/experiment-*
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.app_accuracy import DEAD, time_to

# (app policy, experiment policy) -> the table's name
SECOND_RUN = ", second run"  # a setting's name, where its runs are second runs
ROLES = {
    "stock": "stock",
    "fedavg": "stock",
    "guard:probe=0": "floor",
    "lb-floor": "floor",
    "default": "default",
    "lb": "default",
    "unguarded": "full",
    "lb-full": "full",
}
COLUMNS = ("stock", "floor", "default")


def median_time(times: list[float | None]) -> float:
    """The median over every run, a run that never got there counting as longer."""
    ordered = sorted(math.inf if t is None else t for t in times)
    return ordered[len(ordered) // 2] if ordered else math.nan


def timing(times: dict[int, float | None]) -> dict[str, Any]:
    """A role's time-to-target figures from each seed's time (None: never reached): the
    median, how many reached it, and the times themselves (for the paired ratio). No
    times (an app without a central evaluation per round): no median."""
    return {
        "time_to_target": median_time(list(times.values())),
        "reached": sum(t is not None for t in times.values()),
        "times": times,
    }


def app_regime(row: dict[str, Any]) -> str:
    """A row's probe verdict (rows written before it was recorded: from the final floor,
    0 only where the probe found the run stable)."""
    if "regime" in row:
        return str(row["regime"])
    return "stable" if row.get("floor") == 0.0 else "edge"


def mean_e(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(kept) if kept else None


def app_settings(files: list[Path], target: float | None) -> list[dict[str, Any]]:
    groups: dict[tuple[Any, ...], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for path in files:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            role = ROLES.get(row["policy"])
            if role is None:
                continue
            lr = row["overrides"].get("learning-rate", "app's")
            key = (row["app"], row.get("partition", "iid"), lr, tuple(row["speeds"]))
            groups[(*key, bool(row.get("second_run")))][role].append(row)
    for group, by_role in groups.items():  # stock has no second run: its only run stands
        if group[-1] and "stock" not in by_role:
            first_run = groups.get((*group[:-1], False), {})
            by_role["stock"] = list(first_run.get("stock", []))
    settings = []
    for (app, partition, lr, speeds, second), by_role in sorted(groups.items(), key=str):
        stock = [r["final_accuracy"] for r in by_role.get("stock", [])]
        goal = target
        if goal is None and stock:
            goal = math.floor(0.9 * statistics.median(stock) / 0.05 + 1e-9) * 0.05
        roles = {}
        for role, rows in by_role.items():
            seeds = {r["seed"]: r for r in rows}  # one run per seed (the last one)
            rows = [seeds[s] for s in sorted(seeds)]
            roles[role] = {
                "runs": len(rows),
                "collapsed": sum(r["final_accuracy"] <= DEAD for r in rows),
                # an app without a central evaluation per round (flwr new): no time
                **timing(
                    {r["seed"]: time_to(r, goal) for r in rows}
                    if goal and any(r.get("accuracy_by_round") for r in rows)
                    else {}
                ),
                "final_accuracy": [r["final_accuracy"] for r in rows],
                "E": mean_e([e for r in rows for e in r["efficiency"]]),
                "stable": sum(app_regime(r) == "stable" for r in rows)
                if role == "default"
                else None,
            }
        spread = max(speeds) / min(speeds)
        settings.append(
            {
                "setting": f"{app}, {partition}, η {lr}, {len(speeds)} silos 1:{spread:g}, "
                f"{rows[0]['rounds']} rounds" + (SECOND_RUN if second else ""),
                "target": goal,
                "roles": roles,
            }
        )
    return settings


def seeds_summary(folder: Path) -> dict[str, Any]:
    """An experiment's summary.json, its seeds' own under `per_seed` (read from each
    seed-S/summary.json where the combined one is missing: a run stopped early)."""
    path = folder / "summary.json"
    if path.exists():
        return dict(json.loads(path.read_text()))
    seeds = {
        p.parent.name.removeprefix("seed-"): json.loads(p.read_text())
        for p in sorted(folder.glob("seed-*/summary.json"))
    }
    if not seeds:
        raise SystemExit(f"{folder}: no summary.json, and no seed-*/summary.json")
    first = next(iter(seeds.values()))
    return {
        **first,
        "policies": {
            name: {"per_seed": {seed: s["policies"][name] for seed, s in seeds.items()}}
            for name in first["policies"]
        },
    }


def experiment_settings(folders: list[Path]) -> list[dict[str, Any]]:
    # setting name -> (its target, role -> seed -> that seed's summary); a later folder of
    # the same scenario adds the seeds it ran and replaces those it ran again
    runs: dict[str, tuple[float, dict[str, dict[str, dict[str, Any]]]]] = {}
    ten_classes: dict[str, bool] = {}
    for folder in folders:
        summary = seeds_summary(folder)
        scenario = summary["scenario"]
        name = (
            f"experiment {scenario.get('name') or folder.name}: "
            f"{scenario['dataset']} {scenario['model']}, {scenario['partition']}, "
            f"η {scenario['learning_rate']}, {scenario['silos']} silos "
            f"{scenario['speeds']}, {scenario['rounds']} rounds"
            + (SECOND_RUN if scenario.get("second_run") else "")
        )
        ten_classes[name] = scenario["dataset"] in ("digits", "fashion-mnist")
        _, by_role = runs.setdefault(name, (scenario["target_accuracy"], {}))
        for policy, combined in summary["policies"].items():
            role = ROLES.get(policy)
            if role is None:
                continue
            seeds = combined.get("per_seed", {str(scenario["seed"]): combined})
            by_role.setdefault(role, {}).update(seeds)
    for name, (_, by_role) in runs.items():  # stock has no second run: its only run stands
        if name.endswith(SECOND_RUN) and "stock" not in by_role:
            first_run = runs.get(name.removesuffix(SECOND_RUN), (0.0, {}))[1]
            if "stock" in first_run:
                by_role["stock"] = first_run["stock"]
    settings: list[dict[str, Any]] = []
    for name, (target, by_role) in runs.items():
        roles = {}
        for role, seeds in by_role.items():
            ordered = [seeds[s] for s in sorted(seeds, key=int)]
            finals = [r["final_accuracy"] for r in ordered]
            roles[role] = {
                "runs": len(ordered),
                "collapsed": sum(a <= DEAD for a in finals) if ten_classes[name] else None,
                **timing({int(s): seeds[s]["time_to_target_s"] for s in seeds}),
                "final_accuracy": finals,
                "E": mean_e([r["mean_balance_efficiency"] for r in ordered]),
                "stable": sum((r.get("stability") or {}).get("regime") == "stable" for r in ordered)
                if role == "default"
                else None,
            }
        settings.append({"setting": name, "target": target, "roles": roles})
    return settings


def paired_ratios(floor: dict[str, Any], default: dict[str, Any]) -> list[float]:
    """Each seed both ran: the floor's time over the default's (a seed's own partition,
    model and data order: the pairing removes what the seed does to both); a seed neither
    reached the target in is left out, one only the default reached counts as infinite."""
    a, b = floor.get("times", {}), default.get("times", {})
    ratios = []
    for seed in set(a) & set(b):
        fa = math.inf if a[seed] is None else a[seed]
        fb = math.inf if b[seed] is None else b[seed]
        if math.isinf(fa) and math.isinf(fb):
            continue  # neither reached it: no ratio
        ratios.append(math.inf if math.isinf(fa) else fa / fb)
    return ratios


def paired_ratio(floor: dict[str, Any], default: dict[str, Any]) -> float | None:
    """The median of the paired ratios; None where under two seeds pair up."""
    ratios = paired_ratios(floor, default)
    return statistics.median(ratios) if len(ratios) >= 2 else None


def paired_interval(
    floor: dict[str, Any], default: dict[str, Any], confidence: float = 0.95
) -> tuple[float, float] | None:
    """A bootstrap interval (percentile, seeds resampled) of the paired ratios' median:
    how sure the seeds make the ratio; None under five pairs."""
    ratios = paired_ratios(floor, default)
    if len(ratios) < 5:
        return None
    with np.errstate(invalid="ignore"):  # a seed only the default reached: an infinite ratio
        result = stats.bootstrap(
            (np.array(ratios),),
            np.median,
            confidence_level=confidence,
            n_resamples=4000,
            method="percentile",
            rng=np.random.default_rng(0),  # the table is the same on every rerun
        )
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def more_collapses_p(stock: dict[str, Any], default: dict[str, Any]) -> float | None:
    """Fisher's exact test, one-sided: the chance of the default's collapses being as many
    more than stock's as seen (or more) if both lost networks at the same rate. Small:
    the default loses more; near 1: no sign of it. None where either has no count."""
    if stock.get("collapsed") is None or default.get("collapsed") is None:
        return None
    counts = [
        [default["collapsed"], default["runs"] - default["collapsed"]],
        [stock["collapsed"], stock["runs"] - stock["collapsed"]],
    ]
    return float(stats.fisher_exact(counts, alternative="greater").pvalue)


def comparison(roles: dict[str, Any]) -> dict[str, Any]:
    """The default against the floor's times and stock's collapses (where both ran)."""
    floor, default, stock = roles.get("floor"), roles.get("default"), roles.get("stock")
    out: dict[str, Any] = {}
    if floor and default:
        out["paired_ratio"] = paired_ratio(floor, default)
        out["paired_interval_95"] = paired_interval(floor, default)
    if stock and default:
        out["more_collapses_p"] = more_collapses_p(stock, default)
    return out


def with_comparisons(settings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each setting with its `comparison` (the bootstrap runs once per setting, for both
    the table and the JSON)."""
    return [{**s, "comparison": comparison(s["roles"])} for s in settings]


def cell(values: list[str]) -> str:
    return " / ".join(values)


def seconds(value: float) -> str:
    if math.isnan(value):
        return "–"
    return "never" if math.isinf(value) else f"{value:.1f}"


def ratio_text(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.2f}"


def table(settings: list[dict[str, Any]]) -> str:
    """The markdown table of `settings`, each with its `comparison` (with_comparisons)."""
    out = [
        "| setting | seeds | collapsed (stock / floor / default) | time to target, s "
        "(stock / floor / default) | default vs floor | final accuracy (stock / floor / "
        "default) | E (stock / floor / default) | probe: stable | full balance: collapsed, "
        "time, accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in settings:
        roles = s["roles"]
        present = [roles.get(c) for c in COLUMNS]
        seeds = "/".join(str(r["runs"]) if r else "–" for r in present)
        collapsed = cell(
            ["–" if r is None or r["collapsed"] is None else str(r["collapsed"]) for r in present]
        )
        times = cell(
            [
                "–"
                if r is None or math.isnan(r["time_to_target"])
                else f"{seconds(r['time_to_target'])} ({r['reached']})"
                for r in present
            ]
        )
        floor, default, stock = roles.get("floor"), roles.get("default"), roles.get("stock")
        compared = s["comparison"]
        p_more = compared.get("more_collapses_p")
        if p_more is not None and default and stock and default["collapsed"] > stock["collapsed"]:
            collapsed += f" (p {p_more:.2f})"
        ratio = "–"
        if floor and default:
            a, b = floor["time_to_target"], default["time_to_target"]
            if math.isnan(a) or math.isnan(b):
                ratio = "–"
            elif math.isfinite(a) and math.isfinite(b):
                ratio = f"{a / b:.2f}x"
            elif math.isinf(a) and math.isinf(b):
                ratio = "neither (median)"
            else:  # one median beyond the run
                ratio = "default only" if math.isinf(a) else "floor only"
            paired, interval = compared["paired_ratio"], compared["paired_interval_95"]
            if paired is not None and ratio != "–" and math.isfinite(paired):
                ratio += f" (paired {paired:.2f}x" + (
                    f", 95% {interval[0]:.2f}-{ratio_text(interval[1])})" if interval else ")"
                )
        accuracy = cell(
            [
                "–"
                if r is None
                else f"{statistics.fmean(r['final_accuracy']):.3f}"
                + (
                    f" ± {statistics.stdev(r['final_accuracy']):.3f}"
                    if len(r["final_accuracy"]) > 1
                    else ""
                )
                for r in present
            ]
        )
        efficiency = cell(
            ["–" if r is None or r["E"] is None else f"{r['E']:.3f}" for r in present]
        )
        stable = f"{default['stable']}/{default['runs']}" if default else "–"
        full = roles.get("full")
        full_cell = (
            "–"
            if full is None
            else f"{full['collapsed'] if full['collapsed'] is not None else '–'}, "
            f"{seconds(full['time_to_target'])} ({full['reached']}), "
            f"{statistics.fmean(full['final_accuracy']):.3f}"
        )
        out.append(
            f"| {s['setting']}, target {s['target']:.2f} | {seeds} | {collapsed} | {times} "
            f"| {ratio} | {accuracy} | {efficiency} | {stable} | {full_cell} |"
        )
    out.append("")
    out.append(
        "time to target: median over seeds (reached in how many); default vs floor: the "
        "ratio of those medians (paired: the median over seeds of each seed's own ratio, "
        "with a 95% bootstrap interval over the seeds); collapsed: final accuracy <= 0.15 "
        "(p: where the default lost more networks than stock, Fisher's exact test, "
        "one-sided, of it doing so at stock's rate); E: mean over every round, round 1 "
        "included (model clock)."
    )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--apps", type=Path, nargs="*", default=[], help="app_accuracy JSON lines")
    parser.add_argument(
        "--experiments", type=Path, nargs="*", default=[], help="fedlb experiment folders"
    )
    parser.add_argument("--target", type=float, help="app runs: this target, not stock's")
    parser.add_argument("--json", type=Path, help="also write the settings' figures here")
    args = parser.parse_args()
    settings = with_comparisons(
        app_settings(args.apps, args.target) + experiment_settings(args.experiments)
    )
    print(table(settings))
    if args.json:
        args.json.write_text(json.dumps(settings, indent=1, default=str))


if __name__ == "__main__":
    main()
