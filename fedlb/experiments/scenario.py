"""The federation a policy comparison runs on (`Scenario`), and the policies to compare.

A scenario comes from a TOML file or flags; `Scenario.check` refuses what cannot be run
before any policy starts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fedlb.balance import StepCurve, defaults
from fedlb.deploy import (
    ConfigError,
    RunConfig,
    as_settings,
    check_partition,
    dataclass_arguments,
    read_toml,
)
from fedlb.flower import LoadBalancedFedAvg
from fedlb.training import BASE_SPEED, STEP_CURVES

from .asynchronous import FedBuff, FedCompass
from .clocks import ideal_split, round_time
from .profiles import CLOCKS, SpeedProfile, clock_label, silo_speeds
from .variants import QuorumFedAvg, ScaledLrFedAvg, StepsTunedFedAvg


@dataclass(frozen=True)
class Policy:
    """A way to run the federation that experiments compare: a LoadBalancedFedAvg (or a
    variant) with a tuner from fedlb.balance's table and its own extra arguments."""

    description: str
    strategy_class: type[LoadBalancedFedAvg] = LoadBalancedFedAvg
    tuner: str = defaults.TUNER  # the run setting `tuner` (fedlb.balance.defaults)
    extra: tuple[tuple[str, Any], ...] = ()  # the strategy's own other arguments
    guard: bool = True  # the stability guard (where the run's settings have it on)
    guard_probe: float | None = None  # its probe threshold (None: the run's setting)
    asynchronous: bool = False  # no rounds: its records are server updates (asynchronous.py)

    def strategy_args(self) -> dict[str, Any]:
        return dict(self.extra)


POLICIES: dict[str, Policy] = {
    # FedAvg as published: no guard (it would leave a blown-up update out of the average)
    "fedavg": Policy("FedAvg: every silo at B0", tuner="static", guard=False),
    "lb": Policy("fedlb: B tuned, τ and η fixed (the default balancer and stability guard)"),
    "lb-floor": Policy(
        "fedlb with the guard's floor always on (its probe off): the default before the probe",
        guard_probe=0.0,
    ),
    "lb-full": Policy(
        "fedlb without its stability guard: full balance from round 2 (LB-BSP as published)",
        guard=False,
    ),
    "lb-curve": Policy(
        "fedlb with the curve tuner: measured step-time curves where one speed is wrong",
        tuner="curve",
    ),
    "lb-tau": Policy(
        "τ tuned per silo, B fixed (Orchestra/FedCompass family)",
        StepsTunedFedAvg,
        tuner="proportional",
    ),
    "lb-lr": Policy("B tuned and η scaled with B", ScaledLrFedAvg),
    "deadband": Policy("dynamic-batching controller on B", tuner="deadband"),
    "quorum": Policy(
        "aggregate the fastest ⌈n/2⌉ updates, drop the rest",
        QuorumFedAvg,
        tuner="static",
        extra=(("quorum", 0.5),),
    ),
    "fedbuff": Policy(
        "FedBuff: asynchronous, the model moves by K = ⌈n/2⌉ staleness-weighted updates",
        FedBuff,
        tuner="static",
        guard=False,
        asynchronous=True,
    ),
    "fedcompass": Policy(
        "FedCompass: asynchronous, τ_i in [τ/2, 2τ] from each silo's speed so silos "
        "arrive in groups, a group applied together",
        FedCompass,
        tuner="static",
        guard=False,
        asynchronous=True,
    ),
}


def scenario_arguments(
    cls: type, values: dict[str, Any], what: str, error: type[ValueError]
) -> dict[str, Any]:
    """A scenario dataclass's keyword arguments from file or flag values ('-' keys); TOML
    lists are taken for the comma-separated keys (speeds, policies, ...). A bad key or
    type raises `error` naming it."""
    flat = {
        k: ",".join(str(x) for x in v) if isinstance(v, (list, tuple)) else v
        for k, v in values.items()
    }
    try:
        return dataclass_arguments(cls, flat, what)
    except ConfigError as problem:
        raise error(str(problem)) from problem


# Round 1 is uniform (nothing measured yet) and round 2 the first balanced one: the
# balance goals are judged from round 3 on.
STEADY_FROM_ROUND = 3


def _is_address(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


class ScenarioError(ValueError):
    """A scenario setting that cannot be run; the message names it."""


@dataclass
class Scenario:
    """One federation to compare policies on. Keys in files and flags use '-' for '_'.

    name: the scenario's name (a file's: its stem); results go to out, else
        runs/experiment-NAME.
    speeds: relative silo speeds ('1,2,3,6': bigger is faster), or a preset ('ec2-5',
        'hetero-K:N'), times base_speed samples/s; an entry 'curve:NAME' makes that silo's
        steps follow a measured step-time curve instead ('curve:h200/cnn': fedlb.training's
        STEP_CURVES; 'curve:h200/cnn*20': its times × 20). A curve is one model's: it
        must be the scenario's model.
    overheads: fixed seconds per round, one value for all or one per silo.
    traces: speed traces (see SpeedProfile), one for all or one per silo.
    repeats: runs of every policy with seeds seed, seed+1, ... (data split, initial
        model, batch order and random-walk traces all follow the seed).
    he: updates travel and are averaged as CKKS ciphertexts (fresh keys per run); the
        measured HE seconds join each silo's fixed cost on either clock, so the model
        clock is no longer bit-for-bit repeatable with it.
    second_run: every policy runs twice, the second time as a deployment's second run of
        the same app would: the stability guard takes up the first run's verdict
        (fedlb.flower.verdicts) and, where it was stable (or the policy has no probe),
        round 1 starts balanced from the silos' speed profiles stored by the first. The
        second run is reported; the first's files are in its policy's folder, under
        first-run.
    ray_address: the Ray cluster the policies' runs use: '' a head fedlb starts on this
        machine for all of them (one Ray start instead of one per run); host:port the
        head of a running cluster (`ray start --head` on one machine, `ray start
        --address host:port` on the others), whose nodes all host silos.
    """

    name: str = "scenario"
    dataset: str = "digits"
    data_dir: str = ""
    silos: int = 4
    speeds: str = "1,2,3,6"
    base_speed: float = BASE_SPEED
    overheads: str = "0"
    traces: str = "static"
    partition: str = "iid"
    model: str = "mlp"
    rounds: int = 20
    local_steps: int = 20
    batch_size: int = 32
    learning_rate: float = 0.05
    batch_stream: str = "per-round"
    clock: str = "model"
    policies: str = "fedavg,lb"
    target_accuracy: float = 0.8
    seed: int = 0
    repeats: int = 1
    he: bool = False
    second_run: bool = False
    ray_address: str = ""
    out: str = ""

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> Scenario:
        scenario = cls(**scenario_arguments(cls, values, "scenario key", ScenarioError))
        scenario.check()
        return scenario

    @classmethod
    def from_file(cls, path: Path, overrides: dict[str, Any] | None = None) -> Scenario:
        try:
            values = read_toml(path, "scenario file")
        except ConfigError as error:
            raise ScenarioError(str(error)) from error
        values.setdefault("name", path.stem)
        return cls.from_mapping({**values, **(overrides or {})})

    def seeds(self) -> list[int]:
        return [self.seed + k for k in range(self.repeats)]

    def speedup_ceiling(self) -> float:
        """The most any policy can shorten the run against FedAvg's uniform split: the sum
        over rounds of the uniform round time over the sum of the ideal T* (the best split
        of X = n·B0 for each round's speeds and fixed costs)."""
        uniform = ideal = 0.0
        profiles = self.profiles()
        for server_round in range(1, self.rounds + 1):
            models = {str(i): p.time_model(server_round) for i, p in enumerate(profiles)}
            uniform += max(
                round_time(m, self.batch_size, self.local_steps) for m in models.values()
            )
            ideal += ideal_split(models, self.silos * self.batch_size, self.local_steps)[1]
        return uniform / ideal

    def policy_names(self) -> list[str]:
        return [p.strip() for p in self.policies.split(",") if p.strip()]

    def speeds_per_silo(self) -> list[float | StepCurve]:
        """Each silo's samples/s, or its step-time curve."""
        try:
            speeds = silo_speeds(self.speeds, self.base_speed)
        except ValueError as error:
            raise ScenarioError(str(error)) from error
        if len(speeds) != self.silos:
            raise ScenarioError(
                f"speeds {self.speeds!r} give {len(speeds)} silos, not {self.silos}"
            )
        for i, speed in enumerate(speeds):
            if isinstance(speed, StepCurve) and speed.model != self.model:
                # a curve times its own model only: another model's steps take other times
                same_hardware = f"{speed.name.split('/')[0]}/{self.model}"
                instead = f"curve:{same_hardware} or " if same_hardware in STEP_CURVES else ""
                raise ScenarioError(
                    f"silo {i}'s step-time curve {speed.name} was measured on model "
                    f"{speed.model}, but the scenario trains {self.model}: use "
                    f'{instead}model = "{speed.model}"'
                )
        return speeds

    def clock_label(self) -> str:
        """Its clock as every output names it: "model", or with the silos' step-time
        curves, "model (curves: silo-0 h200/cnn, silo-1 cpu1/cnn)"."""
        return clock_label(self.clock, self.profiles())

    def _per_silo(self, text: str, what: str) -> list[str]:
        values = [v.strip() for v in text.split(",")]
        if len(values) == 1:
            values *= self.silos
        if len(values) != self.silos:
            raise ScenarioError(f"{what} has {len(values)} values for {self.silos} silos")
        return values

    def profiles(self) -> list[SpeedProfile]:
        overheads = self._per_silo(self.overheads, "overheads")
        traces = self._per_silo(self.traces, "traces")
        profiles = []
        for i, (v, o, t) in enumerate(zip(self.speeds_per_silo(), overheads, traces, strict=True)):
            try:
                if isinstance(v, StepCurve):
                    profiles.append(SpeedProfile.on_curve(v, float(o), t, seed=self.seed + i))
                else:
                    profiles.append(SpeedProfile(v, float(o), t, seed=self.seed + i))
            except ValueError as error:
                what = v.name if isinstance(v, StepCurve) else f"{v:g}"
                raise ScenarioError(
                    f"silo {i} (speeds, overheads, traces = {what}, {o!r}, {t!r}): {error}"
                ) from error
        return profiles

    def check(self) -> None:
        if min(self.silos, self.rounds, self.local_steps, self.batch_size, self.repeats) < 1:
            raise ScenarioError("silos, rounds, local-steps, batch-size and repeats must be >= 1")
        if self.clock not in CLOCKS:
            raise ScenarioError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        unknown = [p for p in self.policy_names() if p not in POLICIES]
        if unknown or not self.policy_names():
            raise ScenarioError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
        if not 0 < self.target_accuracy <= 1:
            raise ScenarioError(f"target-accuracy must be in (0, 1], got {self.target_accuracy}")
        if not (math.isfinite(self.base_speed) and self.base_speed > 0):
            raise ScenarioError(f"base-speed must be > 0 samples/s, got {self.base_speed}")
        if self.ray_address and not _is_address(self.ray_address):
            raise ScenarioError(
                f"ray-address must be host:port of a Ray head (e.g. 10.0.0.5:6379), or '' "
                f"for a head on this machine; got {self.ray_address!r}"
            )
        self.profiles()
        try:
            self.run_config()
        except ValueError as error:
            raise ScenarioError(str(error)) from error

    def check_data(self) -> None:
        """Load the dataset and make the split, refusing what cannot be run (missing
        files, more silos than the split allows) before any policy starts."""
        try:
            check_partition(self.run_config())
        except ValueError as error:
            raise ScenarioError(str(error)) from error

    def run_config(self, out_dir: str = "", policy: str = "lb") -> RunConfig:
        """The run settings of one policy's run (a RunConfig)."""
        return RunConfig.from_mapping(
            as_settings(
                num_silos=self.silos,
                num_rounds=self.rounds,
                local_steps=self.local_steps,
                batch_size=self.batch_size,
                learning_rate=self.learning_rate,
                batch_stream=self.batch_stream,
                tuner=POLICIES[policy].tuner,
                dataset=self.dataset,
                data_dir=self.data_dir,
                partition=self.partition,
                model=self.model,
                seed=self.seed,
                evaluate_every=1,
                evaluate_mode="with-train",
                round_timeout=3600.0,
                out_dir=out_dir,
            )
        )

    def to_mapping(self) -> dict[str, Any]:
        """Its keys as in a scenario file ('-' for '_')."""
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}
