"""Policy comparisons: the same federation under FedAvg, fedlb and the alternatives.

Each policy is one `flwr run` of the experiment app (simulation.py) on a simulation
SuperLink this module starts and stops: the same strategy and silo handler as a
deployment, the silos' speeds from the scenario's profiles, every output naming its clock.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedlb.deploy import ConfigError, DeployError, Federation, check_out_dir, start_ray_head
from fedlb.flower import RUN_FILES, RoundRecord, records_from_json_lines
from fedlb.security import FolderInUseError, claim_folder

from .plots import plot_results, plot_seeds
from .results import PolicyResult, combine_seeds, write_results
from .scenario import POLICIES, Scenario, ScenarioError
from .simulation import app_dir, run_config

SECOND_RUN_PROFILES = "profiles"  # a policy's folder under second-run: what run 1 stored
FIRST_RUN = "first-run"  # ... and run 1's files


def run_policy(
    scenario: Scenario,
    policy: str,
    out_dir: Path,
    federation: Federation | None = None,
    he: tuple[Path, Path] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
) -> PolicyResult:
    """One policy as one run on `federation` (a simulation SuperLink; None: one started
    for this run alone); its records and clock times. `he`: the (public, secret) key
    files when updates travel encrypted (None under a scenario with HE: fresh keys).
    Under `second_run` the policy runs twice with a fresh folder of stored profiles and
    verdicts (`out_dir`/profiles), the first run's files in `out_dir`/first-run, and the
    second run is returned."""
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if scenario.he and he is None:
        he = fresh_keys(out_dir / "keys")
    with contextlib.ExitStack() as stack:
        if federation is None:
            federation = stack.enter_context(Federation(out_dir / "processes", simulation=True))
        if not scenario.second_run:
            return _run_once(scenario, policy, out_dir, federation, he, on_round)
        profiles = out_dir / SECOND_RUN_PROFILES
        first = out_dir / FIRST_RUN
        for earlier in (profiles, first):
            shutil.rmtree(earlier, ignore_errors=True)
        _run_once(scenario, policy, first, federation, he, on_round, profiles)
        return _run_once(scenario, policy, out_dir, federation, he, on_round, profiles)


def _run_once(
    scenario: Scenario,
    policy: str,
    out_dir: Path,
    federation: Federation,
    he: tuple[Path, Path] | None,
    on_round: Callable[[RoundRecord], None] | None,
    profile_dir: Path | None = None,
) -> PolicyResult:
    """run_policy's one run (`profile_dir`: stored profiles and verdicts, else none)."""
    outcome = federation.run(
        run_config(scenario, policy, out_dir, he, profile_dir),
        on_round=on_round,
        app=app_dir(),
        federation_config={
            "num-supernodes": scenario.silos,
            "client-resources-num-cpus": 1,
        },
    )
    records = records_from_json_lines((out_dir / RUN_FILES.rounds).read_text().splitlines())
    # an asynchronous policy's records are its server updates, as many as its work takes
    expected = (len(records) or 1) if POLICIES[policy].asynchronous else scenario.rounds
    if not outcome.ok or len(records) != expected:
        raise RuntimeError(
            f"policy {policy}: the run ended as {outcome.status} after {len(records)} of "
            f"{expected} rounds; its ServerApp log: {outcome.log_path}"
        )
    if all(r.round_s is None for r in records):
        reasons = next((r.failed for r in records if r.failed), [f"see {outcome.log_path}"])
        raise RuntimeError(
            f"policy {policy}: no silo sent a usable update in any round: {reasons[0]}"
        )
    result = PolicyResult(policy, records)
    elapsed = 0.0
    for record in records:
        elapsed += record.round_s if record.round_s is not None else math.nan
        result.clock_s.append(elapsed)
    return result


def fresh_keys(folder: Path) -> tuple[Path, Path]:
    """A new CKKS key pair in `folder`: (the server's public context, the silos' secret)."""
    from fedlb.he import write_keys  # TenSEAL only where HE is on: it is slow to import

    keys = write_keys(folder, overwrite=True)
    return keys.public.resolve(), keys.secret.resolve()


def run_experiment(
    scenario: Scenario,
    out: Path,
    on_policy: Callable[[str, PolicyResult], None] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    overwrite: bool = False,
    on_start: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every policy of the scenario, then the results and plots in `out`; with repeats,
    every seed's in `out/seed-S` and their combination in `out`. Flower's processes and
    each run's ServerApp log are in `out/processes`. ScenarioError, before anything runs,
    where `out` holds an earlier run's results (an experiment's or a server's) unless
    `overwrite`, or where another fedlb run holds `out` (it is this process's while it runs)."""
    try:  # before looking in it: two experiments started together must not both find it free
        check_out_dir(out, "--out")
        stack = contextlib.ExitStack()
        out = stack.enter_context(claim_folder(out))  # resolved: a symlink is its target
    except (ConfigError, FolderInUseError) as error:
        raise ScenarioError(str(error)) from None
    with stack:
        return _run_claimed(scenario, out, on_policy, on_round, overwrite, on_start)


def _run_claimed(
    scenario: Scenario,
    out: Path,
    on_policy: Callable[[str, PolicyResult], None] | None,
    on_round: Callable[[RoundRecord], None] | None,
    overwrite: bool,
    on_start: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """run_experiment's runs, `out` claimed; `on_start` is told each policy's name (with
    its seed under repeats) before it runs, so that its rounds can be told apart."""
    held = [name for name in (RUN_FILES.rounds, RUN_FILES.summary) if (out / name).exists()]
    if held and not overwrite:
        raise ScenarioError(
            f"{out} holds an earlier run ({', '.join(held)}): this experiment would replace "
            "its results. Give another --out, or --overwrite to replace them"
        )
    for seed in scenario.seeds():  # the split follows the seed
        replace(scenario, seed=seed, repeats=1).check_data()
    out.mkdir(parents=True, exist_ok=True)
    summaries: dict[int, dict[str, Any]] = {}
    all_results: dict[int, dict[str, PolicyResult]] = {}
    he = fresh_keys(out / "keys") if scenario.he else None
    try:
        with contextlib.ExitStack() as stack:
            # one Ray for every run (fedlb.deploy.ray_nodes): the scenario's, or one here
            address = scenario.ray_address or (
                stack.enter_context(start_ray_head(out / "processes")).address
            )
            federation = stack.enter_context(
                Federation(out / "processes", simulation=True, ray_address=address)
            )
            for seed in scenario.seeds():
                one = replace(scenario, seed=seed, repeats=1)
                folder = out if scenario.repeats == 1 else out / f"seed-{seed}"
                folder.mkdir(parents=True, exist_ok=True)
                results: dict[str, PolicyResult] = {}
                for name in one.policy_names():
                    label = name if scenario.repeats == 1 else f"{name} seed {seed}"
                    if on_start is not None:
                        on_start(label)
                    results[name] = run_policy(
                        one, name, folder / "policies" / name, federation, he, on_round
                    )
                    if on_policy is not None:
                        on_policy(label, results[name])
                summaries[seed] = write_results(one, results, folder)
                plot_results(one, results, folder)
                all_results[seed] = results
    except DeployError as error:
        raise RuntimeError(f"Flower's simulation could not run: {error}") from error
    if scenario.repeats == 1:
        return summaries[scenario.seed]
    with (out / RUN_FILES.rounds).open("w") as handle:
        for seed in summaries:
            handle.write((out / f"seed-{seed}" / RUN_FILES.rounds).read_text())
    summary = combine_seeds(scenario, summaries)
    (out / RUN_FILES.summary).write_text(json.dumps(summary, indent=2))
    plot_seeds(scenario, all_results, out)
    return summary
