"""Policy comparisons: the same federation under FedAvg, fedlb and the alternatives.

Each policy runs through Flower's Simulation Engine with the same strategy
(LoadBalancedFedAvg) and silo handler as a deployment; the silos' speeds come from
profiles, and every output names its clock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .profiles import EmulatedClock
from .scenario import POLICIES, STEADY_FROM_ROUND, Scenario, ScenarioError

log = logging.getLogger("fedlb.experiments")


@dataclass
class PolicyResult:
    policy: str
    records: list[Any] = field(default_factory=list)  # RoundRecords
    clock_s: list[float] = field(default_factory=list)  # clock time at the end of each round

    def accuracy(self, record: Any) -> float | None:
        value = record.server_accuracy if record.server_accuracy is not None else record.accuracy
        return None if value is None else float(value)

    def summary(self, target: float) -> dict[str, Any]:
        accuracies = [self.accuracy(r) for r in self.records]
        reached = [
            t
            for t, a in zip(self.clock_s, accuracies, strict=True)
            if a is not None and a >= target
        ]
        known = [a for a in accuracies if a is not None]
        efficiencies = [r.efficiency for r in self.records if r.efficiency is not None]
        steady = [
            r.efficiency
            for r in self.records
            if r.efficiency is not None and r.round >= STEADY_FROM_ROUND
        ]
        idle = [r.idle_fraction for r in self.records if r.idle_fraction is not None]
        return {
            "time_to_target_s": reached[0] if reached else None,
            "best_accuracy": max(known) if known else None,
            "final_accuracy": known[-1] if known else None,
            "mean_balance_efficiency": sum(efficiencies) / len(efficiencies)
            if efficiencies
            else None,
            "steady_balance_efficiency": sum(steady) / len(steady) if steady else None,
            "idle_fraction": sum(idle) / len(idle) if idle else None,
            "rounds": len(self.records),
            "total_clock_s": self.clock_s[-1] if self.clock_s else None,
        }


def run_policy(
    scenario: Scenario, policy: str, out_dir: Path, checkpoint: bool = False
) -> PolicyResult:
    """One policy through Flower's Simulation Engine; its records and clock times. With
    `checkpoint`, out_dir/checkpoint.npz after every round, as `fedlb server` writes."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedlb.flower import (
        RoundReporter,
        balance_mod,
        evaluate_reply,
        federation_data,
        model_for,
        train_reply,
    )
    from fedlb.flower.protocol import LEARNING_RATE
    from fedlb.training import evaluate, tensor_dataset

    config = scenario.run_config(str(out_dir))
    profiles = scenario.profiles()
    clock_name = scenario.clock
    result = PolicyResult(policy)
    _, strategy_class, extra = POLICIES[policy]
    strategy_args = extra()

    def silo_clock(context: Context) -> EmulatedClock:
        return EmulatedClock(clock_name, profiles[int(context.node_config["partition-id"])])

    mods = [balance_mod(silo_clock)]
    if scenario.he:
        from fedlb.flower import EncryptedAggregation, he_mod
        from fedlb.he import generate_keys, public_context

        secret = generate_keys()
        strategy_args["he"] = EncryptedAggregation(public_context(secret))
        # Outside the balancing mod: the HE seconds are added to the clock's fixed cost
        # (under the model clock, the balancing mod reports the profile's).
        mods.insert(0, he_mod(secret))

    server = ServerApp()

    @server.main()
    def _server(grid: Grid, context: Context) -> None:
        pool, test = federation_data(config)
        model = model_for(config, pool)
        test_set = tensor_dataset(test.x, test.y)

        def server_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            loss, accuracy = evaluate(model, test_set)
            return MetricRecord({"accuracy": accuracy, "loss": loss})

        reporter = RoundReporter(out_dir)
        strategy = strategy_class(
            batch_size=config.batch_size,
            local_steps=config.local_steps,
            expected_silos=config.num_silos,
            evaluate_every=1,
            evaluate_with_train=True,
            reporter=reporter,
            seed=config.seed,
            checkpoint_dir=out_dir if checkpoint else None,
            min_available_nodes=config.num_silos,
            min_train_nodes=1,
            min_evaluate_nodes=1,
            **strategy_args,
        )
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=config.num_rounds,
            timeout=3600,
            train_config=ConfigRecord({LEARNING_RATE: config.learning_rate}),
            # under HE the server cannot read the model: federated evaluation only
            evaluate_fn=None if scenario.he else server_evaluate,
        )
        result.records = list(reporter.records)

    client = ClientApp(mods=mods)

    @client.train()
    def _train(msg: Message, context: Context) -> Message:
        return train_reply(msg, context, config)

    @client.evaluate()
    def _evaluate(msg: Message, context: Context) -> Message:
        return evaluate_reply(msg, context, config)

    out_dir.mkdir(parents=True, exist_ok=True)
    # Ray warns that it will stop overriding CUDA_VISIBLE_DEVICES for CPU-only actors;
    # opting in to that behaviour now silences it and changes nothing for fedlb.
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=scenario.silos,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "include_dashboard": False},
        },
    )
    if len(result.records) != scenario.rounds:
        raise RuntimeError(
            f"policy {policy}: the simulation ended after {len(result.records)} of "
            f"{scenario.rounds} rounds; see the log above"
        )
    if all(r.round_s is None for r in result.records):
        reasons = next((r.failed for r in result.records if r.failed), ["see the log above"])
        raise RuntimeError(
            f"policy {policy}: no silo sent a usable update in any round: {reasons[0]}"
        )
    elapsed = 0.0
    for record in result.records:
        elapsed += record.round_s if record.round_s is not None else math.nan
        result.clock_s.append(elapsed)
    return result


def write_results(
    scenario: Scenario, results: dict[str, PolicyResult], out: Path
) -> dict[str, Any]:
    """rounds.jsonl, summary.json and partition.json in `out`; returns the summary."""
    from fedlb.data import describe, partition
    from fedlb.flower import federation_data

    with (out / "rounds.jsonl").open("w") as handle:
        for name, result in results.items():
            for record, clock_s in zip(result.records, result.clock_s, strict=True):
                for line in record.json_lines():
                    row = json.loads(line)
                    row.update(
                        {
                            "policy": name,
                            "seed": scenario.seed,
                            "clock_time_s": clock_s,
                            "clock": scenario.clock,
                        }
                    )
                    handle.write(json.dumps(row) + "\n")
    summary = {
        "scenario": asdict(scenario),
        "clock": scenario.clock,
        "target_accuracy": scenario.target_accuracy,
        "speedup_ceiling": scenario.speedup_ceiling(),
        "policies": {n: r.summary(scenario.target_accuracy) for n, r in results.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    config = scenario.run_config()
    pool, _ = federation_data(config)
    parts = partition(pool.y, scenario.silos, scenario.partition, scenario.seed, pool.groups)
    (out / "partition.json").write_text(
        json.dumps(describe(pool.y, parts, pool.num_classes), indent=1)
    )
    return summary


def combine_seeds(scenario: Scenario, summaries: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One summary over several seeds: each policy's figures are means over the seeds
    (time_to_target_s only when every seed reached the target, else null), with their
    standard deviations (`*_std`), `reached_target` ('k/n') and every seed's own summary."""
    import statistics

    policies: dict[str, Any] = {}
    for name in scenario.policy_names():
        runs = {seed: summary["policies"][name] for seed, summary in summaries.items()}
        combined: dict[str, Any] = {}
        for key in next(iter(runs.values())):
            values = [run[key] for run in runs.values()]
            known = [v for v in values if v is not None]
            combined[key] = statistics.fmean(known) if len(known) == len(values) else None
            if key in ("time_to_target_s", "final_accuracy", "best_accuracy") and len(known) > 1:
                combined[f"{key}_std"] = statistics.stdev(known)
        reached = sum(run["time_to_target_s"] is not None for run in runs.values())
        combined["reached_target"] = f"{reached}/{len(runs)}"
        combined["per_seed"] = {str(seed): run for seed, run in runs.items()}
        policies[name] = combined
    return {
        "scenario": asdict(scenario),
        "clock": scenario.clock,
        "target_accuracy": scenario.target_accuracy,
        "seeds": list(summaries),
        "speedup_ceiling": statistics.fmean(s["speedup_ceiling"] for s in summaries.values()),
        "policies": policies,
    }


def summarise_results(out: Path, target: float) -> tuple[Scenario, dict[str, Any]]:
    """The summary of a finished experiment in `out` at another target accuracy, rebuilt
    from its rounds.jsonl and summary.json: nothing reruns. Returns (the scenario with
    that target, the summary)."""
    from fedlb.flower import records_from_json_lines

    try:
        saved = json.loads((out / "summary.json").read_text())
        lines = (out / "rounds.jsonl").read_text().splitlines()
    except (OSError, ValueError) as error:
        raise ScenarioError(f"{out}: no finished experiment there ({error})") from error
    values = {k.replace("_", "-"): v for k, v in saved["scenario"].items()}
    scenario = Scenario.from_mapping({**values, "target-accuracy": target})
    grouped: dict[tuple[int, str], list[str]] = {}
    clock: dict[tuple[int, str, int], float] = {}  # (seed, policy, round) -> clock time
    for line in lines:
        row = json.loads(line)
        seed, policy = row.get("seed", scenario.seed), row["policy"]
        grouped.setdefault((seed, policy), []).append(line)
        clock[(seed, policy, row["round"])] = row["clock_time_s"]
    summaries: dict[int, dict[str, Any]] = {}
    for seed in scenario.seeds():
        one = replace(scenario, seed=seed, repeats=1)
        policies = {}
        for name in one.policy_names():
            result = PolicyResult(name, records_from_json_lines(grouped.get((seed, name), [])))
            result.clock_s = [clock[(seed, name, record.round)] for record in result.records]
            policies[name] = result.summary(target)
        summaries[seed] = {
            "scenario": asdict(one),
            "clock": one.clock,
            "target_accuracy": target,
            "speedup_ceiling": one.speedup_ceiling(),
            "policies": policies,
        }
    if scenario.repeats == 1:
        return scenario, summaries[scenario.seed]
    return scenario, combine_seeds(scenario, summaries)


@contextlib.contextmanager
def quiet_flower() -> Iterator[None]:
    """Hold back Flower's per-round INFO lines (its warnings still show) while inside."""
    flower = logging.getLogger("flwr")
    flower.addFilter(_warnings_only)
    try:
        yield
    finally:
        flower.removeFilter(_warnings_only)


def _warnings_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING and not _known_deprecation(record)


def _known_deprecation(record: logging.LogRecord) -> bool:
    """Flower 1.41 marks run_simulation deprecated in favour of `flwr run`; experiments
    use it on purpose (speed profiles and policies travel as Python objects, not as run
    config), so its banner, printed once per policy, is held back; docs/experiments.md
    says so."""
    args = record.args if isinstance(record.args, tuple) else ()
    return bool(args) and str(args[0]).startswith("The `run_simulation` function is deprecated")


def run_experiment(
    scenario: Scenario,
    out: Path,
    on_policy: Callable[[str, PolicyResult], None] | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """Every policy of the scenario, then the results and plots in `out`; with repeats,
    every seed's in `out/seed-S` and their combination in `out`. With `quiet`, Flower's
    per-round INFO lines are held back (its warnings still show)."""
    from .plots import plot_results, plot_seeds

    for seed in scenario.seeds():  # the split follows the seed
        replace(scenario, seed=seed, repeats=1).check_data()
    out.mkdir(parents=True, exist_ok=True)
    summaries: dict[int, dict[str, Any]] = {}
    all_results: dict[int, dict[str, PolicyResult]] = {}
    with quiet_flower() if quiet else contextlib.nullcontext():
        for seed in scenario.seeds():
            one = replace(scenario, seed=seed, repeats=1)
            folder = out if scenario.repeats == 1 else out / f"seed-{seed}"
            folder.mkdir(parents=True, exist_ok=True)
            results: dict[str, PolicyResult] = {}
            for name in one.policy_names():
                results[name] = run_policy(one, name, folder / "policies" / name)
                if on_policy is not None:
                    label = name if scenario.repeats == 1 else f"{name} seed {seed}"
                    on_policy(label, results[name])
            summaries[seed] = write_results(one, results, folder)
            plot_results(one, results, folder)
            all_results[seed] = results
    if scenario.repeats == 1:
        return summaries[scenario.seed]
    with (out / "rounds.jsonl").open("w") as handle:
        for seed in summaries:
            handle.write((out / f"seed-{seed}" / "rounds.jsonl").read_text())
    summary = combine_seeds(scenario, summaries)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_seeds(scenario, all_results, out)
    return summary
