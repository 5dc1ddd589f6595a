"""The run's settings: one schema for the ServerApp, the silos and the `fedlb server` CLI.

Flower carries them as the run config (`[tool.flwr.app.config]` defaults, overridden by
`flwr run --run-config`). Every key is checked here, before anything trains: an unknown
key, a wrong type or an impossible value is refused with a message that names the key.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from fedlb.balance import ESTIMATORS, TUNERS, StabilityGuard, choices, defaults
from fedlb.data import DATASETS, NATURAL_DATASETS, PARTITIONERS, parse_partition
from fedlb.models import MODELS
from fedlb.training import model_dataset_problem

EVALUATE_MODES = ("with-train", "separate")
BATCH_STREAMS = ("per-round", "carried")


RUN_SETTING_HELP = {
    "num-silos": "Silos to wait for before round 1; X = num-silos x batch-size.",
    "num-rounds": "Federated rounds.",
    "local-steps": "τ: local SGD steps per round, the same for all silos, never tuned.",
    "batch-size": "B0: every silo's starting batch size.",
    "learning-rate": "η: the same for every silo whatever its B, never tuned.",
    "momentum": "SGD momentum on the silos.",
    "batch-stream": "per-round (a fresh shuffle each round, every batch full) or carried (one "
    "stream across rounds, each pass's last batch short: FLamby's way).",
    "tuner": "How sizes move: " + choices(TUNERS, defaults.TUNER) + " (static: plain FedAvg).",
    "estimator": "Speed estimator: " + choices(ESTIMATORS, defaults.ESTIMATOR) + ".",
    "min-batch": "Smallest B any silo gets.",
    "min-share": "Tuner pooled: no silo below min-share x the mean batch, whatever the "
    "guard does (the guard's own floor is 0.5; with guard 0, min-share alone).",
    "max-batch": "Largest B any silo gets (0: no limit).",
    "max-share": "The most of the average any one silo's update may weigh, however many "
    "examples it claims (0: no cap; a silo outweighing all others together is named every round).",
    "silo-examples": "Each silo's example count as the operator knows it, "
    '"silo-0=600,silo-1=1200": a silo claiming another is refused and weighs this '
    "(''/unset: each silo's first claim is pinned for the run).",
    "guard": "1: the stability guard (no silo below half the mean batch until its probe finds "
    "the run stable; a blown-up update is left out and the floor raised; "
    "the docs: Explanation, The stability guard); 0: none, full balance (LB-BSP).",
    "guard-probe": "The guard's probe threshold: the first unequal round's dispersion of the "
    "silos' updates below it (confirmed by the next round unless clearly calm) lowers the "
    "floor to a quarter of the mean batch (0: never, a fixed floor).",
    "guard-edge": "What a run the guard finds at the edge of stability runs: steps (every silo "
    "at its own batch size, the slow silos' local steps cut, updates normalized by their "
    "steps) or uniform (the app's own sizes and steps).",
    "profiles": "1: a federation that has run this model before starts round 1 balanced, from "
    "the speed profiles its silos stored; 0: round 1 at every silo's B0.",
    "evaluate-every": "Federated evaluation every k rounds and after the last.",
    "evaluate-mode": "with-train (inside the next train message) or separate (own phase).",
    "dataset": "; ".join(f"{name}: {d.description}" for name, d in DATASETS.items()) + ".",
    "data-dir": "Where the dataset's files are ('' : its default place; see datasets/).",
    "partition": "; ".join(f"{name}: {what}" for name, what in PARTITIONERS.items()) + ".",
    "model": "; ".join(f"{name}: {what}" for name, what in MODELS.items()) + ".",
    "seed": "Seed of the partition, the model and the batch order.",
    "server-test-fraction": "Share held out for server-side evaluation (0: none).",
    "silo-test-fraction": "Share of each silo's part held out for its evaluation (not under "
    "partition natural of heart-flamby: each centre has its own test set).",
    "round-timeout": "Seconds to wait for replies before a round goes on without them.",
    "poll-interval": "Seconds between pulls of replies (0: Flower's 3 s loop).",
    "keep-updates": "1: keep every round's updates and aggregate in out-dir/updates.",
    "tensorboard": "1: also write each round's scalars as TensorBoard event files in "
    "out-dir/tensorboard (the tensorboard extra; without it, said once in the log). 0: none.",
    "he-context": "The server's public CKKS context (fedlb keygen): encrypted updates.",
    "out-dir": "Results folder.",
    "resume": "A stopped run's out-dir: go on after its last checkpointed round.",
}


# What does not change how the silos train (the rounds planned, the seed, where results
# go, how the server waits): left out of what the guard's verdict is kept under
# (fedlb.flower.verdicts), so the next run of the same federation takes it up.
NOT_TRAINING = frozenset(
    {
        "num-rounds",
        "seed",
        "profiles",
        "evaluate-every",
        "evaluate-mode",
        "data-dir",
        "round-timeout",
        "poll-interval",
        "keep-updates",
        "tensorboard",
        "he-context",
        "out-dir",
        "resume",
    }
)


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the key and what to do."""


def read_toml(path: Path, what: str = "config file") -> dict[str, Any]:
    """A TOML file's tables, or a ConfigError that names the file and what is wrong."""
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory: give the TOML file itself")
    try:
        text = path.read_bytes().decode("utf-8")  # TOML is UTF-8 (tomllib's own reading)
    except FileNotFoundError as error:
        raise ConfigError(f"{what} {path} does not exist") from error
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{what} {path} is not a UTF-8 TOML file: byte {error.start} cannot be read "
            "as text; give a TOML settings file"
        ) from error
    except OSError as error:
        raise ConfigError(f"{what} {path} cannot be read: {error.strerror or error}") from error
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{what} {path} is not valid TOML: {error}") from error


@dataclass(frozen=True)
class RunConfig:
    """Settings of one federated run. Keys are the field names with '-' for '_'.

    Attributes:
        num_silos: silos the run waits for before round 1; X = num_silos × batch_size.
        num_rounds: federated rounds.
        local_steps: τ, local SGD steps per round, the same for every silo, never tuned.
        batch_size: B0, every silo's starting batch size.
        learning_rate: η, the same for every silo whatever its batch size, never tuned.
        momentum: SGD momentum on the silos (0: plain SGD).
        batch_stream: 'per-round' (default): each round draws a fresh shuffle of the silo's
            data, every batch full; 'carried': one stream across rounds, kept in the silo's
            Context.state, each pass over the data ending with a short batch where B does not
            divide it (a DataLoader iterated afresh when it runs out: FLamby's protocol).
        tuner, estimator: names in fedlb.balance.TUNERS / ESTIMATORS; defaults from
            fedlb.balance.defaults (the same controller as every other entry point); tuner
            'static' is plain FedAvg (B stays B0).
        min_batch, max_batch: bounds on any silo's B (max_batch 0: none).
        min_share: with tuner 'pooled', no silo below min_share × X/n (0: no floor).
        max_share: the most of the average any one silo's update may weigh, whatever example
            count it claims (0: no cap; fedlb.flower.claims).
        silo_examples: each silo's example count by label, "silo-0=600,silo-1=1200", as the
            operator knows it ('' : each silo's first claim is pinned).
        guard: 1 (default): LoadBalancedFedAvg's StabilityGuard (no silo below half the mean
            batch until its probe finds the run stable, blown-up updates left out); 0: none
            (sizes fully balanced from round 2).
        guard_probe: the guard's probe threshold (fedlb.balance.guard.PROBE); 0: a fixed
            floor that rises only when an update blows up (the default before the probe).
        guard_edge: what a run found at the edge runs (`Balancing.edge`): "steps"
            (default: own batch sizes, the slow silos' steps cut, updates normalized by
            their steps) or "uniform" (the app's own sizes and steps).
        profiles: 1 (default): when this server has balanced this model before, it asks the
            silos for their stored speed profiles before round 1 and starts balanced
            (fedlb.flower.profiles); 0: round 1 at every silo's B0.
        evaluate_every: federated evaluation every k rounds (and always after the last).
        evaluate_mode: 'with-train' (default): silos evaluate the model they receive inside the
            next round's train message, saving a whole framework round trip per evaluation;
            'separate': Flower's usual evaluate phase after each due round.
        dataset, partition, model, seed: what is trained and how it is split among silos
            ('iid' or 'classes:K', K classes per silo).
        server_test_fraction: share of the dataset held out for server-side evaluation (0: none).
        silo_test_fraction: share of each silo's part held out for its federated evaluation
            (under partition 'natural' of a dataset whose groups have test sets, heart-flamby,
            each silo evaluates on its group's and trains on all of its part instead).
        round_timeout: seconds to wait for replies before a round goes on without the missing.
        poll_interval: seconds between the server's pulls of replies (0: Flower's own loop,
            which sleeps 3 s between pulls).
        keep_updates: 1 writes every round's received updates and the aggregate to
            out_dir/updates/round-K.npz (an audit trail; 0: off).
        he_context: the server's public CKKS context (`fedlb keygen`'s server.context): updates
            travel and are averaged encrypted, the server never sees a model ('' : off).
        out_dir: where the run writes rounds.jsonl, summary.json and, after every round,
            checkpoint.npz ('' : nowhere).
        resume: a stopped run's out-dir: the run goes on after the last round its
            checkpoint.npz holds, with the same settings ('' : a fresh run).
    """

    HELP: ClassVar[dict[str, str]] = RUN_SETTING_HELP  # one line per key, for --help texts

    num_silos: int = 3
    num_rounds: int = 10
    local_steps: int = 20
    batch_size: int = 32
    learning_rate: float = 0.05
    momentum: float = 0.0
    batch_stream: str = "per-round"
    tuner: str = defaults.TUNER
    estimator: str = defaults.ESTIMATOR
    min_batch: int = 1
    max_batch: int = 0
    min_share: float = 0.0
    max_share: float = 0.0
    silo_examples: str = ""
    guard: int = 1
    guard_probe: float = StabilityGuard.DEFAULT_PROBE
    guard_edge: str = "steps"
    profiles: int = 1
    evaluate_every: int = 1
    evaluate_mode: str = "with-train"
    dataset: str = "digits"
    data_dir: str = ""
    partition: str = "iid"
    model: str = "mlp"
    seed: int = 0
    server_test_fraction: float = 0.2
    silo_test_fraction: float = 0.2
    round_timeout: float = 600.0
    poll_interval: float = 0.1
    keep_updates: int = 0
    tensorboard: int = 1
    he_context: str = ""
    out_dir: str = ""
    resume: str = ""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Build from Flower's run config (or any mapping with '-' keys)."""
        config = cls(**dataclass_arguments(cls, values, "setting"))
        config.check()
        return config

    def to_mapping(self) -> dict[str, Any]:
        return {setting_key(k): v for k, v in dataclasses.asdict(self).items()}

    def training_settings(self) -> dict[str, Any]:
        """The settings that decide how the silos train (all but NOT_TRAINING's)."""
        return {k: v for k, v in self.to_mapping().items() if k not in NOT_TRAINING}

    def declared_examples(self) -> dict[str, int] | None:
        """silo-examples as {silo label: count} (None: none declared); ValueError says
        what is wrong with it."""
        if not self.silo_examples.strip():
            return None
        declared: dict[str, int] = {}
        for part in self.silo_examples.split(","):
            label, _, count = part.partition("=")
            if not label.strip() or not count.strip().isdigit():
                raise ValueError(
                    f'silo-examples must list label=count pairs, "silo-0=600,silo-1=1200"; '
                    f"got {part.strip()!r}"
                )
            declared[label.strip()] = int(count)
        return declared

    def check(self) -> None:
        problems = []
        for name in (
            "num_silos",
            "num_rounds",
            "local_steps",
            "batch_size",
            "min_batch",
            "evaluate_every",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{setting_key(name)} must be >= 1")
        if self.max_batch < 0 or (self.max_batch and self.max_batch < self.batch_size):
            problems.append("max-batch must be 0 (no limit) or >= batch-size")
        if self.min_batch > self.batch_size:
            problems.append("min-batch must be <= batch-size")
        if not (math.isfinite(self.min_share) and 0 <= self.min_share <= 1):
            problems.append("min-share must be in [0, 1]")
        elif self.min_share > 0 and self.tuner != "pooled":
            problems.append("min-share needs tuner pooled")
        if not (math.isfinite(self.max_share) and 0 <= self.max_share <= 1):
            problems.append("max-share must be in [0, 1] (0: no cap)")
        try:
            self.declared_examples()
        except ValueError as error:
            problems.append(str(error))
        if not (math.isfinite(self.poll_interval) and self.poll_interval >= 0):
            problems.append("poll-interval must be a finite number >= 0")
        if self.guard not in (0, 1):
            problems.append("guard must be 0 or 1")
        if not (math.isfinite(self.guard_probe) and 0 <= self.guard_probe < 1):
            problems.append("guard-probe must be in [0, 1) (0: a fixed floor)")
        from fedlb.flower import Balancing  # the server's: a silo's process never checks

        try:
            Balancing(edge=self.guard_edge)
        except ValueError as error:
            problems.append(f"guard-{error}")
        if self.profiles not in (0, 1):
            problems.append("profiles must be 0 or 1")
        if self.keep_updates not in (0, 1):
            problems.append("keep-updates must be 0 or 1")
        if self.tensorboard not in (0, 1):
            problems.append("tensorboard must be 0 or 1")
        # numpy refuses a negative seed; the silos seed torch with seed x 1_000_003 + ...,
        # which must stay within 64 bits
        if not 0 <= self.seed < 2**32:
            problems.append(f"seed must be in 0..{2**32 - 1}")
        for field in fields(self):  # Flower carries the run config's ints as 64-bit ones
            value = getattr(self, field.name)
            if field.name != "seed" and isinstance(value, int) and not -(2**63) <= value < 2**63:
                problems.append(f"{field.name.replace('_', '-')} must fit in 64 bits")
        for key in ("learning-rate", "round-timeout"):
            value = getattr(self, key.replace("-", "_"))
            if not (math.isfinite(value) and value > 0):
                problems.append(f"{key} must be a finite number > 0")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            problems.append("momentum must be in [0, 1)")
        for key in ("server-test-fraction", "silo-test-fraction"):
            value = getattr(self, key.replace("-", "_"))
            if not 0 <= value < 1:
                problems.append(f"{key} must be in [0, 1)")
        for key, allowed in (
            ("tuner", TUNERS),
            ("estimator", ESTIMATORS),
            ("dataset", DATASETS),
            ("model", MODELS),
        ):
            if getattr(self, key) not in allowed:
                problems.append(f"{key} must be one of {', '.join(allowed)}")
        if self.evaluate_mode not in EVALUATE_MODES:
            problems.append(f"evaluate-mode must be one of {', '.join(EVALUATE_MODES)}")
        if self.batch_stream not in BATCH_STREAMS:
            problems.append(f"batch-stream must be one of {', '.join(BATCH_STREAMS)}")
        pairing = model_dataset_problem(self.model, self.dataset)
        if pairing is not None:
            problems.append(pairing)
        try:
            kind, _ = parse_partition(self.partition)
        except ValueError as error:
            problems.append(str(error))
        else:
            if kind == "natural" and self.dataset not in NATURAL_DATASETS:
                problems.append(
                    "partition natural needs a dataset with natural silos: "
                    + ", ".join(NATURAL_DATASETS)
                )
        if problems:
            raise ConfigError("invalid run settings: " + "; ".join(problems))


def setting_key(name: str) -> str:
    """The settings key of a field or option name: '-' for '_' (files, Flower's run config)."""
    return name.replace("_", "-")


def as_settings(**values: Any) -> dict[str, Any]:
    """Settings keyed as files and Flower's run config spell them, from Python names
    (batch_size=16 -> {"batch-size": 16}); None (an option not given) is left out. Callers
    name settings as Python names, so no key is typed twice."""
    return {setting_key(name): value for name, value in values.items() if value is not None}


def dataclass_arguments(cls: type, values: Mapping[str, Any], what: str) -> dict[str, Any]:
    """Keyword arguments for a dataclass of int/float/str/bool fields from a mapping whose
    keys spell the fields with '-' for '_': unknown keys and wrong types are a ConfigError
    that names the key ('what' says what a key is: "setting", "scenario key"). Ints are
    taken for floats; nothing else is converted."""
    known = {setting_key(f.name): f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown {what}(s) {', '.join(unknown)}; known: {', '.join(known)}")
    arguments: dict[str, Any] = {}
    for key, value in values.items():
        field = known[key]
        # 'int | None' fields are optional ints: None is their "not given", never a value
        kind = str(field.type).removesuffix(" | None")
        expected = {"int": int, "float": float, "str": str, "bool": bool}[kind]
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
            raise ConfigError(
                f"{what} {key} must be {expected.__name__}, got {value!r} ({type(value).__name__})"
            )
        arguments[field.name] = value
    return arguments
