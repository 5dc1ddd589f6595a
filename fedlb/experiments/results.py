"""An experiment's results: each policy's records and clock, the summary (one builder for
a run, for several seeds, and for a rebuild at another target), and the files."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fedlb.data import describe, federation_pool, partition
from fedlb.flower import (
    RUN_FILES,
    RoundRecord,
    accuracy_of,
    records_from_json_lines,
    summarise_rounds,
)
from fedlb.security import StoredFileError, read_json, read_json_lines

from .scenario import Scenario, ScenarioError

PARTITION_FILE = "partition.json"
# figures whose spread over seeds a combined summary gives (sample std, `*_std`)
SPREAD_KEYS = ("time_to_target_s", "final_accuracy", "best_accuracy", "final_mean_silo_accuracy")


@dataclass
class PolicyResult:
    policy: str
    records: list[RoundRecord] = field(default_factory=list)
    clock_s: list[float] = field(default_factory=list)  # clock time at the end of each round

    def summary(self, target: float) -> dict[str, Any]:
        """The run's figures (fedlb.flower's summarise_rounds) and when it reached
        `target` accuracy on its clock."""
        reached = [
            t
            for t, record in zip(self.clock_s, self.records, strict=True)
            if (accuracy := accuracy_of(record)) is not None and accuracy >= target
        ]
        return {
            **summarise_rounds(self.records),
            "time_to_target_s": reached[0] if reached else None,
            "total_clock_s": self.clock_s[-1] if self.clock_s else None,
        }


def experiment_summary(
    scenario: Scenario, policies: dict[str, dict[str, Any]], **more: Any
) -> dict[str, Any]:
    """summary.json of a comparison: the scenario, its clock and target, what any policy
    could gain at most, and each policy's figures (`more`: e.g. the seeds combined) with
    its speedup: fedavg's time to the target over its own (null where either missed it or
    fedavg did not run)."""
    baseline = policies.get("fedavg", {}).get("time_to_target_s")
    for row in policies.values():
        reached = row.get("time_to_target_s")
        row["speedup_over_fedavg"] = baseline / reached if baseline and reached else None
    return {
        "scenario": asdict(scenario),
        "clock": scenario.clock_label(),
        "target_accuracy": scenario.target_accuracy,
        "speedup_ceiling": more.pop("speedup_ceiling", None) or scenario.speedup_ceiling(),
        **more,
        "policies": policies,
    }


def write_results(
    scenario: Scenario, results: dict[str, PolicyResult], out: Path
) -> dict[str, Any]:
    """rounds.jsonl, summary.json and partition.json in `out`; returns the summary."""
    with (out / RUN_FILES.rounds).open("w") as handle:
        for name, result in results.items():
            for record, clock_s in zip(result.records, result.clock_s, strict=True):
                for line in record.json_lines():
                    row = json.loads(line)
                    row.update(
                        {
                            "policy": name,
                            "seed": scenario.seed,
                            "clock_time_s": clock_s,
                            "clock": scenario.clock_label(),
                        }
                    )
                    handle.write(json.dumps(row) + "\n")
    summary = experiment_summary(
        scenario, {n: r.summary(scenario.target_accuracy) for n, r in results.items()}
    )
    (out / RUN_FILES.summary).write_text(json.dumps(summary, indent=2))
    config = scenario.run_config()
    pool, _ = federation_pool(
        config.dataset, config.data_dir, config.num_silos, config.server_test_fraction, config.seed
    )
    parts = partition(pool.y, scenario.silos, scenario.partition, scenario.seed, pool.groups)
    (out / PARTITION_FILE).write_text(
        json.dumps(describe(pool.y, parts, pool.num_classes), indent=1)
    )
    return summary


def combine_seeds(scenario: Scenario, summaries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One summary over several seeds: each policy's figures are means over the seeds
    (time_to_target_s only when every seed reached the target, else null), with their
    standard deviations (`*_std`), `reached_target` ('k/n') and every seed's own summary."""
    policies: dict[str, Any] = {}
    for name in scenario.policy_names():
        runs = {seed: summary["policies"][name] for seed, summary in summaries.items()}
        combined: dict[str, Any] = {}
        for key in next(iter(runs.values())):
            values = [run[key] for run in runs.values()]
            if any(isinstance(v, str) for v in values):  # the clock: the same for all
                combined[key] = values[0]
                continue
            if key == "stability":  # the guard's verdicts: how many runs found each regime
                combined[key] = dict(
                    Counter(v["regime"] for v in values if isinstance(v, dict) and v)
                )
                continue
            known = [v for v in values if v is not None]
            combined[key] = statistics.fmean(known) if len(known) == len(values) else None
            if key in SPREAD_KEYS and len(known) > 1:
                combined[f"{key}_std"] = statistics.stdev(known)
        reached = sum(run["time_to_target_s"] is not None for run in runs.values())
        combined["reached_target"] = f"{reached}/{len(runs)}"
        combined["per_seed"] = {str(seed): run for seed, run in runs.items()}
        policies[name] = combined
    return experiment_summary(
        scenario,
        policies,
        seeds=list(summaries),
        speedup_ceiling=statistics.fmean(s["speedup_ceiling"] for s in summaries.values()),
    )


def load_results(out: Path, target: float) -> tuple[Scenario, dict[int, dict[str, PolicyResult]]]:
    """A finished experiment in `out`, read back from its rounds.jsonl and summary.json:
    (its scenario with `target` as the target accuracy, every seed's policy results)."""
    rounds_path = out / RUN_FILES.rounds
    try:
        saved = read_json(out / RUN_FILES.summary)
        # bounded: a line at a time, each line and the file within fedlb.security.stored's
        lines = list(read_json_lines(rounds_path))
    except StoredFileError as error:  # too large, too deep, not JSON: named, line and all
        if error.line is not None:
            where = f"line {error.line}"
            raise ScenarioError(_damaged(error.path, where, ValueError(error.reason))) from None
        raise ScenarioError(
            f"{error.path} is damaged ({error.reason}): restore it from a copy, or run the "
            "experiment again"
        ) from None
    except OSError as error:
        raise ScenarioError(f"{out}: no finished experiment there ({error})") from error
    scenario_values = saved.get("scenario") if isinstance(saved, dict) else None
    if not isinstance(scenario_values, dict):
        raise ScenarioError(
            f"{out / RUN_FILES.summary} holds no experiment's scenario: it is damaged, or not "
            "an experiment's summary; restore it from a copy, or run the experiment again"
        )
    values = {k.replace("_", "-"): v for k, v in scenario_values.items()}
    scenario = Scenario.from_mapping({**values, "target-accuracy": target})
    grouped: dict[tuple[int, str], list[str]] = {}
    clock: dict[tuple[int, str, int], float] = {}  # (seed, policy, round) -> clock time
    for number, line, row in lines:
        try:
            seed, policy = row.get("seed", scenario.seed), row["policy"]
            grouped.setdefault((seed, policy), []).append(line)
            clock[(seed, policy, row["round"])] = float(row["clock_time_s"])
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ScenarioError(_damaged(rounds_path, f"line {number}", error)) from None
    runs: dict[int, dict[str, PolicyResult]] = {}
    for seed in scenario.seeds():
        runs[seed] = {}
        for name in scenario.policy_names():
            try:
                records = records_from_json_lines(grouped.get((seed, name), []))
            except ValueError as error:
                raise ScenarioError(_damaged(rounds_path, f"{name}'s lines", error)) from None
            result = PolicyResult(name, records)
            result.clock_s = [clock[(seed, name, record.round)] for record in result.records]
            runs[seed][name] = result
    return scenario, runs


def _damaged(path: Path, where: str, error: BaseException) -> str:
    """One line for a damaged record of a finished experiment: which, why, what to do."""
    why = f"no {error}" if isinstance(error, KeyError) else str(error)
    return (
        f"{path} {where} is not an experiment's round record ({why}): the file is damaged; "
        "restore it from a copy, or run the experiment again"
    )


def summarise_results(out: Path, target: float) -> tuple[Scenario, dict[str, Any]]:
    """The summary of a finished experiment in `out` at another target accuracy, rebuilt
    from its rounds.jsonl and summary.json: nothing reruns. Returns (the scenario with
    that target, the summary)."""
    scenario, runs = load_results(out, target)
    summaries = {
        seed: experiment_summary(
            replace(scenario, seed=seed, repeats=1),
            {name: result.summary(target) for name, result in results.items()},
        )
        for seed, results in runs.items()
    }
    if scenario.repeats == 1:
        return scenario, summaries[scenario.seed]
    return scenario, combine_seeds(scenario, summaries)
